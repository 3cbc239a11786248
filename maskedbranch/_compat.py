"""The only place where maskedbranch touches private PyTorch APIs, each behind a feature check
with a public fallback that the tests exercise (tests/test_compat.py).

* :func:`functorch_active`: whether a ``torch.func`` transform is running. autograd Functions
  come in two forms (maskedbranch/_autograd.py): the ``setup_context`` form that torch.func
  requires, and the classic form, which costs about 40 us less per call in eager mode (the
  former binds its arguments with ``inspect.signature`` on every call). Fallback: always the
  torch.func form (correct everywhere, slower).
* :func:`active_ddp`: the ``DistributedDataParallel`` whose forward is running, so that the
  routing modules can read its settings (maskedbranch/_decide.py). Fallback: None, "no DDP
  knowledge": dead branches then get zero gradients, which is right under every DDP setting
  (maskedbranch/unused_grads.py sets those of parameters no rank used back to None), at the
  cost of the zero fills, of pruning over the default process group and of not recognising
  parameters that a branch shares with the rest of the model (tests/test_ddp_masked_branch.py).
* :func:`ddp_python_reducer`: whether DDP uses its Python reducer (``torch._dynamo.config.
  optimize_ddp``, what compiled autograd needs). Fallback: True (the gradient order that the
  Python reducer needs is correct under every reducer, only a little costlier).
* :func:`ddp_join_active`: whether a DDP module runs inside ``Join`` (uneven inputs), read from
  its ``_join_config``. Fallback: False (a Join then fails in the all-reduce it cannot shadow,
  with gloo's or NCCL's own error, instead of with maskedbranch's message).
* :func:`queue_backward_callback`: run a function when the running backward ends, after every
  gradient of it is accumulated (``Variable._execution_engine.queue_callback``, what DDP's own
  reducer finishes with), so that the parameters a DDP module leaves to maskedbranch are averaged
  there. Fallback: None (nothing queued): maskedbranch then leaves every parameter to DDP and ties
  the dead ones instead, correct and slower (maskedbranch/_reducer.py).
* :func:`ddp_ignored_names`: the set of names that a DDP module under construction leaves out
  of its reducer and its initial broadcast (``parameters_to_ignore``, undocumented: DDP fills it
  from ``_ddp_params_and_buffers_to_ignore`` before it assigns ``DDP.module`` and reads it when it
  builds its reducer, after). Fallback: None (every parameter stays DDP's, dead ones tied).
* :func:`ddp_comm_hooks`: the communication hooks registered on a DDP module (``_comm_hooks``),
  so that a hook which would not see the parameters maskedbranch averages is refused with a
  message. Fallback: none seen (those parameters are then averaged exactly while the hook
  compresses the others).
* :func:`inductor_layout_optimization`: whether inductor is lowering a graph with its layout
  optimization on (channels_last convolutions), read from its graph handler at compile time
  only. Fallback: False (no warning that a routed convolution will fail inductor's stride check:
  the failure's own message then stands alone).
* :func:`captures_data_dependent`: while torch.compile traces, whether Dynamo captures
  ``.tolist()`` of a tensor and ops whose output size is data (``capture_scalar_outputs`` and
  ``capture_dynamic_output_shape_ops``, or ``fullgraph=True`` on torch >= 2.13), read from the
  shape environment of the trace. Fallback: the two flags in ``torch._dynamo.config`` (under
  ``fullgraph=True`` without them, the drop paths then run the dense formula: same results).
* :func:`wrapper_on_stack`: the DDP or FSDP2 module whose forward is on the Python stack
  (``sys._getframe``, CPython's frames), for a routing unit that first runs under a wrapper
  that has not announced itself (a DDP built before any routing module existed in a
  distributed job); read when a unit decides, never per call. Fallback: None (the unit decides
  as in one process until the wrapper's own hooks or DDP's record find it).
* :func:`recompile_limit`: Dynamo's limit of graphs per frame (``torch._dynamo.config.
  recompile_limit``, ``cache_size_limit`` before torch 2.7), for the warning that int gates
  approach it. Fallback: None (no warning).
* :func:`is_view_of`: whether a tensor is ``x`` or a view of it (``Tensor._base``), read on meta
  tensors while a graph is traced, so that a branch that returns its input is given a copy
  inside ``torch.cond`` (which refuses outputs aliasing inputs). Fallback: True (a copy always).
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
    """True while a torch.func transform (grad, vjp, vmap, ...) is running."""
    if _functorch_check is None or _force_fallback["functorch"]:
        return True  # fallback: the form that works under the transforms works everywhere
    return bool(_functorch_check())


def tracing() -> bool:
    """True while torch.compile traces or a torch.func transform runs: the routing modules then
    build their branch structure afresh instead of using their cache. Dynamo would guard on the
    cache (and its own graph modules invalidate it), and ``torch.func.functional_call`` swaps
    parameters in without registering them, so a cache built under it would keep the swapped-in
    tensors."""
    return torch.compiler.is_compiling() or functorch_active()



def compiled_autograd_tracing() -> bool:
    """True while compiled autograd traces a backward (a backward asks). The flag lives in
    ``torch._dynamo.compiled_autograd``, which is loaded whenever compiled autograd is on; the
    fallback, ``torch.compiler.is_compiling()``, is also true while torch.compile traces a
    backward."""
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
    """The DistributedDataParallel module whose forward is running (C++ reducer), or None.
    DDP's Python reducer does not set it."""
    if _HAS_ACTIVE_ATTR and not _force_fallback["ddp"]:
        return _DDP._active_ddp_module
    return None


