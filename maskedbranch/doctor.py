"""Find the parameters that break DistributedDataParallel with ``find_unused_parameters=False``.

DDP with the default ``find_unused_parameters=False`` expects the autograd hook of every trainable
parameter to fire on every rank in every iteration. A parameter that is not in the autograd graph
of the loss on some rank (an ``if/else`` branch that did not run, a layer skipped by LayerDrop, a
head that is never called) does not fire: the first iteration silently skips averaging the
gradients and the second raises ``Expected to have finished reduction in the prior iteration``.

This module runs a model's forward and backward on one or several inputs, one per *simulated*
rank, in the current process (no process group, no processes) and reports, by qualified name:

* the parameters that are not in the graph on any rank (they always break DDP);
* the parameters that are in the graph on some ranks only (the routing diverges between ranks);
* per rank, whether each parameter got a nonzero gradient (``+``), an all-zero gradient (``0``),
  or is in the graph with an undefined gradient (``~``, what :func:`maskedbranch.anchor` and
  :class:`maskedbranch.MaskedBranch` give the parameters of branches that did not run: DDP's hook
  fires and fills zeros, so DDP is fine), or is not in the graph at all (``-``).

"In the graph" is decided the way DDP decides it: by walking the autograd graph from the loss to
the parameters' gradient accumulators (what ``find_unused_parameters=True`` does each iteration).
The gradients themselves come from :func:`torch.autograd.grad`, so nothing is accumulated into
``.grad``. The model is left as it was found: ``.grad`` untouched, buffers (BatchNorm running
statistics) restored after every simulated rank, ``model.training`` restored, and the random
number generators forked (the caller's random state does not advance). Parameters with
``requires_grad=False`` are listed apart: DDP ignores them.

Library::

    from maskedbranch.doctor import find_unused_parameters, find_divergent_parameters, Inputs

    print(find_unused_parameters(model, x, mask=m))      # one forward + backward
    report = find_divergent_parameters(model, [(x0,), (x1,), lambda rank: (make_batch(rank),)])
    report.safe, report.unused, report.divergent          # verdict and qualified names

Command line::

    python -m maskedbranch.doctor MODULE:FACTORY [--ranks K] [--seed S] [--eval] [--all]

``MODULE`` is an importable module name (``package.module``, found on ``PYTHONPATH`` or in the
current directory) or the path to a ``.py`` file; ``FACTORY`` names a callable in it (a dotted
attribute path is allowed, ``Builder.make``) that takes no arguments and returns one of:

* ``(model, inputs)``: one rank's inputs; every simulated rank feeds them (the model's own random
  routing still differs per rank, since torch is seeded per rank);
* ``(model, [inputs_rank0, inputs_rank1, ...])``: a *list*, one element per simulated rank;
* ``(model, make_inputs)``: a callable ``make_inputs(rank) -> inputs``, called once per rank;
* a dict with ``"model"`` and at least one of ``"inputs"`` (one rank's inputs),
  ``"inputs_per_rank"`` (a list, one element per rank) or ``"make_inputs"`` (``callable(rank)
  -> inputs``), and optionally ``"loss_fn"`` (``callable(output) -> scalar tensor``); a tuple may
  also carry the loss as a third element, ``(model, inputs, loss_fn)``.

One rank's inputs are a *tuple* of positional arguments, an :class:`Inputs` (positional and
keyword arguments), or any other single object (one positional argument: a tensor, a dict of
tensors, ...). ``model`` must be an ``nn.Module`` (a DDP-wrapped module is unwrapped).

Simulated ranks: ``len(inputs_per_rank)`` when the factory gives a list (``--ranks`` must then
agree), otherwise ``--ranks`` (default 4). Before rank ``r`` makes its inputs and runs, torch is
seeded with ``S + r`` (``--seed S``, default 0), so random routing (drop path, random gates)
differs per rank as it does in a real job where each rank seeds differently. With ``"make_inputs"``
and ``"inputs"`` both given, ``make_inputs`` is used when there is more than one rank.

Exit status: 0 safe for DDP with ``find_unused_parameters=False``, 1 some parameters would break
it, 2 usage error (bad arguments, the target cannot be imported, the factory raised or returned
something else), 3 the model raised in the forward, the loss or the backward.

The loss: ``loss_fn(output)`` when given, otherwise the sum of every floating (or complex) tensor
that requires grad found in the output, looking into tuples, lists, dicts and dataclasses.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import textwrap
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = [
    "Inputs",
    "ParameterUse",
    "RankFailure",
    "Report",
    "find_divergent_parameters",
    "find_unused_parameters",
    "main",
]

# Per-rank, per-parameter states (also the table's cells).
GRAD = "+"  # in the graph, nonzero gradient
ZERO = "0"  # in the graph, gradient all zeros
ANCHORED = "~"  # in the graph, gradient undefined (anchored): DDP's hook fires and fills zeros
UNUSED = "-"  # not in the graph: DDP's hook does not fire
FAILED = "!"  # the rank did not get that far (forward, loss or backward raised)

_IN_GRAPH = (GRAD, ZERO, ANCHORED)
_LEGEND = [
    f"{GRAD} gradient   {ZERO} zero gradient   {ANCHORED} in the graph, gradient undefined (anchored: DDP fills zeros)",
    f"{UNUSED} not in the graph (DDP's hook does not fire)   {FAILED} the rank failed",
]
_FIX_DIVERGENT = (
    "Fix: keep every branch in the graph with maskedbranch.MaskedBranch (if/else or top-k routing "
    "between branches) or maskedbranch.ResidualDropPath (stochastic depth / LayerDrop): branches "
    "that do not run are not computed, yet their parameters get a gradient hook on every rank. "
    "Otherwise DistributedDataParallel(..., find_unused_parameters=True), which walks the graph and "
    "all-reduces a bitmap every iteration."
)
_FIX_UNUSED = (
    "Parameters unused on every rank: delete them or freeze them (p.requires_grad_(False)) before "
    "wrapping the model in DDP; if other inputs do use them, route with maskedbranch.MaskedBranch "
    "as above, or use find_unused_parameters=True."
)
_BREAKS = (
    "With find_unused_parameters=False, DDP silently skips averaging the gradients in the first "
    "iteration and raises 'Expected to have finished reduction in the prior iteration' in the second."
)


class Inputs:
    """The positional and keyword arguments of one forward call: ``Inputs(x, mask=m)``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        parts = [_short(a) for a in self.args] + [f"{k}={_short(v)}" for k, v in self.kwargs.items()]
        return f"Inputs({', '.join(parts)})"


