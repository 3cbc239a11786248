"""The doctor's simulated ranks: one process sees the graph of a DDP job. Inside
:func:`as_if_under_ddp` the routing units of a model decide as under DDP (its C++ reducer, no
static_graph), through the data-parallel layer's one seam for a stand-in wrapper
(``_unit.StandIn``), and :meth:`Simulated.tie` ties into each forward's output what a DDP
reducer would."""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator

from torch import nn

from .. import _autograd, _decide, _layout, _unit, _reducer
from .._unit import Tying, RoutingUnit


class Simulated(_unit.StandIn):
    """Stands for the DDP wrapper of ``root`` while :func:`as_if_under_ddp` runs: its units decide
    as under DDP, and :meth:`tie` ties into a forward's output what a DDP reducer would."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.units = _Decided()

    def decide_for(self, unit: RoutingUnit) -> Tying:
        """As under DDP without static_graph (its C++ reducer): the wrapper ties the dead groups."""
        unit.check_skippable()
        unit.settle(self, id(self), _decide.TABLE[_decide.DDP])
        self.units.add(unit)
        return unit.tying

    def tie(self, output: Any) -> Any:
        """``output`` with the groups that did not run in this forward tied in (every routing
        module's unit decides first: one that no call reached is tied too). The records are left
        as they are."""
        units = [m._unit for m in _unit.routing_modules(self.root)]
        for u in units:
            if u.reducer is not self or u.tying is None:
                self.decide_for(u)
        # The functional forms' units belong to no module of the root, so routing_modules cannot
        # find them: as a DDP reducer keeps them in ``extra``, take every one that decided here.
        units += [u for u in self.units if not isinstance(u.owner(), (nn.Module, type(None))) and u.groups()]
        units = [u for u in units if u.tying in _reducer.TIED_AT_WRAPPER]
        if not units:
            return output
        dead = _layout.Layout(self.root, units).take(self, _reducer.TIED_AT_WRAPPER, keep_records=True)[2]
        return _autograd.tie_outputs(output, dead, False) if dead else output


class _Decided:
    """The units decided for a :class:`Simulated`, weakly held, in the order they decided."""

    def __init__(self) -> None:
        self._refs: Dict[int, "weakref.ref[RoutingUnit]"] = {}

    def add(self, unit: RoutingUnit) -> None:
        ref = self._refs.get(id(unit))
        if ref is None or ref() is not unit:  # (an id reused after its unit was collected)
            self._refs.pop(id(unit), None)
            self._refs[id(unit)] = weakref.ref(unit)

    def __iter__(self) -> Iterator[RoutingUnit]:
        for ref in list(self._refs.values()):
            unit = ref()
            if unit is not None:
                yield unit


@contextlib.contextmanager
def as_if_under_ddp(root: nn.Module) -> Iterator[Simulated]:
    """Inside, the routing units of ``root`` (the module forms' and the functional forms') decide
    as under DDP without static_graph; the caller ties each forward's output with the yielded
    :meth:`Simulated.tie`. Afterwards the units decide again at their next call."""
    sim = Simulated(root)
    _unit.DATA_PARALLEL.running.append(sim)
    try:
        yield sim
    finally:
        _unit.DATA_PARALLEL.running.remove(sim)
        _unit.forget_all(sim.units)
