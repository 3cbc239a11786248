"""User-facing modules: :class:`MaskedBranch` and its functional form :func:`masked_branch`.

``MaskedBranch(branches)(x, gate)`` computes ``y[b] = sum_i g[b, i] * branch_i(x[b])`` while
feeding each branch only the rows it serves, and keeps every branch's parameters in the autograd
graph, so that DistributedDataParallel works with ``find_unused_parameters=False`` even when the
ranks route differently. See DESIGN.md for the semantics and the data flow.
"""
from __future__ import annotations

import contextlib
import operator
import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import _C, _ops, _structure
from ._args import check_per_row_devices, is_per_row, route_args

__all__ = ["MaskedBranch", "masked_branch"]

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------
# Modules that run collectives. A branch that is skipped on one rank but not on another would
# leave its collective unmatched and hang the job, so they are refused.


def _collective_types() -> Tuple[type, ...]:
    types: List[type] = [nn.SyncBatchNorm, nn.parallel.DistributedDataParallel]
    # Only look at modules the user has imported: an FSDP-wrapped branch implies its module is
    # loaded, and importing it here would cost a second at startup.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        for name in ("FullyShardedDataParallel", "FSDPModule"):
            t = getattr(fsdp, name, None)
            if isinstance(t, type):
                types.append(t)
    return tuple(types)


def _check_no_collectives(branches: Iterable[Any], check_params: bool) -> None:
    types = _collective_types()
    dtensor_mod = sys.modules.get("torch.distributed.tensor") if check_params else None
    dtensor = getattr(dtensor_mod, "DTensor", None)
    for i, branch in enumerate(branches):
        if not isinstance(branch, nn.Module):
            continue
        for name, m in branch.named_modules():
            if isinstance(m, types):
                where = f"branches[{i}]" + (f".{name}" if name else "")
                hint = (
                    " Use nn.BatchNorm* instead: inside a MaskedBranch each branch normalizes the "
                    "rows it serves, as the if/else model does."
                    if isinstance(m, nn.SyncBatchNorm)
                    else ""
                )
                raise ValueError(
                    f"branches: {where} is a {type(m).__name__}, which runs collectives across "
                    "ranks. A branch that receives no rows on one rank is skipped there, so its "
                    f"collective would never be matched and the job would hang.{hint}"
                )
        if isinstance(dtensor, type):
            for name, p in branch.named_parameters():
                if isinstance(p, dtensor):
                    raise ValueError(
                        f"branches: branches[{i}].{name} is a DTensor; sharded parameters "
                        "communicate in the forward, which a skipped branch would not match"
                    )


# ----------------------------------------------------------------------------------------------
# Argument checks. Every error names the argument and leaves the module untouched.


def _check_x(x: Any) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x: expected at least one dimension (rows first), got a 0-d tensor")