@dataclass
class ParameterUse:
    """How one trainable parameter fared on each simulated rank (see the module's states)."""

    name: str
    shape: Tuple[int, ...]
    ranks: Tuple[str, ...]
    aliases: Tuple[str, ...] = ()  # other qualified names of the same (tied) parameter

    @property
    def used_on(self) -> List[int]:
        """Ranks where the parameter is in the autograd graph (its DDP hook fires)."""
        return [r for r, s in enumerate(self.ranks) if s in _IN_GRAPH]

    @property
    def unused_on(self) -> List[int]:
        """Ranks that ran and where the parameter is not in the graph."""
        return [r for r, s in enumerate(self.ranks) if s == UNUSED]

    @property
    def kind(self) -> str:
        """``"ok"`` (in the graph on every rank that ran), ``"unused"`` (on none),
        ``"divergent"`` (on some only) or ``"unknown"`` (no rank ran)."""
        used, unused = self.used_on, self.unused_on
        if not used and not unused:
            return "unknown"
        if not unused:
            return "ok"
        return "divergent" if used else "unused"


@dataclass
class RankFailure:
    """A simulated rank whose inputs, forward, loss or backward raised."""

    rank: int
    stage: str  # "inputs", "forward", "loss" or "backward"
    error: str  # "TypeError: ..."
    traceback: str = field(default="", repr=False)


