"""Routing units of the functional forms (``masked_branch``, ``drop_add_residual``), which have no
module of their own: each module branch they run is the owner of a unit of its own (one group:
the module's parameters), found again by identity. A function branch has no unit (nothing to
reduce or reset: its ``params=`` are tied per call)."""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence

from torch import Tensor, nn

from ._unit import Tying, RoutingUnit


class BranchOwner:
    """A module branch of a functional call, as the owner of its unit."""

    __slots__ = ("module", "_unit", "__weakref__")

    def __init__(self, module: nn.Module, where: str):
        self.module = weakref.ref(module)
        self._unit = RoutingUnit(self, where, None)

    def _unit_groups(self) -> List[Sequence[Tensor]]:
        m = self.module()
        return [] if m is None else [tuple(m.parameters())]

    def _unit_modules(self) -> List[nn.Module]:
        m = self.module()
        return [] if m is None else [m]

    def _check_skippable(self) -> None:
        pass  # the functional forms check their branches on every call


def unit_for(module: nn.Module, where: str) -> RoutingUnit:
    owner = FUNCTIONAL.by_module.get(module)
    if owner is None:
        owner = FUNCTIONAL.by_module[module] = BranchOwner(module, where)
    return owner._unit


def tying_here(branches: Sequence[Any], where: str) -> Optional[Tying]:
    """The tying of a functional call with ``materialize_grads="auto"`` (every module branch's
    unit decides under the same wrapper; None when no branch is a module)."""
    tying = None
    for b in branches:
        if isinstance(b, nn.Module):
            tying = unit_for(b, where).tying_here()
    return tying


def record(branches: Sequence[Any], ran: Any, where: str) -> None:
    """Which module branches ran (eager calls; compiled calls keep the zero gradients their
    graph gives dead module branches: the module forms hold a record compiled graphs write)."""
    if isinstance(ran, Tensor):
        return
    for i, b in enumerate(branches):
        if isinstance(b, nn.Module):
            unit_for(b, where).record(ran >> i & 1)


def units_in(modules: Sequence[nn.Module]) -> List[RoutingUnit]:
    """The units of the functional calls' branches among ``modules`` (in their order)."""
    out = []
    for m in modules:
        owner = FUNCTIONAL.by_module.get(m)
        if owner is not None:
            out.append(owner._unit)
    return out


class _Functional:
    """The functional forms' state: the owner of each module branch's unit (weakly keyed by the
    module), and, as the owner of the one unit that function branches share (no parameters of
    its own: it only holds the decision, e.g. DDP's Python reducer), that unit."""

    __slots__ = ("by_module", "_unit", "__weakref__")

    def __init__(self) -> None:
        self.by_module: "weakref.WeakKeyDictionary[nn.Module, BranchOwner]" = weakref.WeakKeyDictionary()
        self._unit = RoutingUnit(self, "drop_add_residual", True)

    def _unit_groups(self) -> List[Sequence[Tensor]]:
        return []

    def _unit_modules(self) -> List[nn.Module]:
        return []

    def _check_skippable(self) -> None:
        pass


FUNCTIONAL = _Functional()
FUNCTIONS = FUNCTIONAL._unit  # the function branches' unit
