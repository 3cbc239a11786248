"""The only place where maskedbranch touches private PyTorch APIs, each behind a feature check
with a public fallback that the tests exercise (tests/test_compat.py).

* :func:`functorch_active`: whether a ``torch.func`` transform is running. autograd Functions
  come in two forms (maskedbranch/_autograd.py): the ``setup_context`` form that torch.func
  requires, and the classic form, which costs about 40 us less per call in eager mode (the
  former binds its arguments with ``inspect.signature`` on every call). Fallback: always the
  torch.func form (correct everywhere, slower).
* :func:`active_ddp`: the ``DistributedDataParallel`` whose forward is running, so that the
  routing modules can read its settings (maskedbranch/_dead_grads.py). Fallback: a global
  forward pre-hook on every module (public, but it costs every module call in the process a
  little), installed only when the private attribute is missing.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["functorch_active", "tracing", "active_ddp"]

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


_DDP = nn.parallel.DistributedDataParallel
_HAS_ACTIVE_ATTR = hasattr(_DDP, "_active_ddp_module")
_force_fallback = {"functorch": False, "ddp": False}  # set by the tests of the fallbacks


class _ForwardTracker:
    """The public fallback of :func:`active_ddp`: global forward hooks note which DDP module's
    forward is running (a stack per thread)."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.handles: Any = None

    def install(self) -> None:
        if self.handles is None:
            pre = nn.modules.module.register_module_forward_pre_hook(self._enter)
            post = nn.modules.module.register_module_forward_hook(self._leave, always_call=True)
            self.handles = (pre, post)

    def remove(self) -> None:
        if self.handles is not None:
            for h in self.handles:
                h.remove()
            self.handles = None

    def _stack(self) -> list:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def _enter(self, module: nn.Module, args: Any) -> None:
        if isinstance(module, _DDP):
            self._stack().append(module)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(module, _DDP):
            stack = self._stack()
            if stack and stack[-1] is module:
                stack.pop()

    def current(self) -> Optional[nn.Module]:
        stack = self._stack()
        return stack[-1] if stack else None


_tracker = _ForwardTracker()


def active_ddp() -> Optional[nn.Module]:
    """The DistributedDataParallel module whose forward is running in this thread, or None."""
    if _HAS_ACTIVE_ATTR and not _force_fallback["ddp"]:
        return getattr(_DDP, "_active_ddp_module", None)
    _tracker.install()
    return _tracker.current()
