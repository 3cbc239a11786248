"""What a converted block does when it is called.

A converted block keeps timm's class as a base and timm's ``forward``; only ``__call__`` is
overridden. When no drop path of the block is active (eval mode, ``drop_prob == 0``), under
symbolic tracing, TorchScript tracing or ``torch.export``, it calls ``nn.Module.__call__`` (so
timm's forward, hooks and all). Otherwise it runs its rewrite (the rewritten forward) that
matches the call's arguments, traced at the first such call.

Rewrites are shared: blocks of one structure (timm class, plain attributes of the block and of its
children, children's names and types, the arguments' shapes past the batch, dtypes and values)
run one generated forward, which reads everything block-specific from the block it is given.
Under torch.compile a missing rewrite is built while the graph is traced, for real
(``torch.compiler.assume_constant_result``), and the graph inlines the rewrite's code: nothing
about rewrites is read from Python state that changes between calls, and a model whose blocks share a
structure compiles their calls from the same code.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx, nn

from ... import _structure, _unit
from . import _graph, _slots, _trace
from ._slots import batch_stats_type, drop_settings, is_drop_path, uses_batch_stats  # noqa: F401 - the package's API

STATE = "_maskedbranch_timm"  # the converted block's BlockState, in its __dict__
_MAX_REWRITES = 256  # shared by every block; more input signatures than this evict the oldest
_PLAIN = (bool, int, float, str, type(None))


class BlockState:
    """Per converted block: its name and drop-path slots, the options of ``patch``, and the
    structural part of its rewrite key (rebuilt after copying or unpickling)."""

    def __init__(self, name: str, slots: Sequence[str], materialize: bool, batch_norm: str):
        self.name = name
        self.slots = list(slots)
        self.materialize = materialize
        self.batch_norm = batch_norm
        self.warned: Set[str] = set()
        self._structure: Optional[Tuple[tuple, Any]] = None  # (children, key)
        self.checked = 0  # the rewrite whose branches this block last checked for collectives
        self.traced_rewrite: Optional[Callable] = None  # set while torch.compile traces a call
        self.unit: Optional[_unit.RoutingUnit] = None  # made at the first call (copies make their own)

    def __getstate__(self) -> Dict[str, Any]:
        return {k: self.__dict__[k] for k in ("name", "slots", "materialize", "batch_norm")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)

    def drop_paths(self, block: nn.Module) -> List[nn.Module]:
        return [block.get_submodule(s) for s in self.slots]

    def structure(self, block: nn.Module) -> Any:
        """What the rewrite depends on besides the arguments: the block's plain attributes (read by
        its forward's Python control flow), its children's names, types and plain attributes."""
        children = tuple(block._modules.values())
        found = self._structure
        if found is None or len(found[0]) != len(children) or any(a is not b for a, b in zip(found[0], children)):
            key = (
                original_class(type(block)),
                tuple((k, v) for k, v in vars(block).items() if isinstance(v, _PLAIN) and not k.startswith("_maskedbranch")),
                tuple((n, type(c), tuple((k, v) for k, v in vars(c).items() if isinstance(v, _PLAIN)))
                      for n, c in block._modules.items()),
            )
            found = self._structure = (children, key)
        return found[1]

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


class PatchedBlock(_structure.CacheOwner):
    """Placed before timm's class in a converted block's bases."""

    __jit_unused_properties__ = ["_unit"]  # TorchScript compiles timm's forward only

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get(STATE)
        compiling = torch.compiler.is_compiling()
        if (
            state is None
            or (not compiling and _trace.is_suspended())
            or not _active(self, state)
            or _symbolic(args, kwargs)
            or torch.jit.is_tracing()
            or _exporting()
        ):
            return super().__call__(*args, **kwargs)
        if compiling and not _has_hooks(self):
            # What nn.Module.__call__ does for a module without hooks, with the rewritten
            # forward; no per-call attribute of the block is written (the graph would guard on it).
            return _routed_forward(self, state, *args, **kwargs)
        # The rewritten forward, for this call only: nn.Module.__call__ still runs the hooks,
        # and everything else (TorchScript, fx, state_dict) keeps seeing timm's forward.
        d = self.__dict__
        d["forward"] = functools.partial(_routed_forward, self, state)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            d.pop("forward", None)

    @property
    def _unit(self) -> _unit.RoutingUnit:
        """The block's routing unit (maskedbranch/_unit.py): it decides what its drop paths' ties
        give (its ``materialize_grads``, zeros or none, under the wrapper running it)."""
        state = self.__dict__[STATE]
        unit = state.unit
        if unit is None or unit.owner() is not self:
            unit = state.unit = _unit.RoutingUnit(self, state.name or type(self).__name__, state.materialize)
        return unit

    # The unit's owner: the drop paths' branches are checked per rewrite (_rewrite), and no group is
    # reduced (zeros or none: nothing is reset).
    def _unit_groups(self) -> List[Sequence[Tensor]]:
        return []

    def _unit_modules(self) -> List[nn.Module]:
        return []

    def _check_skippable(self) -> None:
        pass

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        _unit.note_module(self)  # found by id while a graph is traced (see _rewrite_while_tracing)

    def __reduce_ex__(self, protocol: int):
        return _restore, (original_class(type(self)),), self.__getstate__()


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


_CLASSES: Dict[type, type] = {}


def patched_class(original: type) -> type:
    cls = _CLASSES.get(original)
    if cls is None:
        # Its own module, so that type(block) says it is converted; timm's name (reprs, TorchScript).
        cls = type(original.__name__, (PatchedBlock, original), {
            "__module__": "maskedbranch.integrations.timm", "__qualname__": original.__qualname__,
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
# Arguments -> rewrite.


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


def batch_size(values: Sequence[Any]):
    """The first dimension of the first tensor argument that has one (a plain loop: Dynamo
    before 2.7 cannot trace next() with a default)."""
    for v in values:
        if isinstance(v, Tensor) and v.dim() > 0:
            return v.shape[0]
    return None


def argument_spec(values: Sequence[Any]) -> tuple:
    """The arguments as a rewrite sees them: for tensors, whether per sample, shape past the
    batch, dtype and device type; other values as they are (hashable)."""
    batch = batch_size(values)
    parts = []
    for v in values:
        if isinstance(v, Tensor):
            rows = v.dim() > 0 and v.shape[0] == batch
            parts.append((rows, tuple(v.shape[1:] if rows else v.shape), v.dtype, v.device.type))
        else:
            parts.append(_hashable(v))
    return tuple(parts)


_REWRITES: Dict[Any, int] = {}  # rewrite key -> rewrite number
_BY_NUMBER: Dict[int, Optional[Callable]] = {}  # rewrite number -> the rewritten forward (None: timm's)


def _rewrite(block: nn.Module, state: BlockState, spec: tuple, values: Sequence[Any]) -> int:
    """The number of the rewrite for this block's structure and these arguments (made if missing)."""
    key = (state.structure(block), spec)
    number = _REWRITES.get(key)
    if number is None:
        if len(_REWRITES) >= _MAX_REWRITES:
            _BY_NUMBER.pop(_REWRITES.pop(next(iter(_REWRITES))), None)
        number = _REWRITES[key] = len(_BY_NUMBER) + 1 + max(_BY_NUMBER, default=0)
        _BY_NUMBER[number] = build_rewrite(block, state, values)
    rewrite = _BY_NUMBER[number]
    if rewrite is not None and state.checked != number:
        _slots.check_branches(block, rewrite.slots, state.name)  # once per block and rewrite
        state.checked = number
    return number


