"""The doctor's simulated ranks: one process sees the graph of a DDP job. Inside
:func:`as_if_under_ddp` the routing units of a model decide as under DDP (its C++ reducer, no
static_graph) for a reducer that stands for the wrapper (:class:`Simulated`: no wrapper to hook,
no collective), and :meth:`Simulated.tie` ties into each forward's output what a DDP reducer
would."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from torch import nn

from .. import _autograd, _decide, _unit, _reducer


class Simulated(_reducer.Reducer):
    """The reducer of a DDP wrapper of ``root``, simulated: pushed on the running wrappers while
    :func:`as_if_under_ddp` runs, so that the units decide for it as under DDP (the wrapper ties
    the dead groups); :meth:`tie` ties into a forward's output what that reducer would."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__(None)
        self.context = _decide.DDP
        self.sim_root = root

    def root(self) -> Optional[nn.Module]:
        return self.sim_root

    def tie(self, output: Any) -> Any:
        """``output`` with the groups that did not run in this forward tied in (every routing
        module's unit decides first: one that no call reached is tied too). The records are left
        as they are."""
        for m in _unit.routing_modules(self.sim_root):
            if m._unit.reducer is not self or m._unit.tying is None:
                self.decide(m._unit)
        layout = self._layout()
        if layout is None or not layout.units:
            return output
        dead = layout.take(self, _reducer.TIED_AT_WRAPPER, keep_records=True)[2]
        return _autograd.tie_outputs(output, dead, False) if dead else output


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