def ddp_python_reducer() -> bool:
    """Whether DDP modules built now use the Python reducer. DDP reads the setting from
    ``torch._dynamo.config`` in its constructor (importing it), so before any import nothing
    can have set it."""
    config = sys.modules.get("torch._dynamo.config")
    if config is None:
        return False
    mode = getattr(config, "optimize_ddp", _force_fallback)  # a sentinel when the setting is gone
    if mode is _force_fallback or _force_fallback["python_reducer"]:
        return True
    return mode in _PYTHON_REDUCER


def ddp_uses_python_reducer(module: nn.Module) -> bool:
    """Whether this DDP module all-reduces with the Python reducer. DDP records its choice at
    construction; without that attribute, the setting it reads (a later change of which then
    goes unseen)."""
    flag = getattr(module, "_use_python_reducer", None)
    if isinstance(flag, bool) and not _force_fallback["python_reducer"]:
        return flag
    return ddp_python_reducer()


def ddp_join_active(module) -> bool:
    """Whether ``module`` is a DDP module inside ``torch.distributed.algorithms.Join``."""
    config = getattr(module, "_join_config", None) if isinstance(module, _DDP) else None
    if config is None or _force_fallback["join"]:
        return False
    return bool(getattr(config, "enable", False))


def queue_backward_callback(fn) -> bool:
    """Queue ``fn`` to run when the backward that is running ends (called from a hook inside it);
    False where it cannot be queued: also while compiled autograd traces the backward (torch 2.6
    asserts there; only DDP's C++ reducer leaves parameters to maskedbranch, and torch refuses it
    under compiled autograd with its own error)."""
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
    names = getattr(module, "parameters_to_ignore", None)
    if not isinstance(names, set) or _force_fallback["callback"]:
        return None
    return names


def can_queue_backward_callback() -> bool:
    return _engine_queue_callback() is not None


def ddp_comm_hooks(module) -> list:
    """The communication hooks registered on a DDP module (empty where none can be seen)."""
    return list(getattr(module, "_comm_hooks", None) or ())


def inductor_layout_optimization() -> bool:
    """True while inductor lowers a graph to which it applies its layout optimization
    (channels_last convolutions)."""
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
    Dynamo records its answer in the trace's shape environment (the two flags, or fullgraph on
    torch >= 2.13); without it, the flags themselves."""
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
    """Whether ``y`` is ``x`` or shares its memory as a view (both views of one base included)."""
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
    """The outermost DDP or FSDP2 module on the Python stack whose forward is running (a
    compiled module counts as the module it compiles)."""
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
    """How many graphs Dynamo compiles for one frame before it runs the frame eagerly."""
    if _force_fallback["recompile_limit"]:
        return None
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
