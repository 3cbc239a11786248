"""The library entry points: simulate DDP ranks in this process, sort the parameters into
findings (report.py) and group them by module.

Routing modules tie the parameters of skipped branches into the graph in a DDP job, not in one
process: the ranks run under ``as_if_under_ddp`` so that the graph is the one DDP would see.
Forward pre-hooks count each routing module's calls; the branches that ran are the bits the
module records for the step-time pruning (maskedbranch/unused_grads.py). Together they tell a
branch that no rank sampled from a parameter that nothing uses.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import _wiring
from ..residual import ResidualDropPath
from ..nn import MaskedBranch
from . import report as R
from .rank import Inputs, RankError, restore_buffers, run_rank, snapshot_buffers

_ROUTERS = (MaskedBranch, ResidualDropPath)


def find_unused_parameters(
    model: nn.Module, *args: Any, loss_fn: Optional[Callable[[Any], Tensor]] = None, **kwargs: Any
) -> R.Report:
    """Run ``model(*args, **kwargs)`` once in training mode and the backward of the loss
    (``loss_fn(output)``, else the sum of the floating tensors in the output); report the trainable
    parameters out of the autograd graph (``report.unused``). For routing that differs between
    ranks, use :func:`find_divergent_parameters`."""
    return find_divergent_parameters(model, [Inputs(*args, **kwargs)], loss_fn=loss_fn, seed=None)


def find_divergent_parameters(
    model: nn.Module,
    inputs_per_rank: Sequence[Any],
    *,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    seed: Optional[int] = 0,
    train: bool = True,
) -> R.Report:
    """Simulate one DDP iteration on ``len(inputs_per_rank)`` ranks in this process; report the
    parameters in the graph on some ranks only (``divergent``) or on none (``unused``), which break
    DDP with ``find_unused_parameters=False``, and the routing modules' branches that no rank
    sampled (``not_sampled``, fine for DDP), grouped by module (``groups``).

    One rank's inputs: a tuple of positional arguments, an :class:`Inputs`, a callable returning
    either (given the rank if it takes an argument), or one positional argument. torch is seeded
    with ``seed + rank`` before each rank (``None``: not seeded). ``train``: training or eval
    mode. ``.grad``, buffers, ``training`` flags and the caller's random state are left as found.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if isinstance(inputs_per_rank, (Tensor, Inputs, Mapping, str, bytes)) or not isinstance(inputs_per_rank, Sequence):
        raise TypeError(f"inputs_per_rank: expected a list with one element per simulated rank, got "
                        f"{type(inputs_per_rank).__name__} (for one input use find_unused_parameters, or pass [inputs])")
    if not inputs_per_rank:
        raise ValueError("inputs_per_rank: expected at least one rank's inputs, got an empty list")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable(output) -> tensor, got {type(loss_fn).__name__}")

    by_id: Dict[int, Tuple[List[str], nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    trainable = [(names, p) for names, p in by_id.values() if p.requires_grad]
    params = [p for _, p in trainable]
    states: List[List[str]] = []
    failures: List[R.RankFailure] = []
    notes: Dict[str, List[int]] = {}
    modes = [(m, m.training) for m in model.modules()]
    buffers = snapshot_buffers(model)
    watch = _Watch(model)
    try:
        model.train(train)
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda), _wiring.as_if_under_ddp(model) as ddp:
            for rank, spec in enumerate(inputs_per_rank):
                if seed is not None:
                    torch.manual_seed(seed + rank)
                watch.start()
                try:
                    note = lambda msg, r=rank: notes.setdefault(msg, []).append(r)  # noqa: E731
                    states.append(run_rank(model, params, spec, rank, loss_fn, note, ddp.tie))
                except RankError as e:
                    failures.append(e.failure)
                    states.append([R.FAILED] * len(params))
                finally:
                    watch.stop()
                    restore_buffers(buffers)
    finally:
        watch.close()
        for m, mode in modes:
            m.training = mode
    uses = [R.ParameterUse(names[0], tuple(p.shape), tuple(s[i] for s in states), tuple(names[1:]))
            for i, (names, p) in enumerate(trainable)]
    ran = [r for r in range(len(inputs_per_rank)) if r not in {f.rank for f in failures}]
    not_called = _classify(model, params, uses, watch, ran)
    routing = watch.routing
    flagged = {u.detail for u in uses if u.finding == R.NOT_CALLED}
    # Not called, yet no row says so: its branches ran directly, or it has no trainable parameters.
    notes.update((_never_called(r) + ".", []) for r in routing if r.name in not_called and _never_called(r) not in flagged)
    one = len(inputs_per_rank) == 1
    return R.Report(
        model=type(model).__name__, num_ranks=len(inputs_per_rank), training=train, parameters=uses,
        groups=_group(uses), routing=routing, not_called=not_called,
        frozen=[names[0] for names, p in by_id.values() if not p.requires_grad], failures=failures,
        notes=[m if one or not r else f"on rank{R.plural(len(r))} {R.ranks_text(r)}, {m}" for m, r in notes.items()],
    )


class _Watch:
    """Each routing module's calls and rows per rank (forward pre-hooks) and the branches that ran
    (the bits the module records for the step-time pruning, put back as they were afterwards)."""

    def __init__(self, model: nn.Module) -> None:
        names = {id(m): name for name, m in model.named_modules()}
        self.mods = [m for m in model.modules() if isinstance(m, _ROUTERS)]
        self.routing = [R.RoutingUse(names[id(m)], type(m).__name__, [names.get(id(u), "?") for u in m._unit_modules()],
                                     drop_prob=getattr(m, "drop_prob", None), mode=getattr(m, "mode", ""))
                        for m in self.mods]
        self.saved = [m._unit.bits for m in self.mods]
        self.handles = [m.register_forward_pre_hook(functools.partial(self._pre, r), with_kwargs=True)
                        for m, r in zip(self.mods, self.routing)]

    @staticmethod
    def _pre(r: R.RoutingUse, module: nn.Module, args: tuple, kwargs: dict) -> None:
        r.calls[-1] += 1
        x = args[0] if args else kwargs.get("x")
        r.rows += x.shape[0] if isinstance(x, Tensor) and x.dim() > 0 else 0

    def start(self) -> None:
        for m, r in zip(self.mods, self.routing):
            r.calls.append(0)
            m._unit.bits, m._unit.called = 0, False

    def stop(self) -> None:
        for m, r in zip(self.mods, self.routing):
            r.ran.append(m._unit.bits)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for m, bits in zip(self.mods, self.saved):
            m._unit.bits = bits


def _classify(model: nn.Module, params: List[Tensor], uses: List[R.ParameterUse], watch: _Watch,
              ran: List[int]) -> List[str]:
    """Set each parameter's finding and detail; return the routing modules never called."""
    routing = watch.routing
    owners: Dict[int, List[Tuple[int, int]]] = {}  # id(param) -> [(routing module, branch)], outer first
    for k, m in enumerate(watch.mods):
        for i, ps in enumerate(m._unit_groups()):
            for p in ps:
                owners.setdefault(id(p), []).append((k, i))
    idle = [bool(ran) and not any(r.calls[i] for i in ran) for r in routing]
    # A module inside a branch that never ran was not called because of that: not a finding.
    unsampled = [u + "." for r in routing for i, u in enumerate(r.units) if not r.branch_ran(i)]
    not_called = [r.name for k, r in enumerate(routing) if idle[k] and not any(r.name.startswith(u) for u in unsampled)]
    divergent = [u.name for u in uses if u.kind == "divergent"]
    modules = dict(model.named_modules())
    for p, u in zip(params, uses):
        own = owners.get(id(p), [])
        if u.kind == "ok":
            units: Dict[int, List[int]] = {}
            for k, i in own:
                units.setdefault(k, []).append(i)
            unpicked = [k for k, us in units.items() if not any(routing[k].branch_ran(i) for i in us)]
            if unpicked and R.GRAD not in u.ranks:
                u.finding, u.detail = R.NOT_SAMPLED, _sampling(routing[unpicked[0]])
        elif u.kind == "divergent":
            u.finding = R.DIVERGENT
            for k, _ in own:
                r = routing[k]
                if idle[k]:
                    u.detail = f"{r.type} {r.name} is never called: its branches are called directly"
                elif not all(r.calls[i] for i in ran):
                    u.detail = f"{r.type} {r.name} is called on ranks {R.ranks_text([i for i in ran if r.calls[i]])} only"
        elif u.kind == "unused":
            uncalled = [routing[k] for k, _ in own if routing[k].name in not_called]
            # A plain-Python routing choice: the nearest ModuleList / ModuleDict above it holds
            # parameters that diverge between ranks.
            parts = u.name.split(".")[:-1]
            lists = [".".join(parts[:n]) for n in range(len(parts), 0, -1)
                     if isinstance(modules.get(".".join(parts[:n])), (nn.ModuleList, nn.ModuleDict))]
            if uncalled:
                u.finding, u.detail = R.NOT_CALLED, _never_called(uncalled[0])
            elif lists and any(d.startswith(lists[0] + ".") for d in divergent):
                u.finding, u.detail = R.CHOICE, f"other choices in {lists[0]} are used on some ranks only"
            else:
                u.finding = R.UNUSED_
    return not_called


def _never_called(r: R.RoutingUse) -> str:
    return f"{r.type} {r.name} is in the model, but the forward never calls it"


def _sampling(r: R.RoutingUse) -> str:
    calls = sum(r.calls)
    if r.drop_prob is not None:
        p = float(r.drop_prob)
        skipped = p ** (r.rows if r.mode == "row" else calls)  # the chance of these draws
        return f"{r.name} (drop_prob={p:g}, mode={r.mode}) dropped it in all {calls} calls (probability {skipped:.2g})"
    ran = [i for i in range(len(r.units)) if r.branch_ran(i)]
    which = f"branch{'' if len(ran) == 1 else 'es'} {R.ranks_text(ran) or 'none'}"
    return f"{r.type} {r.name} ran {which} of {len(r.units)} in {calls} calls"


def _group(uses: List[R.ParameterUse]) -> List[R.Group]:
    """Each parameter goes to the outermost module (a prefix of its name) whose parameters all share
    its finding and per-rank states; groups come in the model's parameter order."""
    key = lambda u: (u.finding, u.ranks, u.detail)  # noqa: E731
    keys: Dict[str, set] = {}
    for u in uses:
        parts = u.name.split(".")
        for n in range(len(parts)):
            keys.setdefault(".".join(parts[:n]), set()).add(key(u))
    groups: Dict[str, List[R.ParameterUse]] = {}
    for u in uses:
        parts = u.name.split(".")
        prefixes = (".".join(parts[:n]) for n in range(len(parts)))
        groups.setdefault(next((p for p in prefixes if len(keys[p]) == 1), u.name), []).append(u)
    return [R.Group(name or "(model)", [u.name for u in us], "".join(us[0].ranks), us[0].finding, us[0].detail)
            for name, us in groups.items()]
