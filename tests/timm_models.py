"""Tiny timm models of every tested family and the helpers that compare a patched model with
timm's (tests/test_timm_families.py, tests/test_timm_integration.py)."""
import copy
import dataclasses

import pytest
import torch
from torch import nn

try:
    import timm
    from timm.layers import DropPath
    from timm.models import vision_transformer as timm_vit

    from maskedbranch.integrations import timm as mb_timm
except Exception as e:  # noqa: BLE001 - timm is optional (an extra); any import failure skips
    pytest.skip(f"timm is not usable here: {type(e).__name__}: {e}", allow_module_level=True)

import maskedbranch as mb

BATCH = 8
DROP = 0.5
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


# ----------------------------------------------------------------------------------------------
# Tiny models of every tested family (no downloads). Layer scales start at 1 where timm starts
# them near 0 (every branch would add almost nothing and the comparison would be weak).


def create(name, **kw):
    return timm.create_model(name, pretrained=False, num_classes=5, drop_path_rate=DROP, **kw)


def vit_args(**kw):
    return dict(img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=3, **kw)


def vit(**kw):
    return create("vit_tiny_patch16_224", **vit_args(**kw))


def ones(model, cls, *names):
    for m in model.modules():
        if isinstance(m, cls):
            for n in names:
                nn.init.ones_(m.get_parameter(n))
    return model


def maxxvit(name, block_type):
    from timm.models import maxxvit as mx

    cfg = mx.model_cfgs[name]
    cfg = dataclasses.replace(
        cfg, embed_dim=(16, 32), depths=(1, 2), block_type=block_type, stem_width=(8, 16),
        conv_cfg=dataclasses.replace(cfg.conv_cfg, init_values=1.0),
        transformer_cfg=dataclasses.replace(cfg.transformer_cfg, dim_head=8, window_size=(2, 2), grid_size=(2, 2), rel_pos_dim=16),
    )
    return mx.MaxxVit(cfg, img_size=32, num_classes=5, drop_path_rate=DROP)


def regnetz():
    from timm.models import byobnet as bb

    cfg = bb.model_cfgs["regnetz_b16"]
    blocks = tuple(dataclasses.replace(b, d=d, c=c, gs=4) for b, d, c in zip(cfg.blocks, (1, 2, 1, 1), (8, 16, 24, 32)))
    cfg = dataclasses.replace(cfg, blocks=blocks, stem_chs=8, num_features=32, zero_init_last=False)
    return bb.ByobNet(cfg, num_classes=5, drop_path_rate=DROP)


def metaformer(**kw):
    from timm.models import metaformer as mf

    return mf.MetaFormer(depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), layer_scale_init_values=1.0, num_classes=5, drop_path_rate=DROP, **kw)


def mvitv2():
    from timm.models import mvitv2 as mv

    cfg = mv.MultiScaleVitCfg(depths=(1, 2), embed_dim=16, num_heads=1, stride_q=((1, 1), (2, 2)))
    return mv.MultiScaleVit(cfg, img_size=(32, 32), num_classes=5, drop_path_rate=DROP)


def efficientnet():
    from timm.models.efficientnet import _gen_efficientnet

    return _gen_efficientnet("efficientnet_b0", channel_multiplier=0.25, depth_multiplier=0.3, num_classes=5, drop_path_rate=DROP)


