"""What the parameters of a branch that did not run receive in the backward.

In a distributed job every routing module ties them into the graph, so that each parameter gets
a gradient on every rank in every step (DDP with ``find_unused_parameters=False`` then works).
The gradient is:

* nothing at all in one process (no tie): ``.grad`` stays as it was and no hook fires, exactly as
  with if/else, and the call costs nothing extra;
* undefined under DDP without ``static_graph``: DDP's hooks fire and it fills zeros into its
  buckets itself; with ``find_unused_parameters=True`` it leaves the ``.grad`` of a parameter
  that no rank used untouched, as for if/else;
* zeros everywhere else in a distributed job (DDP with ``static_graph=True``, FSDP2, compiled
  autograd's DDP, hand-written all-reduces): these need a defined gradient on every rank.

Zeros under DDP would step parameters that no rank used (momentum, weight decay), where if/else
with ``find_unused_parameters=True`` leaves them ``None``; :mod:`maskedbranch.unused_grads` sets
them back to ``None`` before each optimizer step, by default. ``materialize_grads=True`` /
``False`` on a module overrides all of this (ties with zeros / undefined gradients, anywhere).

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
        return explicit
    if not distributed():
        return False if _as_if_ddp[0] else None
    ddp = _compat.active_ddp()
    return ddp is None or bool(getattr(ddp, "static_graph", False))


def process_group_of_active_ddp():
    """The process group of the DDP forward that is running, or None."""
    ddp = _compat.active_ddp()
    return None if ddp is None else getattr(ddp, "process_group", None)
