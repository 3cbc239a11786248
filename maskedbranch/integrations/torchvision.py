"""Stochastic depth that skips the dropped samples' compute, for torchvision models.

torchvision's ``StochasticDepth`` multiplies a residual branch's output by a per-sample 0/1 mask
(``mode="row"``): every sample pays for the branch, dropped or not. :func:`patch` converts a
model's residual blocks so that each branch runs on the kept samples only (through
:func:`maskedbranch.drop_add_residual`)::

    import torchvision
    from maskedbranch.integrations import torchvision as mb_tv

    model = torchvision.models.convnext_tiny(stochastic_depth_prob=0.4)
    print(mb_tv.patch(model))   # before DDP / FSDP / torch.compile

Converted blocks (:data:`SUPPORTED`): ConvNeXt's ``CNBlock``, Swin's ``SwinTransformerBlock`` and
``SwinTransformerBlockV2`` (Swin3D's blocks too), EfficientNet's ``MBConv`` and ``FusedMBConv``
(EfficientNet and EfficientNet V2), MaxViT's ``MBConv`` and ``PartitionAttentionLayer``, and
MViT's ``MultiscaleBlock``: every torchvision block that owns a ``StochasticDepth``.

How it works, and why this way. A converted block keeps its object, parameters and torchvision's
``forward``; its class becomes a subclass that overrides only ``__call__``. In training with a
nonzero drop probability the call runs a forward written for that block class here, torchvision's
own with each residual ``base + stochastic_depth(branch(...))`` replaced by one
``drop_add_residual(base, branch, ...)``. A table of block classes rather than the timm
patch's torch.fx rewrite, although that rewrite converts these blocks too once each
``StochasticDepth`` is swapped for :class:`maskedbranch.StochasticDepth`: it would make timm a
requirement (its package imports timm) and replace the model's ``StochasticDepth`` modules, and
it traces each block per input signature; torchvision has eight such classes, stable across
releases, and a forward per class keeps the model's modules as they are and reads as
torchvision's code. A subclass that overrides ``forward`` is refused, so the table
never replaces a forward it does not know.

What changes and what does not:

* The ``state_dict`` keys, parameters and submodules are untouched (torchvision's checkpoints load
  before or after patching); ``isinstance`` holds. :func:`unpatch` restores the classes.
* Eval mode, ``p == 0``, symbolic tracing (``torch.fx``, torchvision's feature extraction),
  ``torch.jit.script`` / ``torch.jit.trace`` and ``torch.export``: torchvision's own forward runs,
  so results, graphs and scripted code are torchvision's.
* Training: each mask is drawn as torchvision draws it (Bernoulli(1 - p) per sample, or once for
  the batch in ``mode="batch"``, scaled by ``1 / (1 - p)`` rounded to the input's dtype), from
  torch's default CPU generator in the same order, so with the same seed on the CPU outputs and
  gradients equal torchvision's up to rounding. On a GPU torchvision draws from the CUDA
  generator (maskedbranch from the CPU one: no synchronization), and a branch that draws random
  numbers itself (dropout > 0 inside a block) interleaves its draws differently.
* A branch no sample keeps does not run; its parameters get zero gradients, as torchvision's
  formula gives them, so DDP runs with ``find_unused_parameters=False``
  (``materialize_grads=False``: undefined gradients instead, which DDP fills with zeros).
* ``p``, ``mode`` and ``training`` are read from the block's ``StochasticDepth`` on every call
  (schedules work); a :class:`maskedbranch.StochasticDepth` / :class:`maskedbranch.DropPath` put
  in its place is honoured with its ``scale_by_keep`` and ``generator``.
* A BatchNorm in a branch that uses batch statistics (EfficientNet's and MaxViT's ``MBConv`` in
  training) would see only the kept samples. By default (``batch_norm="dense"``) such a block runs
  torchvision's forward on every sample while its BatchNorm trains, and is routed once it is
  frozen (eval mode or ``torchvision.ops.FrozenBatchNorm2d``); ``batch_norm="kept"`` routes it
  anyway (the statistics then come from the kept samples: a different computation).
* A routed ConvNeXt block returns torchvision's memory layout (channels last), so the next
  block's convolution runs as in torchvision.
* EfficientNet's blocks without a shortcut (a stride or a change of width) never apply their
  ``StochasticDepth`` in torchvision: they are left as they are.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import fx, nn

try:
    from torchvision.ops import StochasticDepth as _TvStochasticDepth
except ImportError as e:  # pragma: no cover - exercised only without torchvision
    raise ImportError(
        "maskedbranch.integrations.torchvision needs torchvision; install it with `pip install torchvision` "
        f"(importing it failed: {e})"
    ) from e

from .. import _structure, _unit
from ..drop_path import DropPath as _MaskedDropPath
from ._report import BlockPatchReport, display
from ._torchvision_blocks import _BATCH_NORMS, _LISTED, _RULES, _STATE, SUPPORTED, _base_of, _drop_settings, _is_tv_drop, \
    _uses_batch_stats

__all__ = ["PatchReport", "SUPPORTED", "patch", "unpatch", "is_patched"]


# ----------------------------------------------------------------------------------------------
# Converted blocks.


class _State:
    """Per converted block: its class in :data:`_RULES`, the options of :func:`patch` and the
    paths of the BatchNorms in its branches."""

    def __init__(self, base: type, materialize: bool, batch_norm: str, bn_paths: Sequence[str]):
        self.base = base
        self.materialize = materialize
        self.batch_norm = batch_norm
        self.bn_paths = tuple(bn_paths)


def _symbolic(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    return any(isinstance(a, fx.Proxy) for a in args) or any(isinstance(a, fx.Proxy) for a in kwargs.values())


def _exporting() -> bool:
    check = getattr(torch.compiler, "is_exporting", None)
    return bool(check is not None and check())


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _routes(block: nn.Module, state: _State) -> bool:
    """Whether this call drops anything and may run the branches on the kept rows only."""
    settings = _drop_settings(getattr(block, _RULES[state.base].slot))
    if settings is None or not settings[1] or settings[0] == 0:
        return False
    if state.batch_norm == "dense" and any(_uses_batch_stats(block.get_submodule(p)) for p in state.bn_paths):
        return False  # BatchNorm needs every sample: torchvision's computation
    return True


class _Patched:
    """Placed before torchvision's class in a converted block's bases."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get(_STATE)
        if (
            state is None
            or not _routes(self, state)
            or _symbolic(args, kwargs)
            or torch.jit.is_tracing()
            or _exporting()
        ):
            return super().__call__(*args, **kwargs)
        routed = _RULES[state.base].forward
        if torch.compiler.is_compiling() and not _has_hooks(self):
            return routed(self, *args, **kwargs)  # no per-call attribute for the graph to guard on
        # The routed forward for this call only: nn.Module.__call__ still runs the hooks, and
        # everything else (TorchScript, fx, state_dict) keeps seeing torchvision's forward.
        d = self.__dict__
        d["forward"] = functools.partial(routed, self)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            d.pop("forward", None)

    def __reduce_ex__(self, protocol: int):
        return _restore, (_original(type(self)),), self.__getstate__()


