"""Stochastic depth that skips the dropped rows' compute, for timm models.

timm's ``DropPath`` multiplies a residual branch's output by a per-sample 0/1 mask: every sample
pays for the branch, dropped or not. :func:`patch` converts a model's residual blocks so that
each branch runs on the kept samples only (through :func:`maskedbranch.drop_add_residual`)::

    import timm
    from maskedbranch.integrations import timm as mb_timm

    model = timm.create_model("vit_base_patch16_224", drop_path_rate=0.1)
    report = mb_timm.patch(model)  # before DDP / FSDP / torch.compile
    print(report)                  # which blocks were converted

Supported blocks (their forwards are reimplemented here; the tests compare them with timm's):

* ``timm.models.vision_transformer.Block`` and ``ResPostBlock`` (ViT, DeiT and the other models
  built on them), including ``attn_mask`` (a per-sample mask ``[B, ...]`` is routed with the rows);
* ``timm.models.convnext.ConvNeXtBlock`` (ConvNeXt, ConvNeXt-V2);
* ``timm.models.swin_transformer.SwinTransformerBlock`` and
  ``timm.models.swin_transformer_v2.SwinTransformerV2Block`` (the window shift, padding and
  partition are per sample, so they run unchanged on the kept samples).

What changes and what does not:

* A converted block is the same object with a subclass of its class (``isinstance`` still holds,
  the ``state_dict`` keys and the parameters are untouched); :func:`unpatch` restores the class.
* Eval mode, or a drop probability of 0: the same operations as timm, the same output.
* Training: the mask is drawn as timm draws it (per sample, Bernoulli(1 - drop_prob) from
  torch's default CPU generator, scaled by ``1 / keep_prob`` when ``scale_by_keep``) and in the
  same order, so with the same seed the output and the gradients equal timm's, up to rounding.
  Two exceptions: on a GPU timm draws from the CUDA generator (maskedbranch always from the CPU
  one: no device synchronization), and a branch that itself draws random numbers (``attn_drop``,
  ``proj_drop`` > 0) interleaves its draws with the mask's differently (timm draws the mask
  after running the branch, maskedbranch before). The branch runs on
  the kept samples only; a branch no sample keeps does not run, and its parameters still get a
  gradient, so DDP works with ``find_unused_parameters=False``: undefined (DDP fills zeros) or,
  with ``patch(model, materialize_grads=True)``, zero tensors (what FSDP2 needs).
* The drop probability is read from the block's ``drop_path*`` module on every call, so schedules
  that change ``drop_prob`` keep working; a ``maskedbranch.DropPath`` in its place is honoured
  too (its ``mode`` and ``generator``).
* Branches must treat samples independently for the result to equal timm's; BatchNorm inside a
  branch (not used by the supported blocks) would see the kept samples only.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

try:
    import timm  # noqa: F401
    from timm.layers import DropPath as _TimmDropPath
    from timm.models import convnext as _convnext
    from timm.models import swin_transformer as _swin
    from timm.models import swin_transformer_v2 as _swin_v2
    from timm.models import vision_transformer as _vit
except ImportError as e:  # pragma: no cover - exercised only without timm
    raise ImportError(
        "maskedbranch.integrations.timm needs timm; install it with `pip install \"maskedbranch[timm]\"` "
        f"(importing timm failed: {e})"
    ) from e

from ..drop_path import DropPath as _MaskedDropPath
from ..drop_path import drop_add_residual

__all__ = ["PatchReport", "SUPPORTED_BLOCKS", "patch", "unpatch", "is_patched"]


# ----------------------------------------------------------------------------------------------
# How a block's drop_path module is read.


def _drop_settings(dp: nn.Module) -> Tuple[float, bool, str, bool, Optional[torch.Generator]]:
    """(drop_prob, training, mode, scale_by_keep, generator) of a drop_path slot."""
    if isinstance(dp, nn.Identity):
        return 0.0, False, "row", True, None
    if isinstance(dp, _MaskedDropPath):
        return dp.drop_prob, dp.training, dp.mode, dp.scale_by_keep, dp.generator
    # timm's DropPath (checked at patch time): per-sample, the default generator
    return float(dp.drop_prob), dp.training, "row", bool(getattr(dp, "scale_by_keep", True)), None


def _known_drop_path(dp: Any) -> bool:
    return isinstance(dp, (nn.Identity, _MaskedDropPath)) or type(dp) is _TimmDropPath


def _params(*modules: Optional[nn.Module]) -> Iterator[Tensor]:
    """The parameters tied into the graph when a branch does not run. A lazy iterator: it is
    only walked in that case."""
    for m in modules:
        if isinstance(m, nn.Module):
            yield from m.parameters()


_MATERIALIZE = "_maskedbranch_materialize_grads"  # per converted block, set by patch()


def _residual(block: nn.Module, dp: nn.Module, x: Tensor, branch: Callable[..., Tensor], params, args=()) -> Tensor:
    """``x + dp(branch(x, *args))``, with the branch run on the kept rows only."""
    p, training, mode, scale_by_keep, generator = _drop_settings(dp)
    if p == 0.0 or not training:
        return x + branch(x, *args)
    return drop_add_residual(
        x, branch, p, training, mode=mode, scale_by_keep=scale_by_keep, generator=generator,
        args=args, params=params, materialize_grads=getattr(block, _MATERIALIZE, False),
    )


def _per_row(mask: Optional[Tensor], batch: int) -> bool:
    """An attention mask whose first dimension is the batch (``[B, heads or 1, N, N]``): it is
    routed with the rows. Any other mask broadcasts over the batch and passes through."""
    return isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[0] == batch and batch > 1


# ----------------------------------------------------------------------------------------------
# The converted forwards. Each mirrors timm's forward of the same block line by line.

_VIT_KWARGS = frozenset(inspect.signature(_vit.Block.forward).parameters) - {"self", "x"}


def _attn_kwargs(attn_mask, is_causal) -> Dict[str, Any]:
    kw: Dict[str, Any] = {}
    if "attn_mask" in _VIT_KWARGS:
        kw["attn_mask"] = attn_mask
    if "is_causal" in _VIT_KWARGS:
        kw["is_causal"] = is_causal
    return kw


def _attn_branch(self, attn_mask: Optional[Tensor], is_causal: bool, post_norm: bool) -> Callable[..., Tensor]:
    def branch(h: Tensor, *routed: Tensor) -> Tensor:
        # routed: the kept rows' slice of a per-sample attention mask
        kw = _attn_kwargs(routed[0] if routed else attn_mask, is_causal)
        if post_norm:
            return self.norm1(self.attn(h, **kw))
        return self.ls1(self.attn(self.norm1(h), **kw))

    return branch


def _vit_block_forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
    branch = _attn_branch(self, attn_mask, is_causal, post_norm=False)
    args = (attn_mask,) if _per_row(attn_mask, x.shape[0]) else ()
    x = _residual(self, self.drop_path1, x, branch, _params(self.norm1, self.attn, self.ls1), args)
    x = _residual(
        self, self.drop_path2, x, lambda h: self.ls2(self.mlp(self.norm2(h))), _params(self.norm2, self.mlp, self.ls2)
    )
    return x


def _vit_res_post_block_forward(
    self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False
) -> Tensor:
    branch = _attn_branch(self, attn_mask, is_causal, post_norm=True)
    args = (attn_mask,) if _per_row(attn_mask, x.shape[0]) else ()
    x = _residual(self, self.drop_path1, x, branch, _params(self.attn, self.norm1), args)
    x = _residual(self, self.drop_path2, x, lambda h: self.norm2(self.mlp(h)), _params(self.mlp, self.norm2))
    return x


def _convnext_block_forward(self, x: Tensor) -> Tensor:
    def branch(h: Tensor) -> Tensor:
        h = self.conv_dw(h)
        if self.use_conv_mlp:
            h = self.norm(h)
            h = self.mlp(h)
        else:
            h = h.permute(0, 2, 3, 1)
            h = self.norm(h)
            h = self.mlp(h)
            h = h.permute(0, 3, 1, 2)
        if self.gamma is not None:
            h = h.mul(self.gamma.reshape(1, -1, 1, 1))
        return h

    def params() -> Iterator[Tensor]:
        for name, p in self.named_parameters():
            if not name.startswith("shortcut."):
                yield p

    if isinstance(self.shortcut, nn.Identity):
        return _residual(self, self.drop_path, x, branch, params())
    # A projecting shortcut: base = shortcut(x), and the branch reads x (routed as an argument).
    return _residual(self, self.drop_path, self.shortcut(x), lambda _base, h: branch(h), params(), (x,))


def _swin_block_forward(self, x: Tensor) -> Tensor:
    B, H, W, C = x.shape
    x = _residual(self, self.drop_path1, x, lambda h: self._attn(self.norm1(h)), _params(self.norm1, self.attn))
    x = x.reshape(B, -1, C)
    x = _residual(self, self.drop_path2, x, lambda h: self.mlp(self.norm2(h)), _params(self.norm2, self.mlp))
    x = x.reshape(B, H, W, C)
    return x


def _swin_v2_block_forward(self, x: Tensor) -> Tensor:
    B, H, W, C = x.shape
    x = _residual(self, self.drop_path1, x, lambda h: self.norm1(self._attn(h)), _params(self.attn, self.norm1))
    x = x.reshape(B, -1, C)
    x = _residual(self, self.drop_path2, x, lambda h: self.norm2(self.mlp(h)), _params(self.mlp, self.norm2))
    x = x.reshape(B, H, W, C)
    return x


# ----------------------------------------------------------------------------------------------
# The converted classes: subclasses of timm's, defined here so that pickling a patched model
# (torch.save(model)) refers to importable classes.


class ViTBlock(_vit.Block):
    """timm ``vision_transformer.Block`` whose drop-path branches run on the kept rows only."""

    forward = _vit_block_forward


class ViTResPostBlock(_vit.ResPostBlock):
    """timm ``vision_transformer.ResPostBlock`` whose drop-path branches run on the kept rows only."""

    forward = _vit_res_post_block_forward


class ConvNeXtBlock(_convnext.ConvNeXtBlock):
    """timm ``convnext.ConvNeXtBlock`` whose drop-path branch runs on the kept rows only."""

    forward = _convnext_block_forward


class SwinTransformerBlock(_swin.SwinTransformerBlock):
    """timm ``swin_transformer.SwinTransformerBlock`` whose drop-path branches run on the kept rows only."""

    forward = _swin_block_forward


class SwinTransformerV2Block(_swin_v2.SwinTransformerV2Block):
    """timm ``swin_transformer_v2.SwinTransformerV2Block`` whose drop-path branches run on the kept rows only."""

    forward = _swin_v2_block_forward


#: timm block class -> (converted class, names of its drop-path slots, attributes the forward reads)
_CONVERSIONS: Dict[type, Tuple[type, Tuple[str, ...], Tuple[str, ...]]] = {
    _vit.Block: (ViTBlock, ("drop_path1", "drop_path2"), ("norm1", "attn", "ls1", "norm2", "mlp", "ls2")),
    _vit.ResPostBlock: (ViTResPostBlock, ("drop_path1", "drop_path2"), ("attn", "norm1", "mlp", "norm2")),
    _convnext.ConvNeXtBlock: (
        ConvNeXtBlock, ("drop_path",), ("conv_dw", "use_conv_mlp", "norm", "mlp", "gamma", "shortcut")
    ),
    _swin.SwinTransformerBlock: (SwinTransformerBlock, ("drop_path1", "drop_path2"), ("norm1", "_attn", "norm2", "mlp")),
    _swin_v2.SwinTransformerV2Block: (
        SwinTransformerV2Block, ("drop_path1", "drop_path2"), ("norm1", "_attn", "norm2", "mlp")
    ),
}
_ORIGINAL = {converted: original for original, (converted, _, _) in _CONVERSIONS.items()}

#: Qualified names of the timm blocks :func:`patch` converts.
SUPPORTED_BLOCKS: Tuple[str, ...] = tuple(f"{c.__module__}.{c.__qualname__}" for c in _CONVERSIONS)


# ----------------------------------------------------------------------------------------------
# The patch.


@dataclass
class PatchReport:
    """What :func:`patch` did. ``converted``: module name -> timm class name of each converted
    block (``already`` lists blocks converted by an earlier call); ``skipped``: module name ->
    why it was left as is (only with ``strict=False``)."""

    converted: Dict[str, str] = field(default_factory=dict)
    already: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.converted)

    def __str__(self) -> str:
        counts: Dict[str, int] = {}
        for cls in self.converted.values():
            counts[cls] = counts.get(cls, 0) + 1
        lines = [f"maskedbranch: converted {len(self.converted)} timm block(s)"]
        lines += [f"  {n} x {cls}" for cls, n in counts.items()]
        if self.already:
            lines.append(f"  {len(self.already)} block(s) were converted already")
        for name, why in self.skipped.items():
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)


def _display(name: str) -> str:
    return name or "<root>"


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _unknown_drop_paths(model: nn.Module, supported: List[str]) -> Dict[str, str]:
    """Drop-path modules outside the supported blocks, grouped by the module that applies them
    (the nearest ancestor that is not a container): name -> why it is not converted."""
    found: Dict[str, List[str]] = {}
    modules = dict(model.named_modules())
    inside = tuple(n + "." for n in supported if n)
    for name, module in modules.items():
        if not isinstance(module, (_TimmDropPath, _MaskedDropPath)):
            continue
        if "" in supported or name.startswith(inside):
            continue  # a supported block's own slot
        parts = name.split(".")
        owner = ".".join(parts[:-1])
        for k in range(len(parts) - 1, -1, -1):
            candidate = ".".join(parts[:k])
            if not isinstance(modules[candidate], _CONTAINERS):
                owner = candidate
                break
        found.setdefault(owner, []).append(name[len(owner) + 1 :] if owner else name)
    out = {}
    for owner, drops in found.items():
        cls = type(modules[owner])
        out[_display(owner)] = (
            f"{cls.__module__}.{cls.__qualname__} applies drop path ({', '.join(drops)}) in a forward "
            "this patch does not know"
        )
    return out


def patch(model: nn.Module, *, strict: bool = True, materialize_grads: bool = False) -> PatchReport:
    """Convert the residual blocks of a timm ``model``, in place, so that drop path (stochastic
    depth) runs each residual branch on the kept samples only. Returns a :class:`PatchReport`
    of the converted blocks.

    Call it after building (and loading) the model and before wrapping it in DDP / FSDP or
    ``torch.compile``. The ``state_dict`` keys and the parameters are unchanged.

    ``strict=True`` (default) refuses, before changing anything, a model that holds a drop path
    in a block this patch does not know (the error lists them and :data:`SUPPORTED_BLOCKS`), a
    supported block whose class overrides ``forward`` or whose drop-path slot holds an unknown
    module, and a model with no supported block at all. ``strict=False`` converts what it can,
    leaves the rest as it was (correct, but paying the full compute of dropped samples) and lists
    it in ``report.skipped``.

    ``materialize_grads``: what the parameters of a branch that no sample keeps receive (see
    :func:`maskedbranch.drop_add_residual`): undefined gradients (default; DDP fills zeros) or
    zero tensors (``True``: for FSDP2, which reduces only defined gradients, and DDP with
    ``static_graph=True``). Calling ``patch`` again sets it on the blocks converted before too.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    todo: List[Tuple[str, nn.Module, type]] = []
    supported: List[str] = []  # supported blocks, converted now or before
    report = PatchReport()
    for name, module in model.named_modules():
        cls = type(module)
        if cls in _ORIGINAL:
            report.already.append(_display(name))
            supported.append(name)
            continue
        known = next((base for base in _CONVERSIONS if isinstance(module, base)), None)
        if known is None:
            continue
        supported.append(name)
        _, slots, attrs = _CONVERSIONS[known]
        why = None
        if cls is not known and cls.forward is not known.forward:
            why = f"{cls.__module__}.{cls.__qualname__} subclasses {known.__qualname__} and overrides forward"
        else:
            missing = [a for a in slots + attrs if not hasattr(module, a)]
            bad = [s for s in slots if hasattr(module, s) and not _known_drop_path(getattr(module, s))]
            if missing:
                why = f"{known.__qualname__} without {', '.join(missing)} (an unsupported timm version?)"
            elif bad:
                kinds = ", ".join(f"{s}={type(getattr(module, s)).__name__}" for s in bad)
                why = f"{known.__qualname__} with an unknown drop-path module ({kinds})"
        if why is None:
            todo.append((name, module, known))
        else:
            report.skipped[_display(name)] = why
    report.skipped.update(_unknown_drop_paths(model, supported))
    if strict and report.skipped:
        listing = "\n".join(f"  {n}: {w}" for n, w in report.skipped.items())
        raise ValueError(
            "maskedbranch.integrations.timm.patch: these modules use drop path in a way this patch does "
            f"not know:\n{listing}\nSupported blocks: {', '.join(SUPPORTED_BLOCKS)}.\n"
            "Pass strict=False to convert the supported blocks and leave these as they are."
        )
    if strict and not todo and not report.already:
        raise ValueError(
            f"maskedbranch.integrations.timm.patch: {type(model).__name__} holds none of the supported "
            f"blocks ({', '.join(SUPPORTED_BLOCKS)}); nothing to convert"
        )
    for name, module, known in todo:
        module.__class__ = _CONVERSIONS[known][0]
        report.converted[_display(name)] = known.__qualname__
    for module in model.modules():
        if type(module) in _ORIGINAL:
            setattr(module, _MATERIALIZE, bool(materialize_grads))
    return report


def unpatch(model: nn.Module) -> int:
    """Undo :func:`patch`: give every converted block its timm class back. Returns how many."""
    n = 0
    for module in model.modules():
        original = _ORIGINAL.get(type(module))
        if original is not None:
            module.__class__ = original
            module.__dict__.pop(_MATERIALIZE, None)
            n += 1
    return n


def is_patched(module: nn.Module) -> bool:
    """True for a block converted by :func:`patch`."""
    return type(module) in _ORIGINAL
