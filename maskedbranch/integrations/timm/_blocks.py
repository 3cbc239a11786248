"""What a converted block does when it is called.

A converted block keeps timm's class as a base and timm's ``forward``; only ``__call__`` is
overridden. When no drop path of the block is active (eval mode, ``drop_prob == 0``), under
symbolic tracing, TorchScript tracing or ``torch.export``, it calls ``nn.Module.__call__`` (so
timm's forward, hooks and all). Otherwise it swaps in, for this one call, the rewritten forward
of the plan that matches the call's arguments: traced (shaped mode) at the first such call,
then cached per block.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx, nn

from ... import _autograd, _dead_grads, _route, _structure
from ...drop_path import DropPath as _MaskedDropPath
from ..._draws import draw, keep_scale
from ...drop_path import drop_add_residual
from . import _graph, _trace

try:
    from timm.layers import DropPath as _TimmDropPath
except ImportError:  # pragma: no cover - the package imports timm first
    _TimmDropPath = ()

STATE = "_maskedbranch_timm"  # the converted block's BlockState, in its __dict__
_MAX_PLANS = 8  # per block; more input signatures than this evict the oldest
_PLAIN = (bool, int, float, str, type(None))
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def is_drop_path(m: nn.Module) -> bool:
    """timm's DropPath (or a subclass keeping its forward) or maskedbranch's."""
    if isinstance(m, _MaskedDropPath):
        return True
    return isinstance(m, _TimmDropPath) and type(m).forward is _TimmDropPath.forward


def drop_settings(dp: nn.Module) -> Optional[Tuple[Any, bool, str, bool, Optional[torch.Generator]]]:
    """(drop_prob, training, mode, scale_by_keep, generator) of a drop-path slot; None for a
    module that is not a drop path (the slot was replaced after patching)."""
    if isinstance(dp, nn.Identity):
        return 0.0, False, "row", True, None
    if isinstance(dp, _MaskedDropPath):
        return dp.drop_prob, dp.training, dp.mode, dp.scale_by_keep, dp.generator
    if is_drop_path(dp):
        return dp.drop_prob, dp.training, "row", bool(getattr(dp, "scale_by_keep", True)), None
    return None


def uses_batch_stats(m: nn.Module) -> bool:
    """A normalization whose output depends on the other samples of the batch right now."""
    if isinstance(m, _BATCH_NORMS):
        return m.training or m.running_mean is None
    return type(m).__name__.startswith("EvoNorm2dB") and m.training  # timm's batch-variance EvoNorms


class BlockState:
    """Per converted block: its name and drop-path slots, the options of ``patch``, and the
    plans (rebuilt after copying or unpickling)."""

    def __init__(self, name: str, slots: Sequence[str], materialize: bool, batch_norm: str):
        self.name = name
        self.slots = list(slots)
        self.materialize = materialize
        self.batch_norm = batch_norm
        self.plans: Dict[Any, Optional[Callable]] = {}
        self.warned: Set[str] = set()
        self._drop_paths: Tuple[int, List[nn.Module]] = (-1, [])

    def __getstate__(self) -> Dict[str, Any]:
        return {k: self.__dict__[k] for k in ("name", "slots", "materialize", "batch_norm")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)

    def drop_paths(self, block: nn.Module) -> List[nn.Module]:
        version, mods = self._drop_paths
        if version != _structure.version():
            mods = [block.get_submodule(s) for s in self.slots]
            self._drop_paths = (_structure.version(), mods)
        return mods

    def warn(self, block: nn.Module, why: str) -> None:
        if why not in self.warned:
            self.warned.add(why)
            warnings.warn(
                f"maskedbranch.integrations.timm: {self.name or '<root>'} ({type(block).__name__}) {why}; "
                "these residuals keep timm's dense computation (same results, no skipped compute)",
                stacklevel=4,
            )


def _active(block: nn.Module, state: BlockState) -> bool:
    for dp in state.drop_paths(block):
        s = drop_settings(dp)
        if s is not None and s[1] and s[0] > 0:
            return True
    return False


def _symbolic(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    return any(isinstance(a, fx.Proxy) for a in args) or any(isinstance(a, fx.Proxy) for a in kwargs.values())


def _exporting() -> bool:
    check = getattr(torch.compiler, "is_exporting", None)
    return bool(check is not None and check())


class PatchedBlock(_structure.InvalidatesOnApply):
    """Placed before timm's class in a converted block's bases."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get(STATE)
        if (
            state is None
            or _trace.is_suspended()
            or not _active(self, state)
            or _symbolic(args, kwargs)
            or torch.jit.is_tracing()
            or _exporting()
        ):
            return super().__call__(*args, **kwargs)
        # The rewritten forward, for this call only: nn.Module.__call__ still runs the hooks,
        # and everything else (TorchScript, fx, state_dict) keeps seeing timm's forward.
        d = self.__dict__
        d["forward"] = functools.partial(_routed_forward, self, state)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            d.pop("forward", None)

    def __reduce_ex__(self, protocol: int):
        return _restore, (original_class(type(self)),), self.__getstate__()