_CLASSES: Dict[type, type] = {}


def _patched_class(original: type) -> type:
    cls = _CLASSES.get(original)
    if cls is None:
        # Its own module, so that type(block) says it is converted; torchvision's name (reprs).
        cls = _CLASSES[original] = type(original.__name__, (_Patched, original), {
            "__module__": __name__, "__qualname__": original.__qualname__, "_maskedbranch_original": original,
        })
    return cls


def _original(cls: type) -> type:
    return cls._maskedbranch_original


def _restore(original: type) -> nn.Module:
    cls = _patched_class(original)
    return cls.__new__(cls)


# ----------------------------------------------------------------------------------------------
# patch / unpatch.


class PatchReport(BlockPatchReport):
    """What :func:`patch` did (the fields: :class:`~maskedbranch.integrations._report.BlockPatchReport`;
    ``notes``: a BatchNorm in a branch)."""

    library = "torchvision"



def _examine(name: str, block: nn.Module, slot: str) -> Tuple[Optional[type], str]:
    """The class of :data:`_RULES` converting ``block`` for its drop module at ``slot``, or why
    none can."""
    base, why = _base_of(type(block))
    if base is None:
        if why:
            return None, why
        return None, (f"{type(block).__qualname__} is not a torchvision block this patch knows (its {slot} is "
                      "applied by code the patch cannot see)")
    rule = _RULES[base]
    if slot != rule.slot:
        return None, f"{slot} is not the drop module torchvision's {type(block).__qualname__} applies ({rule.slot})"
    try:
        _structure.check_skippable([block.get_submodule(m) for m in rule.branches], f"{display(name)}: the branch")
    except ValueError as e:
        return None, str(e)
    return base, ""


def _refusal(model: nn.Module) -> str:
    cls = type(model)
    if cls.__module__.startswith("timm."):
        hint = "a timm model: use maskedbranch.integrations.timm.patch"
    elif cls.__module__.startswith("torchvision."):
        hint = "this torchvision model has no stochastic depth"
    else:
        hint = ("for your own residual blocks, use maskedbranch.ResidualDropPath / maskedbranch.drop_add_residual; "
                "for a timm model, maskedbranch.integrations.timm.patch")
    return (f"maskedbranch.integrations.torchvision.patch: {cls.__name__} has no torchvision StochasticDepth "
            f"residual to convert ({hint}; converted blocks: {_LISTED})")