def _normalize_gate(gate: Any, x: Tensor, n: int):
    """Returns ("int", k) or ("tensor", gate) after checking type, rank, shape, dtype, device."""
    if isinstance(gate, bool):
        raise TypeError(
            "gate: got a bool; pass an int branch id, an integer tensor [B] of ids or a bool "
            f"tensor [B, {n}]"
        )
    if not isinstance(gate, Tensor):
        try:
            k = operator.index(gate)
        except TypeError:
            raise TypeError(
                f"gate: expected an int branch id, an integer tensor [B] of branch ids or a bool/"
                f"floating tensor [B, {n}], got {type(gate).__name__}"
            ) from None
        if not -1 <= k < n:
            raise IndexError(f"gate: branch id {k} is out of range; expected -1 (no branch) to {n - 1}")
        return "int", k
    batch = x.shape[0]
    if gate.is_complex():
        raise TypeError(f"gate: complex gates are not supported, got dtype {gate.dtype}")
    if gate.is_cuda and gate.device != x.device:
        raise ValueError(
            f"gate: a device gate must live on x's device ({x.device}), got one on {gate.device}; "
            "a CPU gate is fine with any x (its plan is built on the host and shipped asynchronously)"
        )
    if gate.device.type not in ("cpu", x.device.type):
        raise ValueError(f"gate: expected a CPU tensor or one on {x.device}, got one on {gate.device}")
    if gate.dim() == 0:
        if gate.dtype not in _INT_DTYPES:
            raise TypeError(f"gate: a 0-d gate must be an integer branch id, got dtype {gate.dtype}")
        if gate.device.type == "cpu":
            return _normalize_gate(int(gate), x, n)
        return "tensor", gate.expand(batch)  # a device scalar: read back once by the plan
    if gate.dim() == 1:
        if gate.dtype not in _INT_DTYPES:
            raise TypeError(
                "gate: a 1-D gate holds one integer branch id per row (-1 = no branch), got dtype "
                f"{gate.dtype}" + (f"; for a mask use shape [B, {n}]" if gate.dtype == torch.bool else "")
            )
        if gate.shape[0] != batch:
            raise ValueError(f"gate: expected {batch} branch ids (one per row of x), got shape {tuple(gate.shape)}")
        return "tensor", gate
    if gate.dim() == 2:
        if tuple(gate.shape) != (batch, n):
            raise ValueError(
                f"gate: expected shape [{batch}, {n}] (rows of x, branches), got {tuple(gate.shape)}"
            )
        if gate.dtype != torch.bool and not gate.is_floating_point():
            raise TypeError(
                f"gate: a 2-D gate must be bool (a mask) or floating (weights), got dtype {gate.dtype}"
            )
        return "tensor", gate
    raise ValueError(
        f"gate: expected an int, branch ids [B] or a mask/weights [B, {n}], got shape {tuple(gate.shape)}"
    )


def _check_output(y: Any, i: int, rows: int) -> Tensor:
    if not isinstance(y, Tensor):
        raise TypeError(f"branches[{i}]: expected the branch to return a tensor, got {type(y).__name__}")
    if y.dim() < 1 or y.shape[0] != rows:
        raise ValueError(
            f"branches[{i}]: the branch was given {rows} rows and returned shape {tuple(y.shape)}; "
            "a branch must return one row per input row"
        )
    return y


def _mismatch(i: int, sig, j: Any, ref) -> ValueError:
    other = f"branches[{j}]" if isinstance(j, int) else j
    return ValueError(
        f"branches: the outputs disagree: branches[{i}] returns rows of shape {list(sig[0])} and "
        f"dtype {sig[1]}, {other} rows of shape {list(ref[0])} and dtype {ref[1]}; every branch "
        "must return the same trailing shape and dtype"
    )


# ----------------------------------------------------------------------------------------------
# Output signatures (trailing shape, dtype): how the output of a call where no row reaches any
# branch is shaped, and how disagreeing branches are caught.


def _arg_sig(a: Any, batch: int):
    if isinstance(a, Tensor):
        shape = tuple(a.shape[1:]) if is_per_row(a, batch) else tuple(a.shape)
        return ("T", shape, a.dtype)
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    return type(a)


