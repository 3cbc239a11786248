"""The project's only uses of private PyTorch APIs (docs/design.md, "_compat.py is the one private-API
module"). Each function names the private API it reads, why, and its public fallback, which
tests/test_compat.py exercises through ``_force_fallback``.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

__all__ = ["functorch_active", "tracing", "compiled_autograd_tracing", "active_ddp", "ddp_python_reducer", "ddp_join_active",
           "queue_backward_callback", "can_queue_backward_callback", "ddp_ignored_names", "ddp_comm_hooks",
           "inductor_layout_optimization", "captures_data_dependent", "is_view_of", "wrapper_on_stack",
           "fsdp_module_type", "recompile_limit"]

_functorch_check = getattr(torch._C, "_are_functorch_transforms_active", None)


def functorch_active() -> bool:
    """True while a torch.func transform (grad, vjp, vmap, ...) runs
    (``torch._C._are_functorch_transforms_active``), so that eager calls can take the cheaper
    classic-form autograd Functions (docs/design.md, "Autograd in Python Functions, in two forms").
    Fallback: True, the ``setup_context`` form everywhere (correct, slower)."""
    if _functorch_check is None or _force_fallback["functorch"]:
        return True  # fallback: the form that works under the transforms works everywhere
    return bool(_functorch_check())


def tracing() -> bool:
    """True while torch.compile traces or a torch.func transform runs, when the routing modules
    build their branch table afresh: Dynamo would guard on the cache (and its graph modules
    invalidate it), and a cache built under ``torch.func.functional_call`` would keep the
    parameters it swaps in unregistered."""
    return torch.compiler.is_compiling() or functorch_active()


def compiled_autograd_tracing() -> bool:
    """True while compiled autograd traces a backward (tied tensors then get zeros, and no callback
    is queued): ``torch._dynamo.compiled_autograd.in_compiled_autograd_region``, loaded whenever
    compiled autograd is on. Fallback: ``torch.compiler.is_compiling()``, also true while
    torch.compile traces a backward."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    if module is None:
        return False
    flag = getattr(module, "in_compiled_autograd_region", None)
    if isinstance(flag, bool) and not _force_fallback["compiled_autograd"]:
        return flag
    return torch.compiler.is_compiling()

_DDP = nn.parallel.DistributedDataParallel
_HAS_ACTIVE_ATTR = hasattr(_DDP, "_active_ddp_module")
_force_fallback = {"functorch": False, "ddp": False, "python_reducer": False, "compiled_autograd": False, "join": False,
                   "inductor": False, "capture": False, "views": False, "stack": False,
                   "recompile_limit": False, "callback": False}  # set by the tests of the fallbacks
_PYTHON_REDUCER = ("python_reducer", "python_reducer_without_compiled_forward")


def active_ddp() -> Optional[nn.Module]:
    """The DDP module whose forward runs under the C++ reducer (DDP's ``_active_ddp_module``,
    which the Python reducer does not set), or None: how a unit finds a DDP that has no reducer
    yet and reads its settings. Fallback: None, "no DDP knowledge": dead branches get zero
    gradients, which every DDP setting accepts, at the cost of the zero fills, of reducing usage
    over the default process group and of not recognising parameters a branch shares with the
    rest of the model."""
    if _HAS_ACTIVE_ATTR and not _force_fallback["ddp"]:
        return _DDP._active_ddp_module
    return None


def ddp_python_reducer() -> bool:
    """Whether DDP modules built now use the Python reducer, which compiled autograd needs
    (``torch._dynamo.config.optimize_ddp``; DDP imports that config in its constructor, so while
    it is not imported nothing has set it). Fallback: True: the gradient order the Python reducer
    needs is correct under every reducer, only a little costlier."""
    config = sys.modules.get("torch._dynamo.config")
    if config is None:
        return False
    mode = getattr(config, "optimize_ddp", _force_fallback)  # a sentinel when the setting is gone
    if mode is _force_fallback or _force_fallback["python_reducer"]:
        return True
    return mode in _PYTHON_REDUCER


def ddp_uses_python_reducer(module: nn.Module) -> bool:
    """Whether this DDP module all-reduces with the Python reducer, as DDP recorded at
    construction (``_use_python_reducer``). Fallback: :func:`ddp_python_reducer`, whose later
    changes then go unseen."""
    flag = getattr(module, "_use_python_reducer", None)
    if isinstance(flag, bool) and not _force_fallback["python_reducer"]:
        return flag
    return ddp_python_reducer()


def ddp_join_active(module) -> bool:
    """Whether ``module`` is a DDP module inside ``torch.distributed.algorithms.Join`` (DDP's
    ``_join_config``), which the reducer refuses with its message: joined ranks miss the usage
    all-reduce. Fallback: False: a Join then fails in that all-reduce with gloo's or NCCL's own
    error."""
    config = getattr(module, "_join_config", None) if isinstance(module, _DDP) else None
    if config is None or _force_fallback["join"]:
        return False
    return bool(getattr(config, "enable", False))


def queue_backward_callback(fn) -> bool:
    """Queue ``fn`` (from a hook inside the backward) to run when the backward ends, after all its
    gradients are accumulated, as DDP's own reducer finishes (the engine's
    ``Variable._execution_engine.queue_callback``): there the parameters a DDP module leaves to
    maskedbranch are averaged. False where nothing is queued: the fallback (DDP then keeps every
    parameter, dead ones tied at the wrapper: correct, slower), and while compiled autograd traces
    the backward (torch 2.6 asserts there; no parameter is left to maskedbranch under it)."""
    queue = _engine_queue_callback()
    if queue is None or compiled_autograd_tracing():
        return False
    queue(fn)
    return True