@dataclass
class Report:
    """What :func:`find_unused_parameters` / :func:`find_divergent_parameters` found.
    ``str(report)`` is a table and a verdict; :attr:`safe`, :attr:`unused` and
    :attr:`divergent` are the same in code."""

    model: str
    num_ranks: int
    training: bool
    parameters: List[ParameterUse]
    frozen: List[str] = field(default_factory=list)
    failures: List[RankFailure] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def unused(self) -> List[str]:
        """Parameters in the graph on no rank that ran (they break DDP)."""
        return [p.name for p in self.parameters if p.kind == "unused"]

    @property
    def divergent(self) -> List[str]:
        """Parameters in the graph on some ranks only (they break DDP)."""
        return [p.name for p in self.parameters if p.kind == "divergent"]

    @property
    def breaks_ddp(self) -> bool:
        """Some parameter would break DDP with ``find_unused_parameters=False``."""
        return bool(self.unused or self.divergent)

    @property
    def safe(self) -> bool:
        """Every rank ran and every trainable parameter is in the graph on every rank."""
        return not self.failures and not self.breaks_ddp

    @property
    def exit_code(self) -> int:
        """The command line's status: 0 safe, 1 breaks DDP, 3 a rank failed."""
        if self.failures:
            return 3
        return 1 if self.breaks_ddp else 0

    def __str__(self) -> str:
        return self.format()

    def format(self, show_all: Optional[bool] = None) -> str:
        """The report as text. ``show_all``: list every parameter (default: when there are at
        most 40; otherwise only those without a nonzero gradient on every rank)."""
        n = len(self.parameters)
        if show_all is None:
            show_all = n <= 40
        rows = [p for p in self.parameters if show_all or any(s != GRAD for s in p.ranks)]
        lines = [
            f"{self.model}: {n} trainable parameter{_s(n)}"
            + (f" ({len(self.frozen)} frozen, ignored by DDP)" if self.frozen else "")
            + f", {self.num_ranks} simulated rank{_s(self.num_ranks)}, "
            + ("training" if self.training else "eval")
            + " mode"
        ]
        if rows:
            lines += [""] + _table(rows, self.num_ranks)
            if len(rows) < n:
                lines.append(f"  ({n - len(rows)} more with a gradient on every rank not shown)")
            lines += [""] + ["  " + ln for ln in _LEGEND]
        elif n:
            lines += ["", f"  all {n} parameters got a gradient on every rank"]
        for f in self._distinct_failures():
            lines += ["", f"Rank{_s(len(f[1]))} {_ranks(f[1])} failed in the {f[0].stage}: {f[0].error}"]
            if f[0].traceback:
                lines += ["  " + ln for ln in f[0].traceback.rstrip().splitlines()]
        for note in self.notes:
            lines += ["", _wrap("Note: " + note)]
        lines += [""] + [_wrap(par) for par in self._verdict()]
        return "\n".join(lines)

    def _distinct_failures(self) -> List[Tuple[RankFailure, List[int]]]:
        seen: Dict[Tuple[str, str], Tuple[RankFailure, List[int]]] = {}
        for f in self.failures:
            seen.setdefault((f.stage, f.error), (f, []))[1].append(f.rank)
        return list(seen.values())

    def _verdict(self) -> List[str]:
        unused, divergent = self.unused, self.divergent
        out: List[str] = []
        if self.failures:
            ran = self.num_ranks - len({f.rank for f in self.failures})
            out.append(
                f"Verdict: incomplete: {len(self.failures)} of {self.num_ranks} simulated ranks failed"
                + (f"; among the {ran} that ran:" if ran else "; nothing to judge.")
            )
            if not ran:
                return out
        if not unused and not divergent:
            msg = "safe for DDP with find_unused_parameters=False"
            if not self.parameters:
                msg += " (no trainable parameters)"
            elif self.num_ranks == 1:
                msg += (
                    " on this input. Only one input was run: routing that depends on the input or on "
                    "random draws can still differ between ranks; check several (find_divergent_parameters, "
                    "or --ranks K)."
                )
            else:
                msg += f": every trainable parameter is in the autograd graph on all {self.num_ranks} ranks."
            out.append(("" if self.failures else "Verdict: ") + msg)
            return out
        parts = []
        if divergent:
            parts.append(f"{len(divergent)} used on some ranks only")
        if unused:
            parts.append(f"{len(unused)} unused on every rank" if self.num_ranks > 1 else f"{len(unused)} unused")
        out.append(
            ("" if self.failures else "Verdict: ")
            + "NOT safe for DDP with find_unused_parameters=False: "
            + f"{len(divergent) + len(unused)} parameter{_s(len(divergent) + len(unused))} ("
            + ", ".join(parts)
            + ")."
        )
        out.append(_BREAKS)
        if divergent:
            out.append(_FIX_DIVERGENT)
        if unused:
            out.append(_FIX_UNUSED)
        return out


# ----------------------------------------------------------------------------------------------
# The library API.