# One cheap call answers "is autocast on anywhere" (private API, hence the fallback).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_dtype(x: Tensor, device: Optional[torch.device] = None) -> Optional[torch.dtype]:
    """The dtype autocast casts to on x's device type, or None when autocast is off there."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return None
    device_type = (x.device if device is None else device).type
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except (RuntimeError, TypeError, ValueError):  # a device type without autocast
        return None


def _input_key(x: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    device = x.device
    # autocast changes the dtype the branches return, so it is part of the input signature
    key = (x.shape[1:], x.dtype, device, _autocast_dtype(x, device))
    if args:
        batch = x.shape[0]
        key += tuple(_arg_sig(a, batch) for a in args)
    if kwargs:
        batch = x.shape[0]
        key += tuple((k, _arg_sig(v, batch)) for k, v in kwargs.items())
    return key


def _probe(branch: Callable, x: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
    """(trailing shape, dtype) of ``branch``'s output for inputs like these, found on meta tensors:
    no compute, no effect on parameters, buffers or random state. None when the branch cannot run
    on meta tensors (data-dependent code, ops without meta kernels, tensors that are not
    parameters or buffers). Under autocast the probe runs on fake tensors instead: meta tensors
    bypass autocast (its kernels dispatch on the tensor's device) and would report the wrong
    dtype, fake tensors keep x's device."""
    mode: Any = contextlib.nullcontext()
    to_probe: Callable[[Tensor], Tensor] = lambda t: t.to("meta")  # noqa: E731
    if _autocast_dtype(x) is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        to_probe = mode.from_tensor

    def meta(a):
        return to_probe(a) if isinstance(a, Tensor) else a

    try:
        margs = tuple(meta(a) for a in args)
        mkwargs = {k: meta(v) for k, v in kwargs.items()}
        with mode, torch.no_grad():
            if isinstance(branch, nn.Module):
                state = {k: meta(v) for k, v in branch.named_parameters(remove_duplicate=False)}
                state.update({k: meta(v) for k, v in branch.named_buffers(remove_duplicate=False)})
                y = torch.func.functional_call(branch, state, (meta(x), *margs), mkwargs, strict=False)
            else:
                y = branch(meta(x), *margs, **mkwargs)
    except Exception:  # noqa: BLE001 - any failure means "unknown"; the real call will tell
        return None
    if not isinstance(y, Tensor) or y.dim() < 1:
        return None
    return tuple(y.shape[1:]), y.dtype


class _Signatures:
    """Output signature per input signature, learned from calls and probes. Bounded (inputs with
    varying shapes would otherwise grow it without limit)."""

    def __init__(self, size: int = 32):
        self.size = size
        self.table: "OrderedDict[Any, Tuple[Tuple[int, ...], torch.dtype, int]]" = OrderedDict()
        self.first_call = True
        self.last_rows = None  # the last (x, output) signature a one-branch call confirmed, in C++

    def __getstate__(self):
        # copy.deepcopy / pickle: the C++ signature is a cache, learned again on the next call
        return {**self.__dict__, "last_rows": None}

    def get(self, key):
        return self.table.get(key)

    def put(self, key, sig, branch: int) -> None:
        self.table[key] = (sig[0], sig[1], branch)
        if len(self.table) > self.size:
            self.table.popitem(last=False)


def _learn(
    spec: Optional[_Signatures],
    key,
    live: Dict[int, Tensor],
    branches: Sequence[Callable],
    x: Tensor,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
):
    """Check that the live outputs agree with each other and with what was seen before; return
    the output signature (trailing shape, dtype), or None when no branch ran and it is unknown."""
    if spec is not None and live and not spec.first_call:
        # The common case (inputs seen before): one comparison per live output.
        known = spec.table.get(key)
        if known is not None and all(y.dtype == known[1] and y.shape[1:] == known[0] for y in live.values()):
            return known[0], known[1]
    sig = None
    first = None
    for i, y in live.items():
        s = (tuple(y.shape[1:]), y.dtype)
        if sig is None:
            sig, first = s, i
        elif s != sig:
            raise _mismatch(i, s, first, sig)
    known = spec.get(key) if spec is not None else None
    if known is not None and sig is not None and (known[0], known[1]) != sig:
        raise _mismatch(first, sig, f"branches[{known[2]}] (in an earlier call with inputs like these)", known)
    if spec is not None and spec.first_call:
        # First call: also check the branches that received no rows, on meta tensors. The check
        # counts as done only once it passed, so that a retry after a mismatch fails again.
        if not torch.compiler.is_compiling():
            for i, branch in enumerate(branches):
                if i in live:
                    continue
                s = _probe(branch, x, args, kwargs)
                if s is None:
                    continue
                if sig is None:
                    sig, first = s, i
                elif s != sig:
                    raise _mismatch(i, s, first, sig)
        spec.first_call = False
    if sig is None and known is not None:
        return known[0], known[1]
    if sig is None:  # no row reached any branch and the signature is unknown: infer it
        for i, branch in enumerate(branches):
            sig = _probe(branch, x, args, kwargs)
            if sig is not None:
                first = i
                break
        else:
            raise RuntimeError(
                "MaskedBranch: no row reached any branch, and the output's trailing shape and dtype "
                "could not be inferred (no earlier call with inputs like these, and no branch runs "
                "on meta tensors). Make one call with at least one live row first."
            )
    if spec is not None and known is None:
        spec.put(key, sig, first)
    return sig


# ----------------------------------------------------------------------------------------------
# The forward.


# Live-branch masks whose dead parameters a _BranchTable keeps: the masks of a many-branch
# layer could vary without bound.
_MAX_CACHED_MASKS = 1024


def _params_of(branch: Callable) -> Tuple[Tensor, ...]:
    return tuple(branch.parameters()) if isinstance(branch, nn.Module) else ()


class _BranchTable:
    """The branches, each branch's parameters, and per set of live branches (a bit mask) the
    parameters to anchor: those of the branches that did not run, less any shared with a live
    branch (it already gives them their gradient). Built once per module structure, so a call
    does not walk ``parameters()`` or rebuild these lists."""

    __slots__ = ("container", "branches", "params", "kept", "_dead", "_sets")

    def __init__(self, branches: Sequence[Callable], kept: bool = True):
        self.container = branches  # MaskedBranch's ModuleList: its length is checked per call
        self.kept = kept  # reused by later calls (MaskedBranch's), not built for one (masked_branch's)
        self.branches = list(branches)
        self.params = [_params_of(b) for b in self.branches]
        self._dead: Dict[int, Tuple[Tensor, ...]] = {}
        self._sets: Dict[int, Any] = {}

    def dead_params(self, live_mask: int) -> Tuple[Tensor, ...]:
        dead = self._dead.get(live_mask)
        if dead is None:
            live_ids = {id(p) for i, ps in enumerate(self.params) if live_mask >> i & 1 for p in ps}
            seen: set = set()
            out = []
            for i, ps in enumerate(self.params):
                if live_mask >> i & 1:
                    continue
                for p in ps:
                    if id(p) not in live_ids and id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
            dead = tuple(out)
            if len(self._dead) < _MAX_CACHED_MASKS:
                self._dead[live_mask] = dead
        return dead

    def dead_set(self, live_mask: int) -> Any:
        """``dead_params(live_mask)`` as a ``_C.dead_set``, whose node (undefined gradients) is
        built once and linked by every call; None when there is nothing to anchor."""
        found = self._sets.get(live_mask, self)
        if found is self:
            dead = self.dead_params(live_mask)
            found = _C.dead_set(dead) if dead else None
            if len(self._sets) < _MAX_CACHED_MASKS:
                self._sets[live_mask] = found
        return found


def _anchor_dead(
    out: Tensor, table: _BranchTable, live_mask: int, materialize: bool, extra: Tuple[Tensor, ...] = ()
) -> Tensor:
    """Anchor the parameters of the branches that did not run (and ``extra``) to ``out``."""
    if not torch.is_grad_enabled():
        return out  # no graph: nothing to anchor
    # The C++ paths read requires_grad themselves (freezing a branch changes no structure): a
    # parameter that does not require grad gets no gradient.
    eager = type(out) is Tensor and not torch.compiler.is_compiling()
    if eager and not extra and not materialize and table.kept:
        dead_set = table.dead_set(live_mask)
        if dead_set is None or _C.anchor_dead_set(out, dead_set):
            return out  # a node linking the set's shared one went into out's own history
    dead = table.dead_params(live_mask)
    if extra:
        dead = extra + dead
    if not dead:
        return out
    if eager and _C.anchor_into_history(out, dead, materialize):
        return out  # the anchor went into out's own history: no view, no op dispatch
    params = [t for t in dead if t.requires_grad]
    return _ops.ops.anchor(out, params, materialize) if params else out


def _known_output(spec: _Signatures, x: Tensor, y: Any) -> bool:
    """The common case of a one-branch call without extra arguments: ``y`` is a tensor with x's
    rows and x and y have the signature of the last such call, compared in C++. Otherwise the
    caller takes the full check (``_learn``, whose own fast path covers inputs seen before)."""
    return spec.last_rows is not None and not torch.compiler.is_compiling() and _C.row_signature_matches(spec.last_rows, x, y)


def _one_branch(
    table: _BranchTable,
    spec: Optional[_Signatures],
    x: Tensor,
    k: int,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    materialize: bool,
) -> Tensor:
    """The whole batch through branch k, on x itself (no gather, no copy), and the anchor."""
    out = table.branches[k](x, *args, **kwargs)
    if spec is None or args or kwargs or not _known_output(spec, x, out):
        _check_output(out, k, x.shape[0])
        key = _input_key(x, args, kwargs) if spec is not None else None
        _learn(spec, key, {k: out}, table.branches, x, args, kwargs)
        if key is not None and not args and not kwargs and key[3] is None and not torch.compiler.is_compiling():
            spec.last_rows = _C.row_signature(x, out)  # confirmed: later calls like this one compare in C++
    return _anchor_dead(out, table, 1 << k, materialize)


class _Split:
    """A per-row argument packed like x, one slice per branch."""

    __slots__ = ("parts",)

    def __init__(self, parts: List[Tensor]):
        self.parts = parts


def _pack(t: Tensor, plan: _ops.Plan) -> Tensor:
    if t.is_floating_point():
        return _ops.gather(t, plan)  # differentiable, deterministic backward
    return t.index_select(0, plan.rows)  # ids, masks: no gradient


def _route_rows(t: Tensor, plan: _ops.Plan, name: str = "x") -> List[Tensor]:
    """Each branch's rows of ``t`` (x or a per-row argument), in the plan's order."""
    if t.is_floating_point() and not torch.compiler.is_compiling():
        _ops.check_device_supported(t, name)  # names x or the argument
        # gather + split in one C++ op: each branch's rows as a tensor of its own (not a view, so
        # in-place branches work); backward: one combine of the slices' gradients. The op itself:
        # _ops.gather_split would check the device again, naming "x".
        return _ops.ops.gather_split(t, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos, plan.counts)
    return _ops.split_packed(_pack(t, plan), plan)  # (traced: views of one packed buffer)


def _host_to(t: Tensor, device: torch.device) -> Tensor:
    """Ship a host tensor to ``device`` without blocking the host (differentiable)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        if not t.requires_grad:
            t = t.pin_memory()  # a truly asynchronous copy
        return t.to(device, non_blocking=True)
    return t.to(device)


def _forward(
    table: _BranchTable,
    x: Tensor,
    gate: Any,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    materialize: bool,
    spec: Optional[_Signatures],
) -> Tuple[Tensor, int]:
    """The output, and the bit mask of the branches that ran."""
    branches = table.branches
    n = len(branches)
    _check_x(x)
    if type(gate) is int and -1 <= gate < n:
        kind = "int"  # the common per-batch case, checked without a call
    else:
        kind, gate = _normalize_gate(gate, x, n)
    if args or kwargs:
        check_per_row_devices(args, kwargs, x)
    if kind == "int" and gate >= 0:
        # The whole batch goes to one branch: nothing but the branch (and the anchor).
        return _one_branch(table, spec, x, gate, args, kwargs, materialize), 1 << gate
    key = _input_key(x, args, kwargs) if spec is not None else None
    if kind == "int":
        # -1: no row reaches any branch. Zeros shaped like the branches' output, no plan; x is
        # anchored like the parameters, so whatever produced it still gets its hooks called.
        trailing, dtype = _learn(spec, key, {}, branches, x, args, kwargs)
        out = torch.zeros((x.shape[0], *trailing), dtype=dtype, device=x.device)
        return _anchor_dead(out, table, 0, materialize, extra=(x,)), 0

    plan = _ops.make_plan(gate, n, device=x.device)  # host counts; a device gate reads back once
    counts = plan.counts
    batch = x.shape[0]
    weights = gate if gate.dim() == 2 and gate.is_floating_point() else None

    if weights is None and batch > 0 and plan.num_entries == batch:
        for i, c in enumerate(counts):
            if c == batch:
                # Every row goes to branch i alone, in order: run it on x itself.
                return _one_branch(table, spec, x, i, args, kwargs, materialize), 1 << i

    xs = _route_rows(x, plan)
    routed_args, routed_kwargs = route_args(args, kwargs, batch, lambda t: _Split(_route_rows(t, plan, "a per-row argument")))

    live: Dict[int, Tensor] = {}
    live_mask = 0
    for i, c in enumerate(counts):
        if c == 0:
            continue  # the branch never sees a row
        if routed_args or routed_kwargs:
            a = tuple(v.parts[i] if isinstance(v, _Split) else v for v in routed_args)
            kw = {k: v.parts[i] if isinstance(v, _Split) else v for k, v in routed_kwargs.items()}
            y = branches[i](xs[i], *a, **kw)
        else:
            y = branches[i](xs[i])
        live[i] = _check_output(y, i, c)
        live_mask |= 1 << i

    trailing, dtype = _learn(spec, key, live, branches, x, args, kwargs)
    ys: List[Tensor] = []
    for i in range(n):
        if i in live:
            ys.append(live[i])
        elif not live and i == 0 and xs[0].requires_grad:
            # No row reaches any branch: keep x in the graph (its gradient is zero) so that
            # whatever produced x still gets gradients on this rank.
            ys.append(xs[0].reshape((0, *trailing)).to(dtype))
        else:
            ys.append(torch.empty((0, *trailing), dtype=dtype, device=x.device))
    if weights is not None:
        weights = _host_to(weights, ys[0].device)
    # the op itself: every ys[i] was checked against the plan's counts above
    out = _ops.ops.combine(None, ys, weights, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos)
    return _anchor_dead(out, table, live_mask, materialize), live_mask


# ----------------------------------------------------------------------------------------------
# Public API.


def _as_branch_list(branches: Any, callables: bool) -> List[Any]:
    if isinstance(branches, nn.Module) and not isinstance(branches, nn.ModuleList):
        raise TypeError(
            f"branches: expected an iterable of nn.Module (a list or an nn.ModuleList), got a single "
            f"{type(branches).__name__}; wrap it in a list"
        )
    if isinstance(branches, (str, bytes)) or not isinstance(branches, Iterable):
        raise TypeError(f"branches: expected an iterable of nn.Module, got {type(branches).__name__}")
    out = list(branches)
    if not out:
        raise ValueError("branches: expected at least one branch, got none")
    for i, b in enumerate(out):
        ok = callable(b) if callables else isinstance(b, nn.Module)
        if not ok:
            want = "a callable" if callables else "an nn.Module"
            raise TypeError(f"branches[{i}]: expected {want}, got {type(b).__name__}")
    return out


class MaskedBranch(_structure.InvalidatesOnApply, nn.Module):
    r"""Run each row through the branches its gate selects, and only those:
    ``y[b] = sum_i g[b, i] * branch_i(x[b], ...)``.

    Args:
        branches: an iterable of ``nn.Module``, stored as an ``nn.ModuleList`` named ``branches``
            (state_dict keys read ``branches.0.weight``, ...). Every branch must map ``r`` rows to
            ``r`` rows of the same trailing shape and dtype for all branches. Branches that run
            collectives (``nn.SyncBatchNorm``, DDP/FSDP-wrapped modules, DTensor parameters) are
            refused: skipped on one rank, their collective would hang the others.
        materialize_grads: the gradient handed to the parameters of branches that did not run.
            ``False`` (default): undefined. The parameters stay in the graph, so their autograd
            hooks fire and DDP zero-fills their bucket slots before the all-reduce (no kernel per
            parameter); after DDP's backward their ``.grad`` holds the average over ranks (zero
            where no rank used them). Without DDP their ``.grad`` is left as is, as with if/else.
            ``True``: zero tensors (one batched fill), for FSDP2 (``fully_shard`` reduces only
            defined gradients) or for code that expects every ``.grad`` to be defined.
            :func:`maskedbranch.unused_grads_to_none` makes the optimizer skip branches that no
            rank ran (``None`` gradients), as with if/else and ``find_unused_parameters=True``.

    ``forward(x, gate, *args, **kwargs)``, where ``x`` is ``[B, ...]`` and ``gate`` is:

    * an ``int`` k: the whole batch runs branch k (no gather, no copy; -1: no branch);
    * an integer tensor ``[B]``: one branch id per row, -1 = no branch for that row;
    * a bool or floating tensor ``[B, N]``: any subset of branches per row, the value being the
      weight. Floating weights that require grad get gradients at their nonzero entries and zero
      at zero entries (the branch never ran there; the dense 0/1 formula would give
      ``<grad_out[b], branch_i(x[b])>``).

    The gate may live on the CPU with ``x`` on a GPU (preferred: the routing plan is built on the
    host and shipped asynchronously, no synchronization); a gate on the GPU costs one readback.
    Extra tensor arguments whose first dimension is ``B`` are routed with ``x`` (each branch
    gets its rows of them); anything else is passed through unchanged.

    Rows with a zero gate never reach a branch; a branch with no rows does not run. Every
    parameter of every branch gets a gradient on every call that builds a graph (see
    ``materialize_grads``), so DDP runs with ``find_unused_parameters=False`` (and
    ``static_graph=True``); under ``torch.no_grad()`` nothing is anchored.

    When no row reaches any branch the output is zeros ``[B, *trailing]``; the trailing shape and
    dtype are those the branches returned in an earlier call with inputs of the same trailing
    shapes and dtypes, or, if there was none, are inferred by running a branch on meta tensors
    (no compute, no effect on parameters, buffers or random state). ``x`` stays in the graph, so
    whatever produced it still gets gradients: a zero gradient through the routing for tensor
    gates; for an int gate of -1 (no plan at all) it is anchored like the parameters (undefined
    gradient, or zeros with ``materialize_grads``). On the first call the branches that got no rows are also run on meta
    tensors to check that all branches agree in trailing shape and dtype.
    """

    def __init__(self, branches: Iterable[nn.Module], *, materialize_grads: bool = False):
        super().__init__()
        mods = _as_branch_list(branches, callables=False)
        _check_no_collectives(mods, check_params=True)
        self.branches = branches if isinstance(branches, nn.ModuleList) else nn.ModuleList(mods)
        self.materialize_grads = bool(materialize_grads)
        self._signatures = _Signatures()
        self._tables: _structure.StructureCache[_BranchTable] = _structure.StructureCache()
        self._usage = _structure.Usage()

    @property
    def num_branches(self) -> int:
        return len(self.branches)

    def _table(self) -> _BranchTable:
        """The branches and their parameters, after checking (again, whenever the module
        structure may have changed, e.g. by convert_sync_batchnorm) that no branch runs
        collectives. ``del`` / ``insert`` on the ModuleList register nothing, hence the length
        check (on its ``_modules``: ``len(self.branches)`` costs two Python calls)."""
        table = self._tables.peek()
        if table is not None and len(table.branches) == len(table.container._modules):
            return table

        def compute():
            _check_no_collectives(self.branches, check_params=True)
            return _BranchTable(self.branches)

        self._tables.clear()
        return self._tables.get(compute)

    def _units(self) -> List[Tuple[nn.Module, Tuple[Tensor, ...]]]:
        """Each branch and its parameters: the units whose use ``_usage`` records (bit i: branch
        i ran in a call that built a graph), for :func:`maskedbranch.unused_grads_to_none`."""
        table = self._table()
        return list(zip(table.branches, table.params))

    def forward(self, x: Tensor, gate: Any, *args: Any, **kwargs: Any) -> Tensor:
        table = self._table()
        if type(gate) is int and 0 <= gate < len(table.branches) and not args and not kwargs and type(x) is Tensor and x.dim():
            # The per-batch int gate, the routed layer's common case: straight to the branch.
            # _forward takes this path too, after its argument handling (about 2 us per call).
            out, live_mask = _one_branch(table, self._signatures, x, gate, (), {}, self.materialize_grads), 1 << gate
        else:
            out, live_mask = _forward(table, x, gate, args, kwargs, self.materialize_grads, self._signatures)
        if torch.is_grad_enabled():
            self._usage.bits |= live_mask
        return out

    def extra_repr(self) -> str:
        return f"num_branches={len(self.branches)}" + (", materialize_grads=True" if self.materialize_grads else "")


def masked_branch(branches: Sequence[Callable], x: Tensor, gate: Any, *args: Any, **kwargs: Any) -> Tensor:
    """Functional form of :class:`MaskedBranch`: ``branches`` is a sequence of callables
    (modules or functions; the parameters of ``nn.Module`` branches are anchored, with undefined
    gradients). Without a module to remember them, output signatures are not cached: a call where
    no row reaches any branch infers the output shape on meta tensors every time, and branches
    that get no rows are not checked."""
    branch_list = _as_branch_list(branches, callables=True)
    _check_no_collectives(branch_list, check_params=False)
    return _forward(_BranchTable(branch_list, kept=False), x, gate, args, kwargs, False, None)[0]
