"""Whole-batch choices inside a compiled graph (an int or 0-d tensor gate, a "batch" drop path):
one graph serves every choice, only the chosen branch computes, and only its buffers change, as
with if/else. The forms (``STACKED``, ``CONDS``, ``ROWS``) and why: docs/design.md, "Data flow"
(torch.compile) and "Compiled whole-batch choices run one branch, stacked or through
`torch.cond`". Also the buffers carried as copies for the routed rows (:func:`call_carrying`).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import _autograd, _compat, _unit, _warn
from ._ops import ops
from ._signatures import traced_signature

COND_TORCH = "2.13"  # torch.cond with buffers carried, in training: tested on 2.13.0 and 2.14.1

ROWS, STACKED, CONDS = 0, 1, 2


def cond_available() -> bool:
    return hasattr(torch, "cond") and torch.__version__ >= COND_TORCH


# ----------------------------------------------------------------------------------------------
# Structure: whether every branch runs the same code on tensors of the same kinds.

_MODULE_STATE = frozenset(vars(nn.Module()))  # what nn.Module.__init__ sets (hooks, dicts, training)
_HOOKS = tuple(k for k in _MODULE_STATE if k.endswith("hooks") and not k.endswith("with_kwargs") and not k.endswith("always_called"))
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _value_key(v: Any) -> Any:
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_key(a) for a in v))
    return ("object", id(v))  # functions, partials, tensors held as attributes: the same object only


def _tensor_key(t: Optional[Tensor]) -> Any:
    if t is None:
        return None
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, t.layout)


def _module_key(m: nn.Module) -> Optional[tuple]:
    if any(getattr(m, h, None) for h in _HOOKS):
        return None  # hooks (a module's own state): not compared
    attrs = tuple(sorted((k, _value_key(v)) for k, v in vars(m).items() if k not in _MODULE_STATE))
    return (
        type(m), m.training, attrs,
        tuple((k, _tensor_key(p)) for k, p in m._parameters.items()),
        tuple((k, _tensor_key(b), k in m._non_persistent_buffers_set) for k, b in m._buffers.items()),
        tuple(m._modules),
    )


def structure_key(branch: Any) -> Optional[tuple]:
    """What the stacked form needs equal across branches; None when a branch is not a module,
    holds hooks, or shares a parameter or buffer within itself."""
    if not isinstance(branch, nn.Module):
        return None
    keys = []
    for name, m in branch.named_modules(remove_duplicate=False):
        k = _module_key(m)
        if k is None:
            return None
        keys.append((name, k))
    return tuple(keys)


def stackable(branches: Sequence[Any]) -> bool:
    first = structure_key(branches[0])
    if first is None or any(structure_key(b) != first for b in branches[1:]):
        return False
    seen: set = set()
    for b in branches:  # no tensor shared between branches (each is written back on its own)
        for t in list(b.parameters()) + list(b.buffers()):
            if id(t) in seen:
                return False
            seen.add(id(t))
    return True


def _warn_rows(where: str) -> None:
    _warn.warn_once(
        ("rows", where),
        f"maskedbranch: {where} with a whole-batch gate under torch.compile runs every branch on its rows "
        f"(a zero-weighted row for the branches not chosen) with torch {torch.__version__}: torch.cond "
        f"trains and carries the branches' buffers from torch {COND_TORCH} on, and these branches differ in "
        "structure, so they cannot be stacked. Results, BatchNorm statistics included, equal eager mode's; "
        "what is lost is the skipped compute of the branches not chosen.",
    )


def form_of(branches: Sequence[Any], where: str) -> int:
    if stackable(branches):
        return STACKED
    if cond_available():
        return CONDS
    _warn_rows(where)
    return ROWS


@torch.compiler.assume_constant_result
def form_while_tracing(key: int) -> int:
    """The form of the routing module ``key`` (by id)'s table, decided at its first trace and kept
    in its unit (dropped with the table when the module changes)."""
    owner = _unit.module_by_id(key)
    if owner is None:
        return ROWS
    unit = owner._unit
    if unit.choice is None:
        unit.choice = form_of(list(owner._unit_modules()), type(owner).__name__)
    return unit.choice


# ----------------------------------------------------------------------------------------------
# Buffers carried as copies.


def _named_buffers(branch: Any) -> List[Tuple[str, Tensor]]:
    return list(branch.named_buffers()) if isinstance(branch, nn.Module) else []


def _named_parameters(branch: Any) -> List[Tuple[str, Tensor]]:
    return list(branch.named_parameters()) if isinstance(branch, nn.Module) else []


def call_carrying(branch: Any, h: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                  params: Optional[Dict[str, Tensor]] = None) -> Tuple[Any, List[Tuple[Tensor, Tensor]]]:
    """``branch(h, *args, **kwargs)`` with its buffers replaced by copies (``params``: parameters
    swapped in as well, by name), and (buffer, copy after the call) for each: what the call
    would have written into the buffers."""
    named = _named_buffers(branch)
    if not named:
        if params:
            return torch.func.functional_call(branch, params, (h, *args), kwargs, strict=False), []
        return branch(h, *args, **kwargs), []
    fresh = {n: b.clone() for n, b in named}
    y = torch.func.functional_call(branch, {**(params or {}), **fresh}, (h, *args), kwargs, strict=False)
    return y, [(b, fresh[n]) for n, b in named]


def write_back(pairs: Sequence[Tuple[Tensor, Tensor]], live: Optional[Tensor] = None) -> None:
    """Each buffer gets its copy's value (``live``, a bool 0-d tensor: only where it is true)."""
    if not pairs:
        return
    with torch.no_grad():
        for b, new in pairs:
            b.copy_(new if live is None else torch.where(live.to(b.device), new.to(b.dtype), b))