def find_unused_parameters(
    model: nn.Module, *args: Any, loss_fn: Optional[Callable[[Any], Tensor]] = None, **kwargs: Any
) -> Report:
    """Run ``model(*args, **kwargs)`` once in training mode, then the backward of the loss
    (``loss_fn(output)``, by default the sum of the floating tensors in the output), and report
    the trainable parameters that are not in the autograd graph (``report.unused``), by qualified
    name. Parameters in the graph with an all-zero or undefined (anchored) gradient are shown
    apart: DDP is fine with them. The model's state (``.grad``, buffers, ``training``) and the
    random state are left untouched. To check for routing that differs between ranks, use
    :func:`find_divergent_parameters`."""
    return find_divergent_parameters(model, [Inputs(*args, **kwargs)], loss_fn=loss_fn, seed=None)


def find_divergent_parameters(
    model: nn.Module,
    inputs_per_rank: Sequence[Any],
    *,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    seed: Optional[int] = 0,
    train: bool = True,
) -> Report:
    """Simulate one DDP iteration on ``len(inputs_per_rank)`` ranks, in this process: for each
    rank, run the forward on that rank's inputs and the backward of the loss, and report the
    parameters in the graph on some ranks but not others (``report.divergent``) and those in the
    graph on none (``report.unused``): both break DDP with ``find_unused_parameters=False``.

    Each element of ``inputs_per_rank`` is one rank's inputs: a tuple of positional arguments,
    an :class:`Inputs`, a callable returning either (called with the rank when it takes an
    argument, after seeding), or any other single object (one positional argument).

    ``seed``: torch is seeded with ``seed + rank`` before each rank makes its inputs and runs, so
    random routing differs per rank as in a job whose ranks seed differently (``None``: no
    seeding; the ranks draw one after the other from a fork of the current random state).
    ``train``: run in training mode (default) or eval mode. Buffers are restored after each rank,
    so every rank starts from the same state; ``.grad``, ``training`` and the caller's random
    state are left untouched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if isinstance(inputs_per_rank, (Tensor, Inputs, Mapping, str, bytes)) or not isinstance(inputs_per_rank, Sequence):
        raise TypeError(
            "inputs_per_rank: expected a list with one element per simulated rank, got "
            f"{type(inputs_per_rank).__name__} (for a single input use find_unused_parameters, or pass [inputs])"
        )
    if len(inputs_per_rank) == 0:
        raise ValueError("inputs_per_rank: expected at least one rank's inputs, got an empty list")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable(output) -> tensor, got {type(loss_fn).__name__}")

    trainable, frozen = _named_parameters(model)
    num_ranks = len(inputs_per_rank)
    states: List[List[str]] = []
    failures: List[RankFailure] = []
    notes: Dict[str, List[int]] = {}  # message -> ranks
    modes = [(m, m.training) for m in model.modules()]
    buffers = _snapshot_buffers(model)
    try:
        model.train(train)
        with torch.random.fork_rng(devices=_cuda_devices()):
            for rank, spec in enumerate(inputs_per_rank):
                if seed is not None:
                    torch.manual_seed(seed + rank)
                try:
                    states.append(_run_rank(model, trainable, spec, rank, loss_fn, notes.setdefault))
                except _RankError as e:
                    failures.append(e.failure)
                    states.append([FAILED] * len(trainable))
                finally:
                    _restore_buffers(buffers)
    finally:
        for m, mode in modes:
            m.training = mode
    params = [
        ParameterUse(names[0], tuple(p.shape), tuple(s[i] for s in states), tuple(names[1:]))
        for i, (names, p) in enumerate(trainable)
    ]
    return Report(
        model=type(model).__name__,
        num_ranks=num_ranks,
        training=train,
        parameters=params,
        frozen=frozen,
        failures=failures,
        notes=[
            msg if num_ranks == 1 else f"on rank{_s(len(ranks))} {_ranks(ranks)}, {msg}"
            for msg, ranks in notes.items()
        ],
    )


# ----------------------------------------------------------------------------------------------
# One simulated rank.


class _RankError(Exception):
    def __init__(self, failure: RankFailure) -> None:
        super().__init__(failure.error)
        self.failure = failure


def _fail(rank: int, stage: str, exc: BaseException) -> _RankError:
    return _RankError(RankFailure(rank, stage, f"{type(exc).__name__}: {exc}", _user_traceback(exc)))


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this module's frames and nn.Module's call wrappers."""
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [
            f
            for f in te.stack
            if os.path.abspath(f.filename) != os.path.abspath(__file__)
            and not (f.filename.endswith(os.path.join("torch", "nn", "modules", "module.py")) and "call_impl" in f.name)
        ]
    )
    return "".join(te.format())