_CLASSES: Dict[type, type] = {}


def patched_class(original: type) -> type:
    cls = _CLASSES.get(original)
    if cls is None:
        cls = type(original.__name__, (PatchedBlock, original), {
            "__module__": original.__module__, "__qualname__": original.__qualname__,
            "_maskedbranch_original": original,
        })
        _CLASSES[original] = cls
    return cls


def original_class(cls: type) -> type:
    """timm's class of a converted block (whose class may since have been subclassed again,
    e.g. by FSDP2's ``fully_shard``)."""
    return cls._maskedbranch_original


def is_patched_class(cls: type) -> bool:
    return issubclass(cls, PatchedBlock)


def _restore(original: type) -> nn.Module:
    cls = patched_class(original)
    return cls.__new__(cls)


# ----------------------------------------------------------------------------------------------
# Arguments -> plan.


_SIGNATURES: Dict[type, Any] = {}


def signature(cls: type) -> Optional[Tuple[Tuple[str, ...], Tuple[Any, ...], int]]:
    """(names, defaults, number of positional) of ``cls.forward`` after ``self``; None when it
    takes ``*args`` / ``**kwargs``."""
    if cls not in _SIGNATURES:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            _SIGNATURES[cls] = None
        else:
            positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
            _SIGNATURES[cls] = tuple(p.name for p in params), tuple(p.default for p in params), positional
    return _SIGNATURES[cls]


def bind(block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[List[Any]]:
    """The call's argument values in signature order (defaults filled in)."""
    sig = signature(original_class(type(block)))
    if sig is None:
        return None
    names, defaults, positional = sig
    if not kwargs and len(args) <= positional:
        values = list(args) + list(defaults[len(args):])
    else:
        values = list(args) + [kwargs.pop(n) if n in kwargs else defaults[i] for i, n in enumerate(names) if i >= len(args)]
        if kwargs or len(args) > positional:
            return None
    if any(v is inspect.Parameter.empty for v in values):
        return None
    return values


def _hashable(v: Any) -> Any:
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_hashable(a) for a in v))
    if isinstance(v, (torch.dtype, torch.device)):
        return v
    raise TypeError(type(v).__name__)


def plan_key(block: nn.Module, values: Sequence[Any]) -> Any:
    """What a traced plan depends on: the tensor arguments' shapes past the batch, dtypes,
    devices and whether they are per sample; the other arguments' values; the block's plain
    attributes (read by its forward's Python control flow) and its children."""
    batch = next((v.shape[0] for v in values if isinstance(v, Tensor) and v.dim() > 0), None)
    parts = []
    for v in values:
        if isinstance(v, Tensor):
            rows = v.dim() > 0 and v.shape[0] == batch
            parts.append((rows, tuple(v.shape[1:] if rows else v.shape), v.dtype, v.device.type))
        else:
            parts.append(_hashable(v))
    attrs = tuple((k, v) for k, v in vars(block).items() if isinstance(v, _PLAIN))
    return tuple(parts), attrs, tuple(map(id, block.children()))