def _engine_queue_callback():
    """The autograd engine's ``queue_callback`` (None where it is missing or forced off)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    return None if _force_fallback["callback"] else getattr(engine, "queue_callback", None)


def ddp_ignored_names(module) -> Optional[set]:
    """The names a DDP module under construction leaves out of its buckets and its initial
    broadcast (``parameters_to_ignore``, undocumented; when DDP reads it: docs/design.md, "Routed
    parameters leave DDP's buckets"), to which the parameters maskedbranch averages are added.
    Fallback (forced with the callback's): None: every parameter stays DDP's, dead ones tied."""
    names = getattr(module, "parameters_to_ignore", None)
    if not isinstance(names, set) or _force_fallback["callback"]:
        return None
    return names


def can_queue_backward_callback() -> bool:
    """Whether :func:`queue_backward_callback` can queue at all (if not, DDP keeps every parameter)."""
    return _engine_queue_callback() is not None


def ddp_comm_hooks(module) -> list:
    """The communication hooks registered on a DDP module (``_comm_hooks``), so that one, which
    would not see the parameters maskedbranch averages, is refused with a message. Fallback: none
    seen: those parameters are averaged exactly while the hook compresses the others."""
    return list(getattr(module, "_comm_hooks", None) or ())


def inductor_layout_optimization() -> bool:
    """True while inductor lowers a graph with its layout optimization (channels_last
    convolutions), read from its graph handler (``torch._inductor.virtualized.V.graph``) at compile
    time only, for the warning that a routed convolution will fail inductor's stride check.
    Fallback: False (no warning: the failure's own message stands alone)."""
    virtualized = sys.modules.get("torch._inductor.virtualized")
    if virtualized is None or _force_fallback["inductor"]:
        return False
    try:
        return getattr(virtualized.V.graph, "layout_opt", False) is True
    except Exception:  # noqa: BLE001 - no graph being lowered, or another inductor
        return False


_FLAGS = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")


def captures_data_dependent() -> bool:
    """While torch.compile traces (call it from a function Dynamo runs for real, such as one
    marked ``torch.compiler.assume_constant_result``): whether this trace captures ``.tolist()``
    of a tensor and ops with data-dependent output sizes, rather than breaking the graph there.
    Read from the trace's shape environment (``torch._guards.TracingContext``), where Dynamo
    records the two flags, or fullgraph on torch >= 2.13. Fallback: the flags in
    ``torch._dynamo.config`` (under ``fullgraph=True`` without them, the drop paths then run the
    dense formula: same results)."""
    if not _force_fallback["capture"]:
        try:
            context = torch._guards.TracingContext.try_get()
            env = context.fake_mode.shape_env if context is not None and context.fake_mode is not None else None
            if env is not None:
                scalars, shapes = env.allow_scalar_outputs, env.allow_dynamic_output_shape_ops
                if isinstance(scalars, bool) and isinstance(shapes, bool):
                    return scalars and shapes
        except Exception:  # noqa: BLE001 - another torch: the flags below
            pass
    config = sys.modules.get("torch._dynamo.config")
    return all(getattr(config, name, False) is True for name in _FLAGS)


def is_view_of(y: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``y`` is ``x`` or shares its memory as a view (both views of one base included;
    ``Tensor._base``), read on meta tensors while a graph is traced, so that a branch that returns
    its input gets a copy inside ``torch.cond`` (which refuses outputs aliasing inputs). Fallback:
    True (a copy always)."""
    if y is x:
        return True
    if _force_fallback["views"]:
        return True
    base_y, base_x = getattr(y, "_base", _FLAGS), getattr(x, "_base", _FLAGS)
    if base_y is _FLAGS or base_x is _FLAGS:  # no such attribute: assume the worst
        return True
    return (base_y if base_y is not None else y) is (base_x if base_x is not None else x)


def fsdp_module_type() -> Optional[type]:
    """FSDP2's module class, if the user imported FSDP (nothing is imported here)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    t = getattr(fsdp, "FSDPModule", None)
    return t if isinstance(t, type) else None


_CALL_CODES = frozenset(getattr(nn.Module, n).__code__ for n in ("_call_impl", "_wrapped_call_impl") if hasattr(nn.Module, n))


def wrapper_on_stack() -> Optional[nn.Module]:
    """The outermost DDP or FSDP2 module whose forward is on the Python stack (a compiled module
    counts as the module it compiles), read from CPython's frames (``sys._getframe``) when a unit
    decides under a wrapper that has not announced itself (a DDP built before any routing module
    existed in a distributed job); never per call. Fallback: None: the unit decides as in one
    process until the wrapper's own hooks or DDP's record find it."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None or _force_fallback["stack"]:
        return None
    fsdp = fsdp_module_type()
    found = None
    f = getframe(1)
    while f is not None:
        if f.f_code in _CALL_CODES:
            m = f.f_locals.get("self")
            m = getattr(m, "_orig_mod", m)
            if isinstance(m, nn.parallel.DistributedDataParallel) or (fsdp is not None and isinstance(m, fsdp)):
                found = m
        f = f.f_back
    return found


def recompile_limit() -> Optional[int]:
    """How many graphs Dynamo compiles for one frame before it runs the frame eagerly
    (``torch._dynamo.config.recompile_limit``, ``cache_size_limit`` before torch 2.7), for the
    warning that int gates approach it. Fallback: None (no warning)."""
    if _force_fallback["recompile_limit"]:
        return None
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
