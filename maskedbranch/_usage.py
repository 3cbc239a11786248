"""Which branches of each routing module ran, for the reset of unused gradients to ``None``
(maskedbranch/_wiring.py, maskedbranch/unused_grads.py).

A routing module's *units* are its branches (a LayerDrop owner adds its own parameters as one
more unit); its :class:`Usage` records which ran in calls with autograd on, until the record is
taken: by the data-parallel wrapper's forward hook, or at the optimizer step.

Two records, so that neither eager calls nor compiled graphs pay for the other's:

* ``bits``, a Python int, in eager mode (one ``|=``);
* ``seen``, a small CPU tensor, inside compiled graphs: an in-place op on a tensor is data to
  torch.compile, where a Python attribute written every call would become a guard and recompile
  the graph whenever the routing changes.

Functional forms (``masked_branch``, ``drop_add_residual``) have no module of their own: each
module branch they run is a unit of its own (:class:`FunctionalUnit`), found again by identity.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

_MIN_SLOTS = 64  # seen's size at least: branches appended later rarely need a new tensor


class Usage:
    """One routing module's record of the units that ran (bit i: unit i), and its binding to
    the data-parallel wrapper around it (maskedbranch/_dead_grads.py).

    ``held``: one forward's units that count only if that forward's output is used (a LayerDrop
    owner's, see maskedbranch/integrations/_layerdrop.py); they join ``bits`` at the next
    forward or take, or ``cond`` when a consumer that dropped every layer only tied that output
    in: such units are unused unless their gradients turn out nonzero (a gradient reached the
    output from elsewhere), which the step reads (:meth:`Held.conditional`)."""

    __slots__ = ("bits", "cond", "held", "seen", "traced", "binding")

    def __init__(self) -> None:
        self.bits = 0
        self.cond = 0
        self.held: Optional[Held] = None
        self.seen = torch.zeros(_MIN_SLOTS, dtype=torch.uint8)
        self.traced = False  # set (by compiled code) once a compiled graph may have written seen
        self.binding: Any = None

    def record(self, live_mask: int) -> None:
        """Eager calls with autograd on."""
        self.bits |= live_mask

    def record_live(self, live: Tensor) -> None:
        """Compiled calls: ``live`` is a bool or integer tensor [units] (nonzero: ran)."""
        n = live.shape[0]
        self.seen[:n].bitwise_or_(live.to(torch.uint8))
        self.traced = True

    def record_traced_mask(self, live_mask: int) -> None:
        """Compiled calls whose units are known while tracing (a constant mask)."""
        i = 0
        while live_mask:
            if live_mask & 1:
                self.seen[i : i + 1].fill_(1)
            live_mask >>= 1
            i += 1
        self.traced = True

    def ensure(self, units: int) -> None:
        """Eager: room for ``units`` in ``seen`` (a module that grew)."""
        if units > self.seen.shape[0]:
            grown = torch.zeros(max(units, 2 * self.seen.shape[0]), dtype=torch.uint8)
            grown[: self.seen.shape[0]] = self.seen
            self.seen = grown

    def hold(self, bits: int) -> "Held":
        self.settle()
        self.held = Held(bits)
        return self.held

    def settle(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            if held.conditional:
                self.cond |= held.bits
            else:
                self.bits |= held.bits

    def take(self) -> Tuple[int, int]:
        """(units that ran, units that ran only conditionally) since the last take; clears them."""
        self.settle()
        bits, cond = self.bits, self.cond
        self.bits = self.cond = 0
        if self.traced:
            seen = self.seen
            for i in seen.nonzero().flatten().tolist():
                bits |= 1 << i
            seen.zero_()
        return bits, cond & ~bits


class Held:
    """The units one forward of a module ran (see :class:`Usage`)."""

    __slots__ = ("bits", "conditional")

    def __init__(self, bits: int) -> None:
        self.bits, self.conditional = bits, False


class FunctionalUnit:
    """A module branch of ``masked_branch`` / ``drop_add_residual``: a routing unit of its own,
    with the protocol of the routing modules (``_usage``, ``_unit_modules``, ``_units``)."""

    __slots__ = ("module", "_usage", "materialize_grads", "__weakref__")

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)
        self._usage = Usage()
        self.materialize_grads = None

    def _unit_modules(self) -> List[nn.Module]:
        m = self.module()
        return [] if m is None else [m]

    def _units(self) -> List[Sequence[Tensor]]:
        return [tuple(m.parameters()) for m in self._unit_modules()]


_functional: "weakref.WeakKeyDictionary[nn.Module, FunctionalUnit]" = weakref.WeakKeyDictionary()


def functional_unit(module: nn.Module) -> FunctionalUnit:
    unit = _functional.get(module)
    if unit is None:
        unit = _functional[module] = FunctionalUnit(module)
    return unit


def record_functional(branches: Sequence[Any], ran: Any, out: Any = None) -> None:
    """A functional call in a distributed job: each module branch is a unit of its own, noted
    by the wrapper running it; record which ran. Compiled calls are not recorded (their dead
    module branches keep the zero gradients the graph gives them: use the module forms, whose
    records compiled graphs write)."""
    if isinstance(ran, Tensor):
        return
    from . import _dead_grads

    wiring = _dead_grads.context().wiring
    for i, b in enumerate(branches):
        if isinstance(b, nn.Module):
            unit = functional_unit(b)
            unit._usage.record(ran >> i & 1)
            if wiring is not None:
                wiring.add_functional(unit)
    if wiring is not None and wiring.needs_first:
        wiring.first_forward_hook(out)


def functional_units_in(modules: Sequence[nn.Module]) -> List[FunctionalUnit]:
    """The functional units among ``modules`` (in their order)."""
    if not _functional:
        return []
    out = []
    for m in modules:
        unit = _functional.get(m)
        if unit is not None:
            out.append(unit)
    return out


_by_id: "dict[int, weakref.ref]" = {}


def note_module(module: Any) -> None:
    """Findable by id (compiled code hands modules to trace-time functions by id)."""
    _by_id[id(module)] = weakref.ref(module, lambda ref, key=id(module): _by_id.pop(key, None) if _by_id.get(key) is ref else None)


def module_by_id(key: Optional[int]) -> Any:
    ref = _by_id.get(key) if key is not None else None
    return None if ref is None else ref()


def is_routing(m: Any) -> bool:
    """A routing module (MaskedBranch, ResidualDropPath, a LayerDrop list) or functional unit."""
    return isinstance(getattr(m, "_usage", None), Usage) and hasattr(m, "_units")


def routing_modules(root: nn.Module) -> List[nn.Module]:
    """The routing modules in ``root``, in ``modules()`` order (the same on every rank)."""
    return [m for m in root.modules() if is_routing(m)]


def usage_of(m: Any) -> Optional[Usage]:
    u = getattr(m, "_usage", None)
    return u if isinstance(u, Usage) else None