def _routed_forward(block: nn.Module, state: BlockState, *args: Any, **kwargs: Any) -> Any:
    values = bind(block, args, dict(kwargs))
    plan = None
    if values is not None:
        try:
            key = plan_key(block, values)
        except TypeError as e:
            state.warn(block, f"is called with an argument of type {e} that a plan cannot be keyed on")
            key = None
        if key is not None:
            plan = state.plans.get(key, _MISSING)
            if plan is _MISSING:
                if len(state.plans) >= _MAX_PLANS:
                    state.plans.pop(next(iter(state.plans)))
                plan = state.plans[key] = build_plan(block, state, values)
    else:
        state.warn(block, "is called with arguments its forward's signature does not bind")
    if plan is None:
        return original_class(type(block)).forward(block, *args, **kwargs)
    return plan(block, block, *values)


_MISSING = object()


def _trace_inputs(block: nn.Module, values: Sequence[Any]) -> Tuple[List[Tuple[str, Any]], Dict[str, Tensor], Set[str]]:
    names = signature(original_class(type(block)))[0]
    batch = next((v.shape[0] for v in values if isinstance(v, Tensor) and v.dim() > 0), None)
    inputs, metas, rows = [], {}, set()
    for name, v in zip(names, values):
        if isinstance(v, Tensor):
            inputs.append((name, _trace.TENSOR))
            if v.dim() > 0 and v.shape[0] == batch:
                rows.add(name)
                metas[name] = torch.empty((_trace.META_ROWS, *v.shape[1:]), dtype=v.dtype, device="meta")
            else:
                metas[name] = torch.empty(v.shape, dtype=v.dtype, device="meta")
        else:
            inputs.append((name, v))
    return inputs, metas, rows


