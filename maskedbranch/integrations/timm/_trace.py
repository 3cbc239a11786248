"""Tracing one block's own ``forward`` into a torch.fx graph, with every submodule a leaf.

Two modes, one tracer:

* **structural** (no input shapes, at ``patch`` time without an example input): plain symbolic
  tracing. Enough to find the drop-path residuals of most blocks; a forward whose Python
  control flow reads input shapes raises ``fx.proxy.TraceError`` here.
* **shaped** (at the first training call for each input signature): every value carries a
  meta-device twin, computed node by node, whose batch dimension is :data:`META_ROWS`. Sizes
  that scale with the batch (divisible by ``META_ROWS``) stay symbolic graph values, every other
  size is a concrete ``int``. So ``B, H, W, C = x.shape`` followed by ``if H % ws:`` traces
  (H is concrete, B is a graph value), and the twins tell which tensors are per sample.
  Python control flow on a batch-dependent size still fails: such a block is left to timm.

Non-tensor arguments are specialized (their values are part of the rewrite's key). Nothing here
runs real compute or draws random numbers.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import operator
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn

#: Rows of the meta tensors. A size divisible by it is taken to scale with the batch, so it is
#: prime and larger than any per-sample size a block is likely to have.
META_ROWS = 1009

UNKNOWN = object()  # a value whose meta twin could not be computed
_META = "maskedbranch_meta"  # node.meta key

_local = threading.local()


@contextlib.contextmanager
def suspended():
    """Patched blocks called in here run timm's own forward (meta execution of a block that
    contains another patched block, or a trace in progress)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def is_suspended() -> bool:
    return getattr(_local, "depth", 0) > 0


