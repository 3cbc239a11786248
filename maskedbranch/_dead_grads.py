"""What the parameters of a branch that did not run receive in the backward.

In a distributed job every routing module ties them into the graph, so that each parameter gets
a gradient on every rank in every step (DDP with ``find_unused_parameters=False`` then works).
The gradient is:

* nothing at all in one process (no tie): ``.grad`` stays as it was and no hook fires, exactly as
  with if/else, and the call costs nothing extra;
* undefined under DDP without ``static_graph``: DDP's hooks fire and it fills zeros into its
  buckets itself; with ``find_unused_parameters=True`` it leaves the ``.grad`` of a parameter
  that no rank used untouched, as for if/else;
* zeros everywhere else in a distributed job (DDP with ``static_graph=True``, FSDP2, DDP's Python
  reducer, hand-written all-reduces): these need a defined gradient on every rank.

Zeros under DDP would step parameters that no rank used (momentum, weight decay), where if/else
with ``find_unused_parameters=True`` leaves them ``None``; :mod:`maskedbranch.unused_grads` sets
them back to ``None`` before each optimizer step, by default. ``materialize_grads=True`` /
``False`` on a module overrides all of this (ties with zeros / undefined gradients, anywhere),
except where undefined gradients would train wrong: ``static_graph`` and the Python reducer
refuse ``False`` in the forward, FSDP2 at the first optimizer step (unused_grads.py).

DDP's Python reducer (``torch._dynamo.config.optimize_ddp = "python_reducer"``, which compiled
autograd requires) all-reduces each parameter as soon as its gradient is accumulated, so every
rank must accumulate them in the same order whatever its branches did: :func:`canonical_order`
tells the routing path to run the branches on aliases of their parameters made by one node
(maskedbranch/_route.py), where all the gradients leave the graph at once, in branch order.

:func:`as_if_under_ddp` makes one process tie as DDP does, for ``maskedbranch.doctor``, whose
simulated ranks must see the graph that a DDP job would see.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist

from . import _compat


_as_if_ddp = [False]


@contextlib.contextmanager
def as_if_under_ddp() -> Iterator[None]:
    """Inside, the default policy ties as under DDP without static_graph (undefined gradients)
    even in one process."""
    before, _as_if_ddp[0] = _as_if_ddp[0], True
    try:
        yield
    finally:
        _as_if_ddp[0] = before


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def tie_policy(explicit: Optional[bool], where: str) -> Optional[bool]:
    """None: do not tie the dead parameters; True: tie them with zero gradients; False: tie them
    with undefined gradients."""
    if explicit is not None:
        if not explicit and distributed():
            ddp = _compat.active_ddp()
            if ddp is not None and getattr(ddp, "static_graph", False):
                raise RuntimeError(
                    f"{where}: materialize_grads=False under DistributedDataParallel(static_graph=True). "
                    "static_graph treats a parameter whose gradient is undefined in the first step as "
                    "unused forever, so branches that no rank ran then would never be averaged. Use "
                    "materialize_grads=None (the default, which gives them zeros here) or True."
                )
            if ddp is None and _compat.ddp_python_reducer():
                raise RuntimeError(
                    f"{where}: materialize_grads=False with DDP's Python reducer (torch._dynamo.config."
                    "optimize_ddp='python_reducer', as compiled autograd needs). It all-reduces only the "
                    "parameters whose gradient is defined, so ranks that ran different branches would "
                    "pair different parameters. Use materialize_grads=None (the default) or True."
                )
        return explicit
    if not distributed():
        return False if _as_if_ddp[0] else None
    ddp = _compat.active_ddp()
    return ddp is None or bool(getattr(ddp, "static_graph", False))


def canonical_order() -> bool:
    """True when zero-gradient ties must go to the branches' input (see the module's docstring):
    a distributed job outside a C++-reducer DDP forward, with the Python reducer configured."""
    return distributed() and _compat.active_ddp() is None and _compat.ddp_python_reducer()
