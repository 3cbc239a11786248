"""Facts derived from a module tree (its parameter lists, whether it runs collectives), cached
until the structure may have changed.

Walking ``parameters()`` / ``named_modules()`` of every branch on every call costs more than a
small branch's forward. Any registration of a module or parameter anywhere in the process (which
``convert_sync_batchnorm``, ``add_module`` and parameter assignment all go through) bumps a
global version, and so does ``_apply`` (``.to()``, ``.half()``) on the owning module.

``Usage`` holds the bits through which routing modules record which branches ran (read and reset
by :func:`maskedbranch.unused_grads_to_none`)."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

from torch.nn.modules import module as _module

T = TypeVar("T")
_version = [0]


def invalidate(*_args) -> None:
    """Mark every cached structure stale. Also the signature of the registration hooks, which
    must return None to leave the registered object unchanged."""
    _version[0] += 1


_module.register_module_module_registration_hook(invalidate)
_module.register_module_parameter_registration_hook(invalidate)


class InvalidatesOnApply:
    """Mixin for modules that cache facts about their parameters: ``_apply`` (``.to()``,
    ``.half()``) may replace parameter objects without registering them."""

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        invalidate()
        return out


class StructureCache(Generic[T]):
    """One value computed from a module tree, recomputed after the structure may have changed."""

    __slots__ = ("_version", "_value")

    def __init__(self) -> None:
        self._version = -1
        self._value = None

    def get(self, compute: Callable[[], T]) -> T:
        if self._version != _version[0]:
            self._value = compute()  # may raise: then nothing is cached
            self._version = _version[0]
        return self._value

    def peek(self) -> "T | None":
        """The cached value while it is current, else None (no closure to build per call)."""
        return self._value if self._version == _version[0] else None

    def clear(self) -> None:
        self._version = -1
        self._value = None

    # copy.deepcopy / pickle: a copy computes its value again (which may hold C++ objects).
    def __getstate__(self) -> int:
        return 0

    def __setstate__(self, _state: int) -> None:
        self.clear()


class Usage:
    """Bit i: unit i (a branch) ran in a call that built a graph since the bits were last reset.
    A plain object, since assigning a module attribute goes through nn.Module.__setattr__."""

    __slots__ = ("bits",)

    def __init__(self) -> None:
        self.bits = 0