@torch.compiler.assume_constant_result
def _rewrite_while_tracing(block_id: int, spec: tuple) -> int:
    """Run for real while torch.compile traces: make the rewrite of this block and these arguments
    if it is missing and leave it in the block's state (``traced_rewrite``), which the traced code
    reads next (an attribute read sees this call's effect; a dict the trace read before would
    not). Returns the rewrite's number."""
    block = _unit.module_by_id(block_id)
    state = block.__dict__[STATE]
    number = _rewrite(block, state, spec, [_meta_value(s) for s in spec])
    state.traced_rewrite = _BY_NUMBER[number]
    return number


def _meta_value(part: Any) -> Any:
    """A meta tensor standing for an argument (the trace only reads shapes, dtypes, devices)."""
    if isinstance(part, tuple) and len(part) == 4 and isinstance(part[2], torch.dtype):
        rows, shape, dtype, _device = part
        return torch.empty(((_trace.META_ROWS,) if rows else ()) + tuple(shape), dtype=dtype, device="meta")
    return part


def _routed_forward(block: nn.Module, state: BlockState, *args: Any, **kwargs: Any) -> Any:
    values = bind(block, args, dict(kwargs))
    rewrite = None
    if values is not None:
        try:
            spec = argument_spec(values)
        except TypeError as e:
            state.warn(block, f"is called with an argument of type {e} that a rewrite cannot be keyed on")
            spec = None
        if spec is not None:
            if torch.compiler.is_compiling():
                _rewrite_while_tracing(id(block), spec)
                rewrite = state.traced_rewrite
            else:
                rewrite = _BY_NUMBER[_rewrite(block, state, spec, values)]
    else:
        state.warn(block, "is called with arguments its forward's signature does not bind")
    if rewrite is None:
        return original_class(type(block)).forward(block, *args, **kwargs)
    return rewrite(block, block, *values)


_MISSING = object()


def _trace_inputs(block: nn.Module, values: Sequence[Any]) -> Tuple[List[Tuple[str, Any]], Dict[str, Tensor], Set[str]]:
    names = signature(original_class(type(block)))[0]
    batch = batch_size(values)
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


def build_rewrite(block: nn.Module, state: BlockState, values: Sequence[Any]) -> Optional[Callable]:
    """The rewritten forward for these arguments (with ``.slots``), or None (timm's forward is
    used)."""
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
    kept = list(slots)
    forward = _graph.rewrite(
        graph, slots, lambda s, dense, routed: _slots.slot_call(block, state, s, tainted, dense, routed, outputs.get(s.dp))
    )
    forward.slots = kept
    return forward


def _shape(t: Tensor) -> str:
    dims = ["B" if d == _trace.META_ROWS else f"B*{d // _trace.META_ROWS}" if _trace.batch_dependent(d) else str(d) for d in t.shape]
    return "[" + ", ".join(dims) + "]"
