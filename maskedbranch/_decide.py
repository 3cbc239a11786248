"""The decision table: what the parameters of a routing unit's branches that did not run receive,
decided once per (unit, data-parallel wrapper) and stored in the unit (maskedbranch/_unit.py).

The *context* of a unit is the wrapper whose forward runs it:

==================  =================  =======  ===========================================
context             auto (default)     zeros    none
==================  =================  =======  ===========================================
LOCAL               SKIP               ZEROS    NONE
DDP_FIND_UNUSED     SKIP               ZEROS    NONE
DDP                 AT_WRAPPER         ZEROS    NONE
DDP_STATIC          AT_WRAPPER_ZEROS   ZEROS    refused: unused forever after step 1
PYTHON_REDUCER      ALIASES            ALIASES  refused: pairs defined gradients
FSDP2               ZEROS              ZEROS    NONE (refused at the step)
EXPLICIT            ZEROS              ZEROS    NONE
==================  =================  =======  ===========================================

* LOCAL: one process, or a model that no wrapper runs (a rank-local model in a distributed job):
  nothing tied, as with if/else. DDP_FIND_UNUSED: DDP's graph walk finds the dead parameters
  itself and leaves a gradient that no rank produced untouched, as for if/else.
* DDP (the C++ reducer): the parameters DDP left to the reducer at its construction (every
  routed one but the first in a model of routing modules only) are never tied (the layout leaves their units out of the
  tie) and are averaged by the reducer; the reducer ties the dead parameters DDP kept once per
  forward, with no gradient (DDP fills zeros into its buckets); DDP_STATIC learns from the first
  step which parameters get a hook and needs a defined gradient for them, so the wrapper tie
  gives zeros. DDP_FIND_UNUSED ties nothing; the parameters DDP left are averaged there too.
* PYTHON_REDUCER (compiled autograd): every rank must accumulate the same parameters in the same
  order, whatever its branches did (maskedbranch/_route.py, ``_aliases``).
* FSDP2 reduces only defined gradients; EXPLICIT (a model given to ``unused_grads_to_none``, for
  hand-written averaging) needs a tensor on every rank: zeros, tied by each call.
* The doctor's simulated ranks (maskedbranch/doctor/simulate.py) decide with the DDP row.

Under a wrapper (every context but LOCAL and DDP_FIND_UNUSED, and that one where DDP left
parameters to the reducer) the "auto" units' usage is reduced after each forward of the wrapper
and the gradients that no rank used are reset to ``None`` before the step
(maskedbranch/_reducer.py), where if/else leaves ``None``.

The context is found once per unit and wrapper, whose forward runs (``_unit.current_wrapper``).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from torch import nn

from . import _compat
from ._unit import Tying

LOCAL, DDP_FIND_UNUSED, DDP, DDP_STATIC, PYTHON_REDUCER, FSDP2, EXPLICIT = (
    "local", "ddp-find-unused", "ddp", "ddp-static", "ddp-python-reducer", "fsdp2", "explicit")

_REFUSED_STATIC = (
    "materialize_grads=False under DistributedDataParallel(static_graph=True). static_graph treats a "
    "parameter whose gradient is undefined in the first step as unused forever, so branches that no rank "
    "ran then would never be averaged. Use materialize_grads=None (the default, which gives them zeros "
    "here) or True."
)
_REFUSED_PYTHON_REDUCER = (
    "materialize_grads=False with DDP's Python reducer (torch._dynamo.config.optimize_ddp='python_reducer', "
    "as compiled autograd needs). It all-reduces only the parameters whose gradient is defined, so ranks "
    "that ran different branches would pair different parameters. Use materialize_grads=None (the default) "
    "or True."
)

# context -> (auto, zeros, none); a string is the refusal's message
TABLE: Dict[str, Tuple[Any, Any, Any]] = {
    LOCAL: (Tying.SKIP, Tying.ZEROS, Tying.NONE),
    DDP_FIND_UNUSED: (Tying.SKIP, Tying.ZEROS, Tying.NONE),
    DDP: (Tying.AT_WRAPPER, Tying.ZEROS, Tying.NONE),
    DDP_STATIC: (Tying.AT_WRAPPER_ZEROS, Tying.ZEROS, _REFUSED_STATIC),
    PYTHON_REDUCER: (Tying.ALIASES, Tying.ALIASES, _REFUSED_PYTHON_REDUCER),
    FSDP2: (Tying.ZEROS, Tying.ZEROS, Tying.NONE),
    EXPLICIT: (Tying.ZEROS, Tying.ZEROS, Tying.NONE),
}
REDUCED = frozenset((DDP, DDP_STATIC, PYTHON_REDUCER, FSDP2, EXPLICIT))
"""Contexts whose reducer reduces the usage of "auto" units and resets what no rank used."""




def context_of(wrapper: nn.Module, explicit_kind: bool) -> str:
    """The context of a wrapper with a reducer, read from its settings (once per reducer)."""
    if explicit_kind:
        return EXPLICIT
    if isinstance(wrapper, nn.parallel.DistributedDataParallel):
        if _compat.ddp_uses_python_reducer(wrapper):
            return PYTHON_REDUCER
        if getattr(wrapper, "static_graph", False):
            return DDP_STATIC
        if getattr(wrapper, "find_unused_parameters", False):
            return DDP_FIND_UNUSED
        return DDP
    return FSDP2