def _run_rank(
    model: nn.Module,
    trainable: List[Tuple[List[str], nn.Parameter]],
    spec: Any,
    rank: int,
    loss_fn: Optional[Callable[[Any], Tensor]],
    note: Callable[[str, List[int]], List[int]],
) -> List[str]:
    try:
        args, kwargs = _as_call(_resolve(spec, rank))
    except Exception as e:
        raise _fail(rank, "inputs", e) from None
    with torch.enable_grad():
        try:
            out = model(*args, **kwargs)
        except Exception as e:
            raise _fail(rank, "forward", e) from None
        try:
            loss = _loss(out, loss_fn, lambda msg: note(msg, []).append(rank))
        except Exception as e:
            raise _fail(rank, "loss", e) from None
        if loss is None or not loss.requires_grad:
            return [UNUSED] * len(trainable)
        reached = _leaves_reached(loss.grad_fn) if loss.grad_fn is not None else {id(loss)}
        in_graph = [i for i, (_, p) in enumerate(trainable) if id(p) in reached]
        states = [UNUSED] * len(trainable)
        if not in_graph:
            return states
        try:
            grads = torch.autograd.grad(loss, [trainable[i][1] for i in in_graph], allow_unused=True)
        except Exception as e:
            raise _fail(rank, "backward", e) from None
    nonzero = _nonzero([g for g in grads if g is not None])
    it = iter(nonzero)
    for i, g in zip(in_graph, grads):
        states[i] = ANCHORED if g is None else (GRAD if next(it) else ZERO)
    return states


def _resolve(spec: Any, rank: int) -> Any:
    """A callable element makes the rank's inputs (called with the rank if it takes one)."""
    if callable(spec) and not isinstance(spec, (Tensor, nn.Module, Inputs)):
        return spec(rank) if _takes_an_argument(spec) else spec()
    return spec


def _takes_an_argument(fn: Callable) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return True
    return False


def _as_call(inputs: Any) -> Tuple[tuple, dict]:
    if isinstance(inputs, Inputs):
        return tuple(inputs.args), dict(inputs.kwargs)
    if isinstance(inputs, tuple) and not _is_namedtuple(inputs):
        return inputs, {}
    return (inputs,), {}


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _loss(out: Any, loss_fn: Optional[Callable[[Any], Tensor]], note: Callable[[str], None]) -> Optional[Tensor]:
    if loss_fn is not None:
        loss = loss_fn(out)
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss_fn returned {type(loss).__name__}, expected a tensor")
        if loss.numel() != 1:
            loss = loss.sum()
        if not loss.requires_grad:
            note("the loss does not require grad: it depends on no trainable parameter.")
        return loss
    tensors = list(_tensors(out))
    floating = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    live = [t for t in floating if t.requires_grad]
    if not live:
        what = "no floating tensor" if not floating else "no tensor that requires grad"
        note(
            f"the output ({type(out).__name__}) holds {what}: nothing in it depends on a trainable "
            "parameter (pass loss_fn if the loss is computed some other way)."
        )
        return None
    total: Optional[Tensor] = None
    for t in live:
        if t.is_complex():
            t = torch.view_as_real(t)
        s = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
        total = s if total is None else total + s.to(total.device)
    return total


def _tensors(obj: Any, depth: int = 0, seen: Optional[set] = None) -> Iterator[Tensor]:
    """Every tensor in a (nested) output: tuples, lists, dicts, dataclasses."""
    if isinstance(obj, Tensor):
        yield obj
        return
    if depth > 32:
        return
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        return
    for item in items:
        yield from _tensors(item, depth + 1, seen)


def _leaves_reached(root: Any) -> set:
    """ids of the leaf tensors whose gradient accumulators the backward of ``root`` reaches:
    the tensors whose DDP hook fires (the graph walk ``find_unused_parameters=True`` does)."""
    reached = set()
    seen = set()
    keep = []  # keep the node wrappers alive so that their ids stay unique
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        var = getattr(node, "variable", None)
        if isinstance(var, Tensor):
            reached.add(id(var))
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None:
                stack.append(nxt)
    return reached