def _out_of_cond(t: Tensor) -> Tensor:
    # An integer output of a cond fails its autograd (torch 2.14.1); float64 is exact below 2**53.
    return t if t.is_floating_point() else t.to(torch.float64)


# ----------------------------------------------------------------------------------------------
# The forms.


def check_id(gate: Tensor, n: int) -> Tensor:
    """The gate as an int64 0-d tensor, failing when it is outside -1..n-1 (an ``index_select``
    on n + 1 entries: the only check a graph can make without reading the value)."""
    gate = gate.to(torch.int64)
    return torch.arange(-1, n, dtype=torch.int64, device=gate.device).index_select(0, (gate + 1).reshape(1)).reshape(())


@torch.compiler.assume_constant_result
def _state_names(key: int) -> Tuple[tuple, tuple]:
    """The parameter and buffer names of the first branch of routing module ``key`` (by id), each
    as (submodule path, attribute, full name), a constant of the trace: the stacked form reads
    every branch's tensors by attribute, keeping the module walks out of Dynamo's trace."""
    first = _unit.module_by_id(key)._unit_modules()[0]

    def split(named):
        return tuple((tuple(n.split(".")[:-1]), n.rsplit(".", 1)[-1], n) for n, _ in named)

    return split(first.named_parameters()), split(first.named_buffers())


