"""Activation checkpointing with drop masks drawn from user-provided generators.

``torch.utils.checkpoint.checkpoint`` reruns the forward during the backward. It saves and
restores torch's default CPU generator and the default generators of the devices it sees
(``preserve_rng_state=True``, the default), so a :class:`~maskedbranch.DropPath` or
:class:`~maskedbranch.ResidualDropPath` that draws from the default generator draws the same mask
again. A ``generator=`` of your own is not restored: the recomputation would draw a *different*
mask - a ``CheckpointError`` when the number of kept rows changes, silently wrong gradients when
it does not. :func:`replay_generators` closes that gap::

    from torch.utils.checkpoint import checkpoint
    from maskedbranch.integrations.checkpoint import replay_generators

    y = checkpoint(block, x, use_reentrant=False, context_fn=replay_generators(block))

The routing plan of a :class:`~maskedbranch.MaskedBranch` needs nothing: it is a function of
the gate, which checkpoint passes again unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Tuple, Union

import torch
from torch import nn

__all__ = ["replay_generators"]


def _collect(objs) -> List[torch.Generator]:
    gens: List[torch.Generator] = []
    seen = set()

    def add(g: torch.Generator) -> None:
        if id(g) not in seen:
            seen.add(id(g))
            gens.append(g)

    for i, obj in enumerate(objs):
        if isinstance(obj, torch.Generator):
            add(obj)
        elif isinstance(obj, nn.Module):
            for m in obj.modules():
                g = getattr(m, "generator", None)
                if isinstance(g, torch.Generator):
                    add(g)
        else:
            raise TypeError(
                f"replay_generators: argument {i} is a {type(obj).__name__}; expected torch.Generator "
                "objects or modules (whose submodules' `generator` attributes are collected)"
            )
    return gens


@contextlib.contextmanager
def _replaying(gens: List[torch.Generator], states: List[torch.Tensor]) -> Iterator[None]:
    current = [g.get_state() for g in gens]
    for g, s in zip(gens, states):
        g.set_state(s)
    try:
        yield
    finally:  # the generators go on from where the training loop left them
        for g, s in zip(gens, current):
            g.set_state(s)


def replay_generators(
    *objs: Union[torch.Generator, nn.Module],
) -> Callable[[], Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` that
    makes the recomputation draw what the forward drew from the given generators.

    ``objs``: ``torch.Generator`` objects, or modules whose submodules' ``generator``
    attributes are collected (``DropPath``, ``ResidualDropPath``, timm blocks converted by
    :func:`maskedbranch.integrations.timm.patch` holding a ``maskedbranch.DropPath``). The
    generators' states are recorded when the checkpointed forward starts, set back for the
    recomputation, and restored afterwards, so the training loop's own stream is unaffected.
    The modules are searched when ``replay_generators`` is called; call it again after adding
    generators.
    """
    gens = _collect(objs)

    def context_fn():
        states = [g.get_state() for g in gens]
        return contextlib.nullcontext(), _replaying(gens, states)

    return context_fn