def _nonzero(grads: List[Tensor]) -> List[bool]:
    """Whether each gradient has a nonzero entry: one device-to-host copy per device."""
    flags: List[bool] = [False] * len(grads)
    by_device: Dict[torch.device, List[Tuple[int, Tensor]]] = {}
    for i, g in enumerate(grads):
        if g.layout != torch.strided:
            g = g.coalesce().values() if g.is_sparse else g.to_dense()
        by_device.setdefault(g.device, []).append((i, g.any().reshape(())))
    for items in by_device.values():
        for (i, _), v in zip(items, torch.stack([v for _, v in items]).tolist()):
            flags[i] = bool(v)
    return flags


def _named_parameters(model: nn.Module) -> Tuple[List[Tuple[List[str], nn.Parameter]], List[str]]:
    by_id: Dict[int, Tuple[List[str], nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    trainable = [(names, p) for names, p in by_id.values() if p.requires_grad]
    frozen = [names[0] for names, p in by_id.values() if not p.requires_grad]
    return trainable, frozen


def _snapshot_buffers(model: nn.Module) -> List[Tuple[nn.Module, str, Tensor, Tensor]]:
    saved = []
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                saved.append((m, name, b, b.detach().clone()))
    return saved


def _restore_buffers(saved: List[Tuple[nn.Module, str, Tensor, Tensor]]) -> None:
    with torch.no_grad():
        for m, name, original, copy in saved:
            if m._buffers.get(name) is not original:
                m._buffers[name] = original  # the forward replaced the buffer object
            if original.shape != copy.shape:
                original.data = copy
            else:
                original.copy_(copy)


def _cuda_devices() -> List[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


# ----------------------------------------------------------------------------------------------
# Text helpers.


def _wrap(paragraph: str) -> str:
    return textwrap.fill(paragraph, width=100, break_long_words=False, break_on_hyphens=False)


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _short(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"tensor{tuple(v.shape)}"
    return type(v).__name__


def _ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: List[str] = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if j == i else (f"{ranks[i]}, {ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}"))
        i = j + 1
    return ", ".join(out)


def _status(p: ParameterUse, num_ranks: int) -> str:
    kind = p.kind
    if kind == "ok":
        return "ok"
    if kind == "unknown":
        return "unknown (no rank ran)"
    if kind == "unused":
        return "UNUSED" if num_ranks == 1 else "UNUSED on every rank"
    return f"DIVERGENT: not in the graph on rank{_s(len(p.unused_on))} {_ranks(p.unused_on)}"


def _table(rows: List[ParameterUse], num_ranks: int) -> List[str]:
    head = ["parameter", "shape"] + [f"r{r}" for r in range(num_ranks)] + ["status"]
    body = []
    for p in rows:
        name = p.name + (f" (= {', '.join(p.aliases)})" if p.aliases else "")
        body.append([name, "(" + ", ".join(map(str, p.shape)) + ")"] + list(p.ranks) + [_status(p, num_ranks)])
    widths = [max(len(r[c]) for r in [head] + body) for c in range(len(head))]
    fmt = lambda r: "  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(head)] + [fmt(r) for r in body]


# ----------------------------------------------------------------------------------------------
# Command line.


class _UsageError(Exception):
    pass


def _load_factory(target: str) -> Callable[[], Any]:
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise _UsageError(f"TARGET must be MODULE:FACTORY (for example package.module:make_model), got {target!r}")
    try:
        if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
            path = os.path.abspath(module_part)
            if not os.path.isfile(path):
                raise _UsageError(f"no such file: {module_part}")
            name = os.path.splitext(os.path.basename(path))[0]
            sys.path.insert(0, os.path.dirname(path))  # so that the file's own imports resolve
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_part)
    except _UsageError:
        raise
    except BaseException as e:  # SystemExit from a module that runs a script on import, too
        raise _UsageError(f"cannot import {module_part!r}:\n{_format_exc(e)}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _UsageError(f"{module_part!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise _UsageError(f"{target} is a {type(obj).__name__}, not a callable factory")
    return obj


def _format_exc(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


_CONTRACT = (
    "the factory must return (model, inputs), (model, [inputs_rank0, inputs_rank1, ...]), "
    "(model, make_inputs) or a dict with 'model' and one of 'inputs', 'inputs_per_rank', "
    "'make_inputs' (and optionally 'loss_fn')"
)


def _interpret(result: Any) -> Dict[str, Any]:
    spec: Dict[str, Any] = {}
    if isinstance(result, Mapping):
        unknown = set(result) - {"model", "inputs", "inputs_per_rank", "make_inputs", "loss_fn"}
        if unknown:
            raise _UsageError(f"the factory's dict has unknown keys {sorted(map(str, unknown))}; {_CONTRACT}")
        spec = dict(result)
    elif isinstance(result, tuple) and len(result) in (2, 3) and not _is_namedtuple(result):
        spec["model"], inputs = result[0], result[1]
        if len(result) == 3:
            spec["loss_fn"] = result[2]
        if isinstance(inputs, list):
            spec["inputs_per_rank"] = inputs
        elif callable(inputs) and not isinstance(inputs, (Tensor, nn.Module, Inputs)):
            spec["make_inputs"] = inputs
        else:
            spec["inputs"] = inputs
    else:
        raise _UsageError(f"the factory returned {type(result).__name__}; {_CONTRACT}")
    model = spec.get("model")
    if not isinstance(model, nn.Module):
        raise _UsageError(f"the factory's model is a {type(model).__name__}, expected an nn.Module; {_CONTRACT}")
    if not any(k in spec for k in ("inputs", "inputs_per_rank", "make_inputs")):
        raise _UsageError(f"the factory gave a model but no inputs; {_CONTRACT}")
    per_rank = spec.get("inputs_per_rank")
    if per_rank is not None and (not isinstance(per_rank, (list, tuple)) or not per_rank):
        raise _UsageError("'inputs_per_rank' must be a non-empty list, one element per simulated rank")
    maker = spec.get("make_inputs")
    if maker is not None and not callable(maker):
        raise _UsageError(f"'make_inputs' must be a callable(rank) -> inputs, got {type(maker).__name__}")
    loss_fn = spec.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise _UsageError(f"'loss_fn' must be a callable(output) -> tensor, got {type(loss_fn).__name__}")
    return spec


def _per_rank_inputs(spec: Dict[str, Any], ranks: Optional[int]) -> List[Any]:
    per_rank = spec.get("inputs_per_rank")
    if per_rank is not None:
        if ranks is not None and ranks != len(per_rank):
            raise _UsageError(f"--ranks {ranks} disagrees with the factory's {len(per_rank)} per-rank inputs")
        return list(per_rank)
    k = 4 if ranks is None else ranks
    maker = spec.get("make_inputs")
    if maker is not None and (k > 1 or "inputs" not in spec):
        return [functools.partial(maker, r) for r in range(k)]
    return [spec["inputs"]] * k


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""  # None under python -OO
    start, end = doc.find("``MODULE`` is"), doc.find("The loss:")
    epilog = None
    if 0 <= start < end:
        epilog = doc[start:end].replace("``", "").replace("an :class:`Inputs`", "a maskedbranch.doctor.Inputs")
    return argparse.ArgumentParser(
        prog="python -m maskedbranch.doctor",
        description=_wrap(
            "Run a model's forward and backward on several simulated ranks (in this process) and list "
            "the parameters that would break DistributedDataParallel with find_unused_parameters=False: "
            "parameters not in the autograd graph on some or all ranks."
        ),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    parser.add_argument("target", metavar="MODULE:FACTORY", help="the factory, for example package.module:make_model")
    parser.add_argument(
        "--ranks", type=_positive, default=None, metavar="K",
        help="simulated ranks (default: the number of per-rank inputs, else 4)",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="rank r is seeded with S + r (default 0)")
    parser.add_argument("--eval", action="store_true", help="run in eval mode (default: training mode)")
    parser.add_argument("--all", action="store_true", help="list every parameter (default: all if at most 40)")
    args = parser.parse_args(argv)
    try:
        factory = _load_factory(args.target)
        try:
            result = factory()
        except Exception as e:
            raise _UsageError(f"the factory {args.target} raised:\n{_format_exc(e)}") from None
        spec = _interpret(result)
        inputs = _per_rank_inputs(spec, args.ranks)
    except _UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    report = find_divergent_parameters(
        spec["model"], inputs, loss_fn=spec.get("loss_fn"), seed=args.seed, train=not args.eval
    )
    print(f"maskedbranch doctor: {args.target}")
    print(report.format(show_all=True if args.all else None))
    sys.stdout.flush()
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