def _tainted(graph: fx.Graph, rows: Set[str]) -> Set[fx.Node]:
    """Nodes whose value derives from a per-sample argument."""
    out: Set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.target in rows) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def build_plan(block: nn.Module, state: BlockState, values: Sequence[Any]) -> Optional[Callable]:
    """The rewritten forward for these arguments, or None (timm's forward is used)."""
    inputs, metas, rows = _trace_inputs(block, values)
    try:
        graph, meta = _trace.trace(block, inputs, metas)
    except Exception as e:  # noqa: BLE001 - untraceable for these inputs: timm's forward
        state.warn(block, f"cannot be traced for these inputs ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return None
    _graph.fold_sizes(graph, meta)
    slots, problems, _ = _graph.analyze(block, graph, is_drop_path)
    outputs: Dict[str, Any] = {}
    for s in list(slots):
        # timm drops the rows of the drop path's input: they must be the samples
        y = meta(s.drop.args[0])
        if not isinstance(y, Tensor):
            problems[s.dp] = "its branch does not run on meta tensors, so its rows cannot be checked"
        elif y.dim() == 0 or y.shape[0] != _trace.META_ROWS:
            problems[s.dp] = f"it drops rows of a tensor shaped {_shape(y)}, not the samples"
        else:
            outputs[s.dp] = (tuple(y.shape[1:]), y.dtype)
            continue
        slots.remove(s)
    for dp, why in problems.items():
        state.warn(block, f"uses {dp} in a way this patch does not convert ({why})")
    if not slots:
        return None
    tainted = _tainted(graph, rows)
    for s in slots:
        _structure.check_skippable([block.get_submodule(m) for m in s.modules], f"{state.name}: the branch of {s.dp}")
    return _graph.rewrite(
        graph, slots, lambda s, dense, routed: _slot_call(block, state, s, tainted, dense, routed, outputs.get(s.dp))
    )


def _shape(t: Tensor) -> str:
    dims = ["B" if d == _trace.META_ROWS else f"B*{d // _trace.META_ROWS}" if _trace.batch_dependent(d) else str(d) for d in t.shape]
    return "[" + ", ".join(dims) + "]"


# ----------------------------------------------------------------------------------------------
# One residual at run time.


def _slot_call(
    block: nn.Module, state: BlockState, slot: _graph.Slot, tainted: Set[fx.Node], dense: Callable, routed: Callable,
    output: Optional[Tuple[tuple, torch.dtype]],
) -> Callable:
    """The function that replaces one drop path: ``call(block, base, *inputs)`` for a residual,
    ``call(block, *inputs)`` for the masked form."""
    dp_path, residual = slot.dp, slot.add is not None
    x_index = slot.inputs.index(slot.base) if residual and slot.base in slot.inputs else None
    row_idx = tuple(i for i, n in enumerate(slot.inputs) if n in tainted and i != x_index)
    bn_paths = [
        f"{m}.{n}" if n else m
        for m in slot.modules for n, sub in block.get_submodule(m).named_modules() if batch_stats_type(sub)
    ]
    module_paths, param_paths = list(slot.modules), list(slot.params)
    cache: List[Any] = [-1, None]  # (structure version, (BatchNorms, parameters))

    def resolved(blk: nn.Module):
        if cache[0] != _structure.version():
            params = tuple(p for m in module_paths for p in blk.get_submodule(m).parameters())
            params += tuple(blk.get_parameter(p) for p in param_paths)
            cache[:] = [_structure.version(), ([blk.get_submodule(p) for p in bn_paths], params)]
        return cache[1]

    def call(blk: nn.Module, *args: Any) -> Tensor:
        base, inputs = (args[0], args[1:]) if residual else (None, args)
        settings = drop_settings(blk.get_submodule(dp_path))
        bns, params = resolved(blk)
        if (
            settings is None or not settings[1] or settings[0] == 0
            or (bns and state.batch_norm == "dense" and any(uses_batch_stats(m) for m in bns))
        ):  # timm's operations: its drop path is the identity, or BatchNorm needs every sample
            return dense(blk, *inputs) if base is None else base + dense(blk, *inputs)
        per_row = [inputs[i] for i in row_idx]
        lead = base if residual else (per_row[0] if per_row else None)
        batch = lead.shape[0] if isinstance(lead, Tensor) and lead.dim() > 0 else None
        if batch is None or any(not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != batch for t in per_row):
            state.warn(blk, f"feeds the branch of {dp_path} a value whose first dimension is not the batch")
            return dense(blk, *inputs) if base is None else base + dense(blk, *inputs)

        def branch(h: Tensor, *rows: Tensor) -> Tensor:
            full = list(inputs)
            idx = row_idx if residual else row_idx[1:]
            for i, r in zip(idx, rows):
                full[i] = r
            if residual and x_index is not None:
                full[x_index] = h
            elif not residual:
                full[row_idx[0]] = h
            return routed(blk, *full)

        p, _, mode, scale_by_keep, generator = settings
        if residual:
            return drop_add_residual(
                base, branch, p, True, mode, scale_by_keep, generator,
                args=per_row, params=params, materialize_grads=state.materialize,
            )
        return _masked(lead, branch, p, mode, scale_by_keep, generator, per_row[1:], params, state.materialize, output)

    call.__name__ = call.__qualname__ = "drop_path_" + dp_path.replace(".", "_")
    return call


def _masked(x, branch, p, mode, scale_by_keep, generator, rest, params, materialize, output) -> Tensor:
    """``drop_path(branch(x, *rest))`` without a residual: the branch runs on the kept rows,
    the dropped rows are zeros (timm's values, and zero gradients for the parameters)."""
    keep = 1.0 - float(p)
    scale = keep_scale(keep, scale_by_keep, output[1])
    if mode == "batch":
        gate: Any = 0 if bool(draw(1, keep, generator)[0]) else -1
    else:
        gate = draw(x.shape[0], keep, generator).to(torch.int64).sub_(1)
    zeros = _dead_grads.tie_policy(materialize, "maskedbranch.integrations.timm")
    if gate == -1 if isinstance(gate, int) else not bool((gate >= 0).any()):
        out = torch.zeros((x.shape[0], *output[0]), dtype=output[1], device=x.device)
        tied = tuple(t for t in (*params, x, *rest) if isinstance(t, Tensor) and t.requires_grad)
        return _autograd.tie(out, tied, bool(zeros)) if zeros is not None and tied and torch.is_grad_enabled() else out
    table = _structure.Branches([branch], params=[params])
    return _route.route(table, x, gate, tuple(rest), {}, zeros=zeros, scale=scale, where="branch")[0]


def batch_stats_type(m: nn.Module) -> bool:
    return isinstance(m, _BATCH_NORMS) or type(m).__name__.startswith("EvoNorm2dB")