def _call_swapped(module: nn.Module, param_names: tuple, buffer_names: tuple, state: Dict[str, Tensor], x: Tensor,
                  args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``module(x, *args, **kwargs)`` with its parameters and buffers (by the names of
    :func:`_state_names`) replaced by ``state``'s tensors for the call: ``torch.func.functional_call``
    in fewer traced steps. A cond's branches keep functional_call: Dynamo refuses a cond branch
    that writes into a module outside it, and lets functional_call's writes through."""
    swapped = []
    for names, kind in ((param_names, "_parameters"), (buffer_names, "_buffers")):
        for path, name, full in names:
            owner = module
            for p in path:
                owner = owner._modules[p]
            table = getattr(owner, kind)
            swapped.append((table, name, table[name]))
            table[name] = state[full]
    try:
        return module(x, *args, **kwargs)
    finally:
        for table, name, old in reversed(swapped):
            table[name] = old


def stacked(owner: nn.Module, branches: Sequence[nn.Module], x: Tensor, gate: Tensor, args: Tuple[Any, ...],
            kwargs: Dict[str, Any], nonnegative: bool = False) -> Tensor:
    """The chosen branch's parameters and buffer copies (``maskedbranch::pick``: one op for all
    of a table's parameters, one for its buffers), run through the first branch's code; zeros for
    -1 unless the gate is known to be ``nonnegative`` (an int >= 0). The buffers are written back
    into the chosen branch's (``maskedbranch::put_``, nothing for -1).

    The zeros for -1 are a ``torch.where`` on the output (after a ReLU it costs a slow bool mask:
    docs/guides/compile.md); an opaque pick of the output would cost branches with BatchNorm, the
    common case, more."""
    first = branches[0]
    n = len(branches)
    param_names, buffer_names = _state_names(id(owner))
    params: List[Tensor] = []
    buffers: List[Tensor] = []
    for b in branches:  # loops, not calls: each call Dynamo inlines costs it a frame
        for names, kind, out in ((param_names, "_parameters", params), (buffer_names, "_buffers", buffers)):
            for path, name, _ in names:
                m = b
                for p in path:
                    m = m._modules[p]
                out.append(getattr(m, kind)[name])
    device = params[0].device if params else buffers[0].device if buffers else x.device
    idx = (gate if nonnegative else torch.where(gate < 0, torch.zeros_like(gate), gate)).to(device)
    state = dict(zip((full for _, _, full in param_names), _autograd.pick(params, idx, n))) if params else {}
    picked = ops.pick(buffers, idx, n) if buffers else []
    state.update(zip((full for _, _, full in buffer_names), picked))
    y = _call_swapped(first, param_names, buffer_names, state, x, args, kwargs)
    if buffers:
        with torch.no_grad():
            ops.put_(buffers, gate.to(device), n, picked)
    if nonnegative or not isinstance(y, Tensor):
        return y
    return torch.where((gate >= 0).to(y.device), y, torch.zeros((), dtype=y.dtype, device=y.device))


def _rows(t: Tensor) -> Tensor:
    """``t`` as a cond's operand or output: 2-D, a row per batch row, a shape with one layout, which
    inductor's layout optimization cannot make differ from the cond's traced strides (docs/design.md,
    "Compiled whole-batch choices run one branch"). The branches' parameters enter flattened too."""
    return t.reshape(t.shape[0], -1)


def _call_inside(module: Optional[nn.Module], branch: Callable, h: Tensor, params: Sequence[Tuple[str, Tensor]],
                 flat: Sequence[Tensor], names: Sequence[str], fresh: Sequence[Tensor], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
    """Inside a cond: ``module`` on ``h`` with its parameters rebuilt from their flat operands
    and its buffers the fresh copies (``branch``, a function that holds neither, called as it is)."""
    if names or params:
        state = {n: f.reshape(p.shape) for (n, p), f in zip(params, flat)}
        state.update(zip(names, fresh))
        return torch.func.functional_call(module, state, (h, *args), kwargs, strict=False)
    return branch(h, *args, **kwargs)


def conds(branches: Sequence[Any], x: Tensor, gate: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any],
          signature: Tuple[tuple, torch.dtype], views: Sequence[bool]) -> Tensor:
    """One ``torch.cond`` per branch (``gate == k``), chained, never nested; zeros of ``signature``
    when no branch is chosen. A skipping cond passes the running output through as a copy, and
    ``views[k]`` (branch k returns its input or a view of it) gets one: a cond's outputs may not
    alias its inputs."""
    trailing, dtype = signature
    shape = x.shape
    y = torch.zeros((shape[0], math.prod(trailing)), dtype=dtype, device=x.device)
    for k, branch in enumerate(branches):
        named = _named_buffers(branch)
        names = [n for n, _ in named]

        params = _named_parameters(branch)

        def run(y: Tensor, h: Tensor, flat: Tuple[Tensor, ...], bufs: Tuple[Tensor, ...], branch=branch, names=names,
                params=params, copy=views[k]):
            fresh = tuple(b.clone() for b in bufs)
            out = _call_inside(branch, branch, h.reshape(shape), params, flat, names, fresh, args, kwargs)
            return _rows(out.clone() if copy else out), tuple(_out_of_cond(b) for b in fresh)

        def skip(y: Tensor, h: Tensor, flat: Tuple[Tensor, ...], bufs: Tuple[Tensor, ...]):
            return y.clone(), tuple(_out_of_cond(b.clone()) for b in bufs)

        operands = (y, _rows(x), tuple(p.reshape(-1) for _, p in params), tuple(b.clone() for _, b in named))
        y, new = torch.cond(gate == k, run, skip, operands)
        write_back([(b, nb) for (_, b), nb in zip(named, new)])
    return y.reshape(shape[0], *trailing)


def residual(branch: Any, module: Optional[nn.Module], x: Tensor, kept: Tensor, args: Tuple[Any, ...],
             kwargs: Dict[str, Any], scale: Any, check: Callable[[Any, Tensor], Tensor]) -> Tensor:
    """``x + scale * branch(x)`` when ``kept`` (a bool 0-d tensor), else ``x``, in one torch.cond;
    ``module`` (the branch's module, or None for a function that changes no state) has its
    buffers carried."""
    named, params = _named_buffers(module), _named_parameters(module)
    names = [n for n, _ in named]
    shape = x.shape

    def run(h: Tensor, flat: Tuple[Tensor, ...], bufs: Tuple[Tensor, ...]):
        h = h.reshape(shape)
        fresh = tuple(b.clone() for b in bufs)
        y = check(_call_inside(module, branch, h, params, flat, names, fresh, args, kwargs), h)
        if y.dtype != h.dtype:
            y = y.to(torch.promote_types(y.dtype, h.dtype))
        out = h + (y * scale if isinstance(scale, Tensor) or scale != 1.0 else y)
        return _rows(out.to(h.dtype)), tuple(_out_of_cond(b) for b in fresh)

    def skip(h: Tensor, flat: Tuple[Tensor, ...], bufs: Tuple[Tensor, ...]):
        return h.clone(), tuple(_out_of_cond(b.clone()) for b in bufs)

    operands = (_rows(x), tuple(p.reshape(-1) for _, p in params), tuple(b.clone() for _, b in named))
    out, new = torch.cond(kept, run, skip, operands)
    write_back([(b, nb) for (_, b), nb in zip(named, new)])
    return out.reshape(shape)


def masked(branch: Callable, x: Tensor, kept: Tensor, args: Tuple[Any, ...], scale: Any,
           signature: Tuple[tuple, torch.dtype]) -> Tensor:
    """``scale * branch(x)`` when ``kept``, else zeros of ``signature`` (the timm patch's drop
    path without a residual; its branch changes no state)."""
    trailing, dtype = signature
    shape = x.shape

    def run(h: Tensor):
        y = branch(h.reshape(shape), *args)
        return _rows((y * scale if isinstance(scale, Tensor) or scale != 1.0 else y.clone()).to(dtype))

    def skip(h: Tensor):
        return torch.zeros((h.shape[0], math.prod(trailing)), dtype=dtype, device=h.device)

    return torch.cond(kept, run, skip, (_rows(x),)).reshape(shape[0], *trailing)


# ----------------------------------------------------------------------------------------------
# An int gate, as if/else compiles it.


def inline(owner: nn.Module, branches: Sequence[Any], x: Tensor, k: int, tying: Any) -> Optional[Tuple[Tensor, int]]:
    """Under torch.compile, a Python int gate ``k`` (checked) as if/else compiles ``branches[k](x)``:
    inlined, a graph per choice; -1 gives zeros of the branches' output signature (the caller ties
    ``x`` in where the tying says). Returns (output, the groups that ran as a bit mask), or None
    where the call ties its dead branches' parameters itself or the signature of -1 is unknown
    (:func:`stacked` / :func:`conds` then), under torch.export (an exported program keeps no
    record) and on torch 2.6, which cannot tell an export from a compile."""
    exporting = getattr(torch.compiler, "is_exporting", None)
    if tying.call_ties is not None or exporting is None or exporting():
        return None
    _count_int_graph(id(owner))
    if k >= 0:
        return branches[k](x), 1 << k
    sig = traced_signature(owner, x)
    if sig is None:
        return None
    return x.new_zeros((x.shape[0], *sig[0]), dtype=sig[1]), 0


@torch.compiler.assume_constant_result
def _count_int_graph(key: int) -> int:
    """Runs once per traced graph: warns once per module when its int gates have made one graph
    less than Dynamo's recompile limit (the next choice would send the frame to eager mode)."""
    owner = _unit.module_by_id(key)
    if owner is None:
        return 0
    unit = owner._unit
    unit.int_graphs += 1
    count, limit = unit.int_graphs, _compat.recompile_limit()
    if limit is not None and count == max(2, limit - 1):
        where = unit.where
        warnings.warn(
            f"{where}: torch.compile has traced {count} graphs for its int gate, one per choice as for "
            f"if/else; at {limit} (torch._dynamo.config.recompile_limit) Dynamo runs the model eagerly. "
            "A 0-d integer tensor gate (torch.tensor(k)) compiles every choice into one graph "
            "(docs/guides/compile.md).",
            stacklevel=2,
        )
    return count