#: family -> (builder, input size). The families of mb_timm.TESTED_FAMILIES and a few more.
FAMILIES = {
    "vit": (lambda: vit(), 32),
    "deit": (lambda: create("deit_tiny_distilled_patch16_224", **vit_args()), 32),
    "convnext": (lambda: create("convnext_atto", depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), ls_init_value=1.0), 32),
    "swin": (lambda: create(
        "swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(1, 2)), 32),
    "swinv2": (lambda: ones(create(
        "swinv2_tiny_window8_256", img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(1, 2)),
        timm.models.swin_transformer_v2.SwinTransformerV2Block, "norm1.weight", "norm2.weight"), 32),
    "resnet": (lambda: create("resnet18", layers=(1, 1, 1, 1), channels=(8, 16, 24, 32), stem_width=8, zero_init_last=False), 32),
    "resnet_bottleneck": (lambda: create(
        "resnet26", layers=(1, 1, 1, 1), channels=(8, 16, 24, 32), stem_width=8, zero_init_last=False), 32),
    "efficientnet": (efficientnet, 32),
    "mobilenetv3": (lambda: create("mobilenetv3_small_050"), 32),
    "eva": (lambda: create("eva02_tiny_patch14_224", img_size=28, patch_size=7, embed_dim=32, depth=3, num_heads=2), 28),
    "cait": (lambda: create("cait_xxs24_224", **vit_args(init_values=1.0, depth_token_only=1)), 32),
    "maxvit": (lambda: maxxvit("maxvit_nano_rw", ("M", "M")), 32),
    "coatnet": (lambda: maxxvit("coatnet_nano_rw", ("C", "T")), 32),
    "poolformer": (lambda: metaformer(
        downsample_norm=None, mlp_bias=True, norm_layers=timm.models.metaformer.GroupNorm1, res_scale_init_values=None,
        use_mlp_head=False), 32),
    "convformer": (lambda: metaformer(token_mixers=timm.models.metaformer.SepConv), 32),
    "efficientformer": (lambda: create(
        "efficientformer_l1", depths=(1, 1, 1, 2), embed_dims=(8, 16, 24, 32), num_vit=1, layer_scale_init_value=1.0), 224),
    "hiera": (lambda: create("hiera_tiny_224", img_size=64, embed_dim=16, num_heads=1, stages=(1, 1, 2, 1)), 64),
    "regnetz": (regnetz, 32),
    "edgenext": (lambda: create(
        "edgenext_xx_small", depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), heads=(1, 1, 1, 1), ls_init_value=1.0), 32),
    "tiny_vit": (lambda: create(
        "tiny_vit_5m_224", embed_dims=(16, 16, 32, 32), depths=(1, 1, 2, 1), num_heads=(1, 1, 2, 2), window_sizes=(2, 2, 2, 2)), 64),
    "pvt_v2": (lambda: create("pvt_v2_b0", depths=(1, 1, 2, 1), embed_dims=(8, 16, 24, 32), num_heads=(1, 1, 1, 1)), 32),
    "beit": (lambda: create("beit_base_patch16_224", **vit_args(init_values=0.5)), 32),
    "mvitv2": (mvitv2, 32),
    "focalnet": (lambda: timm.models.focalnet.FocalNet(embed_dim=8, depths=(1, 1, 2, 1), num_classes=5, drop_path_rate=DROP), 32),
    "fastvit": (lambda: create(
        "fastvit_t8", layers=(1, 1, 2, 1), embed_dims=(64, 64, 64, 64), layer_scale_init_value=1.0,
        token_mixers=("repmixer", "repmixer", "repmixer", "attention")), 32),
}


def pair(name, dtype=torch.float64, **patch_kw):
    torch.manual_seed(0)
    original = FAMILIES[name][0]().to(dtype)
    head = original.get_classifier()
    if isinstance(getattr(head, "weight", None), torch.Tensor):  # some heads start at zero
        nn.init.normal_(head.weight, std=0.2)
    patched = copy.deepcopy(original)
    report = mb_timm.patch(patched, **patch_kw)
    return original, patched, report


def images(size=32, dtype=torch.float64, batch=BATCH, seed=1):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def freeze_batch_norms(*models):
    """BatchNorm in eval mode: a branch holding one is routed (exactly) only then."""
    for model in models:
        for m in model.modules():
            if isinstance(m, BATCH_NORMS):
                m.eval()


def run(model, x, seed):
    """Forward + backward with the default generator seeded: (output, {name: grad or None})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    out = out[0] if isinstance(out, (tuple, list)) else out  # deit distilled: (cls, dist)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    return out.detach(), {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}


def assert_grads_equal(got, want, **tol):
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] is None) == (want[k] is None), f"{k}: gradient {'missing' if got[k] is None else 'unexpected'}"
        if want[k] is not None:
            torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{k}: {m}", **tol)


class RowCounter:
    """Rows (first dimension) of the tensors every leaf module of ``model`` is called with."""

    def __init__(self, model):
        self.rows = 0
        self.handles = [m.register_forward_pre_hook(self.hook) for m in model.modules() if not list(m.children())]

    def hook(self, module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            self.rows += args[0].shape[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def set_drop_prob(model, p):
    for m in model.modules():
        if isinstance(m, DropPath):
            m.drop_prob = p


def fx_outcome(model):
    try:
        return [n.name for n in torch.fx.symbolic_trace(model).graph.nodes]
    except Exception as e:  # noqa: BLE001 - the same failure as timm's is what is checked
        return type(e).__name__