def batch_dependent(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n % META_ROWS == 0


class _ShapeProxy(fx.Proxy):
    """A proxy whose shape queries answer with concrete sizes where they do not depend on the
    batch (see the module docstring)."""

    def __getattr__(self, k: str) -> Any:
        meta = self.tracer.meta(self.node) if k in _SHAPE_ATTRS else UNKNOWN
        if isinstance(meta, Tensor):
            if k == "shape":
                return self.tracer.shape_of(self, meta)
            if k == "size":
                return functools.partial(self.tracer.size_of, self, meta)
            if k == "dim":
                return meta.dim
            return getattr(meta, k)  # ndim, dtype, is_floating_point
        return super().__getattr__(k)

    def __len__(self) -> int:
        meta = self.tracer.meta(self.node)
        if isinstance(meta, Tensor) and meta.dim() > 0 and not batch_dependent(meta.shape[0]):
            return meta.shape[0]
        if isinstance(meta, (tuple, list)):
            return len(meta)
        return super().__len__()


_SHAPE_ATTRS = frozenset({"shape", "size", "dim", "ndim", "dtype", "is_floating_point"})


def _has_unknown(value: Any) -> bool:
    if value is UNKNOWN:
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_unknown(v) for v in value)
    if isinstance(value, dict):
        return any(_has_unknown(v) for v in value.values())
    if isinstance(value, slice):
        return _has_unknown((value.start, value.stop, value.step))
    return False


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors (no data is copied),
    without the hooks registered on it and its submodules: the user's hooks must not see meta
    tensors, and a hook's closure may reach anything (the whole model) that a deep copy would
    then duplicate."""
    memo: Dict[int, Any] = {}
    for t in module.parameters():
        memo[id(t)] = nn.Parameter(t.to("meta"), requires_grad=t.requires_grad)
    for t in module.buffers():
        memo[id(t)] = t.to("meta")
    for m in module.modules():
        for name, value in vars(m).items():
            if "hook" in name and isinstance(value, dict):
                memo[id(value)] = type(value)()
    with suspended():
        return copy.deepcopy(module, memo)


class Tracer(fx.Tracer):
    """Traces ``type(root).forward`` with each argument either a placeholder (tensors) or its
    concrete value (everything else). ``inputs``: (name, value) in signature order, with a meta
    twin for tensors (shaped mode) or None (structural mode)."""

    def __init__(self, inputs: Sequence[Tuple[str, Any]], metas: Optional[Dict[str, Any]], autowrap=()):
        super().__init__(autowrap_functions=tuple(autowrap))
        self._inputs = list(inputs)
        self._metas = metas
        self._meta_modules: Dict[str, nn.Module] = {}  # submodule path -> its meta copy
        self._in_meta = False  # executing a node on meta twins: module calls run, unrecorded

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True  # only the root's own forward is traced

    def call_module(self, m, forward, args, kwargs):
        if self._in_meta:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._in_meta:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        values: List[Any] = []
        for name, value in self._inputs:
            ph = self.create_proxy("placeholder", name, (), {})
            values.append(ph if value is _TENSOR else value)
        params = list(inspect.signature(root_fn).parameters.values())[1:]
        keyword = {p.name for p in params if p.kind == p.KEYWORD_ONLY}

        def call(*args: Any) -> Any:  # keyword-only arguments by name
            pos = [v for (name, _), v in zip(self._inputs, args[1:]) if name not in keyword]
            kw = {name: v for (name, _), v in zip(self._inputs, args[1:]) if name in keyword}
            return root_fn(args[0], *pos, **kw)

        return call, [self.root, *values]

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapeProxy(node, self)

    # -- meta twins, computed on demand (only shape queries need them) ----------------------

    def meta(self, node: fx.Node) -> Any:
        """The meta twin of ``node``'s value, or UNKNOWN."""
        if self._metas is None:
            return UNKNOWN
        if _META not in node.meta:
            node.meta[_META] = UNKNOWN  # while computing
            node.meta[_META] = self._compute(node)
        return node.meta[_META]

    def _compute(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return self._metas.get(node.target, UNKNOWN)
        args = fx.node.map_arg(node.args, self.meta)
        kwargs = fx.node.map_arg(node.kwargs, self.meta)
        if _has_unknown(args) or _has_unknown(kwargs):
            return UNKNOWN
        args = fx.node.map_aggregate(args, _to_meta)
        kwargs = fx.node.map_aggregate(kwargs, _to_meta)
        was, self._in_meta = self._in_meta, True  # plain module attributes and calls, unrecorded
        try:
            with torch.no_grad(), suspended():
                if node.op == "get_attr":
                    value = self.root
                    for atom in str(node.target).split("."):
                        value = getattr(value, atom)
                    return _to_meta(value)
                if node.op == "call_function":
                    return node.target(*args, **kwargs)
                if node.op == "call_method":
                    return getattr(args[0], node.target)(*args[1:], **kwargs)
                if node.op == "call_module":
                    if node.target not in self._meta_modules:
                        self._meta_modules[node.target] = meta_copy(self.root.get_submodule(node.target))
                    return self._meta_modules[node.target](*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op without a meta kernel (or a module that cannot be copied)
            return UNKNOWN
        finally:
            self._in_meta = was
        return UNKNOWN

    # -- shape queries ----------------------------------------------------------------------

    def _dim_value(self, proxy: fx.Proxy, size: int, i: int) -> Any:
        if not batch_dependent(size):
            return size
        shape = self.create_proxy("call_function", getattr, (proxy, "shape"), {})
        return self.create_proxy("call_function", operator.getitem, (shape, i), {})

    def shape_of(self, proxy: fx.Proxy, meta: Tensor) -> Tuple[Any, ...]:
        return tuple(self._dim_value(proxy, s, i) for i, s in enumerate(meta.shape))

    def size_of(self, proxy: fx.Proxy, meta: Tensor, dim: Optional[int] = None) -> Any:
        if dim is None:
            return self.shape_of(proxy, meta)
        d = dim + meta.dim() if dim < 0 else dim
        return self._dim_value(proxy, meta.shape[d], d)


class _TensorMarker:
    def __repr__(self) -> str:
        return "<tensor argument>"


_TENSOR = _TensorMarker()
TENSOR = _TENSOR  # marks a tensor argument in ``inputs``


def timm_notrace_functions() -> Tuple[Any, ...]:
    """Functions timm registers as leaves for its own fx feature extraction."""
    try:
        from timm.layers import get_notrace_functions
    except ImportError:  # pragma: no cover - older timm
        return ()
    return tuple(f for f in get_notrace_functions() if callable(f))


def _to_meta(v: Any) -> Any:
    return v.to("meta") if isinstance(v, Tensor) and v.device.type != "meta" else v


def trace(block: nn.Module, inputs: Sequence[Tuple[str, Any]], metas: Optional[Dict[str, Any]]) -> Tuple[fx.Graph, Any]:
    """The graph of ``type(block).forward`` and a function giving a node's meta twin (UNKNOWN
    when none). ``inputs``: (name, TENSOR or concrete value) in signature order; ``metas``:
    name -> meta twin of each tensor argument (shaped mode), or None (structural mode). Raises
    what fx raises on untraceable code."""
    tracer = Tracer(inputs, metas, timm_notrace_functions())
    with suspended(), torch.random.fork_rng(devices=[]):
        graph = tracer.trace(block)

    def meta(node: fx.Node) -> Any:
        with suspended(), torch.random.fork_rng(devices=[]):
            return tracer.meta(node)

    return graph, meta
