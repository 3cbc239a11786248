"""The decision table: a unit's tying (``_unit.Tying``) from its *context*, the wrapper whose forward
runs it, and its ``materialize_grads``; decided once per (unit, wrapper). The table and why each
row is what it is: docs/design.md, "The decision table" and "Dead parameters"."""
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
# contexts whose reducer reduces the usage of "auto" units and resets what no rank used
REDUCED = frozenset((DDP, DDP_STATIC, PYTHON_REDUCER, FSDP2, EXPLICIT))


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
