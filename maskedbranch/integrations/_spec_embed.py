"""Parameters that a supported transformers model leaves out of some steps outside LayerDrop:
the SpecAugment embedding (``masked_spec_embed``) of the speech models, read only when the
forward masks time steps (``config.apply_spec_augment`` and ``mask_time_prob > 0`` in training,
or ``mask_time_indices`` given). With ``apply_spec_augment=False`` it is unused in every step,
and DDP with ``find_unused_parameters=False`` fails at the second one.

The patch ties it into the owner's output whenever the forward did not read it, under the same
policy as a dropped layer (undefined gradients under DDP, zeros under FSDP2, nothing in one
process), as a routing unit of its own: when no rank read it, its gradient is reset to ``None``
before the step (maskedbranch/_reducer.py), as HF's model under ``find_unused_parameters=True``
leaves it.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Sequence

import torch
from torch import Tensor, nn

from .. import _unit
from .._route import tie_unrun

NAME = "masked_spec_embed"
_HOOKED = "_maskedbranch_spec_embed_hooks"
_units: "weakref.WeakKeyDictionary[nn.Module, ParameterUnit]" = weakref.WeakKeyDictionary()


class ParameterUnit:
    """One parameter of a module as the owner of a routing unit (maskedbranch/_unit.py) with one
    group of bare parameters: it."""

    __slots__ = ("module", "name", "_unit", "used", "__weakref__")

    def __init__(self, module: nn.Module, name: str, materialize_grads: Any = None):
        self.module = weakref.ref(module)
        self.name = name
        self._unit = _unit.RoutingUnit(self, f"{type(module).__name__}.{name}", materialize_grads)
        self.used = True

    def _check_skippable(self) -> None:
        pass  # a parameter runs no collective

    def _parameter(self) -> Any:
        m = self.module()
        return None if m is None else getattr(m, self.name, None)

    def _unit_modules(self) -> List[nn.Module]:
        return []  # the owner's other parameters are not this unit's

    def _unit_groups(self) -> List[Sequence[Tensor]]:
        p = self._parameter()
        return [(p,) if isinstance(p, nn.Parameter) else ()]


def _reads_it(owner: nn.Module, kwargs: dict) -> bool:
    """What HF's ``_mask_hidden_states`` does: the embedding is read when it masks time steps."""
    config = getattr(owner, "config", None)
    if not getattr(config, "apply_spec_augment", True):
        return False
    if kwargs.get("mask_time_indices") is not None:
        return True
    return bool(getattr(config, "mask_time_prob", 0) > 0 and owner.training)


def _unit_of(owner: nn.Module) -> "ParameterUnit":
    unit = _units.get(owner)
    if unit is None:  # a copy (deepcopy, pickle) keeps the hooks: it gets a unit of its own
        unit = _units[owner] = ParameterUnit(owner, NAME, getattr(owner, _HOOKED, None))
    return unit


def _before(owner: nn.Module, args: tuple, kwargs: dict) -> None:
    _unit_of(owner).used = _reads_it(owner, kwargs)


def _first_tensor_of(output: Any):
    if isinstance(output, Tensor):
        return output, lambda t: t
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return output[0], lambda t: (t, *output[1:])
    first = output[0] if hasattr(output, "to_tuple") and len(output) else None
    if isinstance(first, Tensor):
        key = next(iter(output.keys()))

        def put(t):
            output[key] = t
            return output

        return first, put
    return None, None


def _after(owner: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    unit = _unit_of(owner)
    p = unit._parameter()
    if p is None or not torch.is_grad_enabled() or not p.requires_grad:
        return None
    tying = unit._unit.tying_here()  # under a wrapper, the unit joins its layout
    unit._unit.record(int(unit.used))
    if unit.used:
        return None
    first, put = _first_tensor_of(output)
    if tying.call_ties is None or first is None:  # not tied here (Tying.SKIP), or by the wrapper (Tying.AT_WRAPPER)
        return None
    return put(tie_unrun(first, tying, [p]))


def patch_module(owner: nn.Module, materialize_grads: Any) -> bool:
    """Hook an owner of ``masked_spec_embed`` (once); False when it has none."""
    if not isinstance(getattr(owner, NAME, None), nn.Parameter):
        return False
    if not hasattr(owner, _HOOKED):
        owner.register_forward_pre_hook(_before, with_kwargs=True)
        owner.register_forward_hook(_after, with_kwargs=True)
    owner.__dict__[_HOOKED] = materialize_grads  # (hooked; the setting copies keep)
    unit = _unit_of(owner)._unit
    unit.materialize = materialize_grads
    unit.forget()
    return True