def patch(model: nn.Module, *, strict: bool = True, materialize_grads: Any = True, batch_norm: str = "dense") -> PatchReport:
    """Convert the residual blocks of a torchvision ``model``, in place, so that stochastic depth
    runs each residual branch on the kept samples only. Returns a :class:`PatchReport`.

    Call it after building (and loading) the model and before wrapping it in DDP / FSDP or
    ``torch.compile``. The ``state_dict`` keys and the parameters are unchanged.

    ``strict=True`` (default) refuses, before changing anything, a model with a
    ``StochasticDepth`` this patch cannot convert (the error lists each with the reason) and a
    model without any. ``strict=False`` converts what it can, leaves the rest to torchvision
    (correct, paying the full compute of dropped samples) and lists it in ``report.skipped``.

    ``materialize_grads``: the parameters of a branch that no sample keeps get zero gradients
    (``"zeros"`` / ``True``, torchvision's values) or none from the routing (``"none"`` /
    ``False``). ``batch_norm``: ``"dense"`` (default) or ``"kept"``: how a block whose branch
    holds a BatchNorm that uses batch statistics runs (module docstring). Calling ``patch`` again
    updates both options on blocks converted before.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
    if batch_norm not in ("dense", "kept"):
        raise ValueError(f"batch_norm: expected 'dense' (torchvision's statistics) or 'kept', got {batch_norm!r}")
    materialize_grads = _unit.materialize(materialize_grads, allow_auto=False)
    modules = dict(model.named_modules(remove_duplicate=False))
    report = PatchReport()
    todo: Dict[str, Tuple[nn.Module, type]] = {}
    for name, m in modules.items():
        if not name or not isinstance(m, (_TvStochasticDepth, _MaskedDropPath)):
            continue
        owner_name, _, slot = name.rpartition(".")
        owner = modules[owner_name]
        if isinstance(m, _TvStochasticDepth) and not _is_tv_drop(m):
            report.skipped[display(name)] = f"{type(m).__qualname__} overrides StochasticDepth.forward"
            continue
        if issubclass(type(owner), _Patched):
            if display(owner_name) not in report.already:
                report.already.append(display(owner_name))
            continue
        base, why = _examine(owner_name, owner, slot)
        if base is None:
            if isinstance(m, _TvStochasticDepth):  # a maskedbranch DropPath elsewhere is not ours to convert
                report.skipped[display(name)] = why
        elif _RULES[base].applies(owner):
            todo[owner_name] = (owner, base)
    if strict and report.skipped:
        listing = "\n".join(f"  {n}: {w}" for n, w in report.skipped.items())
        raise ValueError(
            "maskedbranch.integrations.torchvision.patch: these StochasticDepth modules cannot be converted:\n"
            f"{listing}\nConverted: the residuals of torchvision's {_LISTED} "
            "(SUPPORTED). Pass strict=False to convert the others and leave these to torchvision; for blocks "
            "of your own, use maskedbranch.ResidualDropPath / maskedbranch.drop_add_residual."
        )
    if strict and not todo and not report.already:
        raise ValueError(_refusal(model))
    for name, (block, base) in todo.items():
        original = type(block)
        bn_paths = [
            f"{b}.{n}" if n else b
            for b in _RULES[base].branches for n, sub in block.get_submodule(b).named_modules() if isinstance(sub, _BATCH_NORMS)
        ]
        block.__class__ = _patched_class(original)
        block.__dict__[_STATE] = _State(base, materialize_grads, batch_norm, bn_paths)
        report.converted[display(name)] = original.__qualname__
        if bn_paths:
            report.notes[display(name)] = "BatchNorm in a branch: see patch(batch_norm=...)"
    for m in model.modules():
        state = m.__dict__.get(_STATE)
        if state is not None:
            state.materialize, state.batch_norm = materialize_grads, batch_norm
    return report


def unpatch(model: nn.Module) -> int:
    """Undo :func:`patch`: give every converted block its torchvision class back. Returns how many."""
    n = 0
    for module in model.modules():
        if issubclass(type(module), _Patched):
            module.__class__ = _original(type(module))
            module.__dict__.pop(_STATE, None)
            n += 1
    return n


def is_patched(module: nn.Module) -> bool:
    """True for a block converted by :func:`patch`, and for a model holding one."""
    return isinstance(module, nn.Module) and any(issubclass(type(m), _Patched) for m in module.modules())
