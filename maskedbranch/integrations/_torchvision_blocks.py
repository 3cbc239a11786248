"""torchvision's block classes for maskedbranch/integrations/torchvision.py: what sits in a
block's drop slot, and per class (:data:`_RULES`) its branches and its forward, torchvision's
own with each residual ``base + stochastic_depth(branch(...))`` written as one
``drop_add_residual(base, branch, ...)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torchvision.models import convnext as _convnext
from torchvision.models import efficientnet as _efficientnet
from torchvision.models import maxvit as _maxvit
from torchvision.models import swin_transformer as _swin
from torchvision.models.video import mvit as _mvit
from torchvision.ops import StochasticDepth as _TvStochasticDepth

from ..drop_path import DropPath as _MaskedDropPath
from ..residual import drop_add_residual

_STATE = "_maskedbranch_torchvision"  # a converted block's _State, in its __dict__
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


# ----------------------------------------------------------------------------------------------
# The drop module in a block's slot.


def _is_tv_drop(m: nn.Module) -> bool:
    return isinstance(m, _TvStochasticDepth) and type(m).forward is _TvStochasticDepth.forward


def _drop_settings(sd: nn.Module) -> Optional[Tuple[Any, bool, str, bool, Optional[torch.Generator]]]:
    """(p, training, mode, scale_by_keep, generator) of a block's slot; None for a module that
    is not a drop path (replaced after patching: the block runs torchvision's forward)."""
    if _is_tv_drop(sd):
        return sd.p, sd.training, sd.mode, True, None
    if isinstance(sd, _MaskedDropPath):
        return sd.drop_prob, sd.training, sd.mode, sd.scale_by_keep, sd.generator
    if isinstance(sd, nn.Identity):  # MaxViT's slot at p == 0
        return 0.0, False, "row", True, None
    return None


def _uses_batch_stats(m: nn.Module) -> bool:
    return isinstance(m, _BATCH_NORMS) and (m.training or m.running_mean is None)


# ----------------------------------------------------------------------------------------------
# The routed forwards: torchvision's, with each residual through drop_add_residual.


def _residual(block: nn.Module, base: Tensor, branch: Callable, modules: Sequence[str], args: Sequence[Tensor] = (),
              extra: Sequence[Tensor] = ()) -> Tensor:
    """``base + stochastic_depth(branch(base, *args))`` with the branch on the kept rows;
    ``modules`` (and ``extra``): where the branch's parameters are (tied when it does not run)."""
    state = block.__dict__[_STATE]
    p, training, mode, scale_by_keep, generator = _drop_settings(getattr(block, _RULES[state.base].slot))
    params = [q for name in modules for q in block.get_submodule(name).parameters()]
    params += list(extra)
    return drop_add_residual(base, branch, p, training, mode=mode, scale_by_keep=scale_by_keep, generator=generator,
                             args=args, params=params, materialize_grads=state.materialize)


def _cn_block(block: nn.Module, input: Tensor) -> Tensor:
    # result = layer_scale * block(input); result = stochastic_depth(result); result += input
    # torchvision's result is laid out as the branch's output, channels last (a permute of the
    # last Linear's output); the routed sum is laid out as its base. The same layout keeps the
    # next block's convolution and permutes on torchvision's (faster) path.
    if input.dim() == 4:
        input = input.contiguous(memory_format=torch.channels_last)
    return _residual(block, input, lambda h: block.layer_scale * block.block(h), ("block",), extra=(block.layer_scale,))


def _swin_block(block: nn.Module, x: Tensor) -> Tensor:
    # x = x + stochastic_depth(attn(norm1(x))); x = x + stochastic_depth(mlp(norm2(x)))
    x = _residual(block, x, lambda h: block.attn(block.norm1(h)), ("norm1", "attn"))
    return _residual(block, x, lambda h: block.mlp(block.norm2(h)), ("norm2", "mlp"))


def _swin_block_v2(block: nn.Module, x: Tensor) -> Tensor:
    # post-norm: x = x + stochastic_depth(norm1(attn(x))); x = x + stochastic_depth(norm2(mlp(x)))
    x = _residual(block, x, lambda h: block.norm1(block.attn(h)), ("norm1", "attn"))
    return _residual(block, x, lambda h: block.norm2(block.mlp(h)), ("norm2", "mlp"))


def _mb_conv(block: nn.Module, input: Tensor) -> Tensor:
    # EfficientNet's MBConv / FusedMBConv: result = block(input); result = stochastic_depth(result); result += input
    if not block.use_res_connect:
        return type(block).forward(block, input)
    return _residual(block, input, block.block, ("block",))


def _maxvit_mb_conv(block: nn.Module, x: Tensor) -> Tensor:
    # res = proj(x); x = stochastic_depth(layers(x)); return res + x
    if isinstance(block.proj, nn.Identity):
        return _residual(block, x, block.layers, ("layers",))
    return _residual(block, block.proj(x), lambda _res, h: block.layers(h), ("layers",), args=(x,))


def _partition_attention(block: nn.Module, x: Tensor) -> Tensor:
    gh, gw = block.grid_size[0] // block.p, block.grid_size[1] // block.p
    torch._assert(
        block.grid_size[0] % block.p == 0 and block.grid_size[1] % block.p == 0,
        f"Grid size must be divisible by partition size. Got grid size of {block.grid_size} and partition size of {block.p}",
    )
    x = block.partition_op(x, block.p)
    x = block.partition_swap(x)
    x = _residual(block, x, block.attn_layer, ("attn_layer",))
    x = _residual(block, x, block.mlp_layer, ("mlp_layer",))
    x = block.departition_swap(x)
    return block.departition_op(x, block.p, gh, gw)


def _multiscale_block(block: nn.Module, x: Tensor, thw: Tuple[int, int, int]) -> Tuple[Tensor, Tuple[int, int, int]]:
    x_norm1 = block.norm1(x.transpose(1, 2)).transpose(1, 2) if block.needs_transposal else block.norm1(x)
    x = x if block.project is None or not block.proj_after_attn else block.project(x_norm1)
    x_skip = x if block.pool_skip is None else block.pool_skip(x, thw)[0]
    grids: List[Any] = []

    def attention(_skip: Tensor, x_norm1: Tensor) -> Tensor:
        x_attn, thw_new = block.attn(x_norm1, thw)
        grids.append(thw_new)
        return x_attn

    x = _residual(block, x_skip, attention, ("attn",), args=(x_norm1,))
    if grids:
        thw_new = grids[0]
    else:  # no sample kept: the new grid (a function of the shapes only) from one sample
        with torch.no_grad():
            thw_new = block.attn(x_norm1[:1], thw)[1]
    x_norm2 = block.norm2(x.transpose(1, 2)).transpose(1, 2) if block.needs_transposal else block.norm2(x)
    x_proj = x if block.project is None or block.proj_after_attn else block.project(x_norm2)
    return _residual(block, x_proj, lambda _proj, h: block.mlp(h), ("mlp",), args=(x_norm2,)), thw_new


@dataclass(frozen=True)
class _Rule:
    """A torchvision block class: the attribute of its drop module, the modules of its
    branches, its routed forward, and whether an instance applies its drop module at all."""

    slot: str
    branches: Tuple[str, ...]
    forward: Callable
    applies: Callable[[nn.Module], bool] = lambda block: True


_RULES: Dict[type, _Rule] = {
    _convnext.CNBlock: _Rule("stochastic_depth", ("block",), _cn_block),
    _swin.SwinTransformerBlock: _Rule("stochastic_depth", ("norm1", "attn", "norm2", "mlp"), _swin_block),
    _swin.SwinTransformerBlockV2: _Rule("stochastic_depth", ("norm1", "attn", "norm2", "mlp"), _swin_block_v2),
    _efficientnet.MBConv: _Rule("stochastic_depth", ("block",), _mb_conv, lambda b: b.use_res_connect),
    _efficientnet.FusedMBConv: _Rule("stochastic_depth", ("block",), _mb_conv, lambda b: b.use_res_connect),
    _maxvit.MBConv: _Rule("stochastic_depth", ("layers",), _maxvit_mb_conv),
    _maxvit.PartitionAttentionLayer: _Rule("stochastic_dropout", ("attn_layer", "mlp_layer"), _partition_attention),
    _mvit.MultiscaleBlock: _Rule("stochastic_depth", ("attn", "mlp"), _multiscale_block),
}

#: The torchvision block classes :func:`patch` converts (``module.qualname``).
SUPPORTED: Tuple[str, ...] = tuple(f"{c.__module__}.{c.__qualname__}" for c in _RULES)
_LISTED = ", ".join(f"{c.__module__.rpartition('.')[2]}.{c.__qualname__}" for c in _RULES)  # for messages


def _base_of(cls: type) -> Tuple[Optional[type], str]:
    """The class of :data:`_RULES` that converts ``cls`` (itself or a base whose forward it
    keeps), or why none does."""
    for base in cls.__mro__:
        if base in _RULES:
            if cls.forward is not base.forward:
                return None, f"{cls.__qualname__} overrides the forward of torchvision's {base.__qualname__}"
            return base, ""
    return None, ""
