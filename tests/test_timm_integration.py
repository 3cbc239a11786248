"""maskedbranch.integrations.timm: patched timm models against the unpatched ones.

The masks are made identical by seeding torch's default generator before each forward: timm
draws its per-sample mask with ``x.new_empty((B, 1, ...)).bernoulli_(keep_prob)`` and maskedbranch
with ``torch.empty(B).bernoulli_(keep_prob)`` on the host, which consume the same stream (checked
below), in the same order. Every training comparison also checks that the patched model really
computed fewer rows (forward pre-hooks count the rows every leaf module sees) and that the masks
matter (another seed gives another output).
"""
import copy
import dataclasses
import io
import os
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import results_of, run_ranks

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


# ----------------------------------------------------------------------------------------------
# Every family: keys, eval, training with the same masks, gradients, fx.


def test_mask_streams_match():
    """timm's draw and maskedbranch's consume the default generator identically."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        torch.manual_seed(123)
        timm_mask = torch.empty(64, 1, 1, dtype=dtype).bernoulli_(0.6)
        torch.manual_seed(123)
        ours = torch.empty(64, dtype=torch.float32).bernoulli_(0.6)
        assert torch.equal(timm_mask.flatten().float(), ours)


# float64 for exact comparisons, except where float64 convolutions (no oneDNN) would dominate CI
FLOAT32 = {
    "fastvit", "mobilenetv3", "efficientnet", "maxvit", "coatnet", "hiera", "convformer", "efficientformer", "pvt_v2",
    "focalnet", "edgenext", "tiny_vit", "poolformer",
}
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=2e-4, atol=2e-5)}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family(name):
    dtype = torch.float32 if name in FLOAT32 else torch.float64
    original, patched, report = pair(name, dtype)
    owners = {n for n, m in original.named_modules() if any(isinstance(c, DropPath) for c in m.children())}
    assert report.converted and not report.skipped and set(report.converted) <= owners
    for n in report.converted:
        block = patched.get_submodule(n)
        assert mb_timm.is_patched(block) and isinstance(block, type(original.get_submodule(n)))
    assert list(patched.state_dict()) == list(original.state_dict())
    patched.load_state_dict(original.state_dict())  # checkpoints load both ways
    original.load_state_dict(patched.state_dict())

    x = images(FAMILIES[name][1], dtype)
    original.eval(), patched.eval()
    with torch.no_grad():
        assert torch.equal(patched(x), original(x))

    original.train(), patched.train()
    freeze_batch_norms(original, patched)
    with RowCounter(original) as dense:
        want, want_grads = run(original, x, 3)
    with RowCounter(patched) as counted:
        got, got_grads = run(patched, x, 3)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert_grads_equal(got_grads, want_grads, **TOL[dtype])
    assert all(g is not None for g in got_grads.values())  # timm's test_model_backward
    assert counted.rows < dense.rows  # the dropped samples' branches did not run
    assert not torch.allclose(run(original, x, 4)[0], want)  # the masks matter

    assert fx_outcome(patched) == fx_outcome(original)  # traces as timm's (train mode)


def test_report_notes():
    _, _, report = pair("resnet")
    assert report.notes and all("BatchNorm" in v for v in report.notes.values())
    _, _, report = pair("edgenext")
    assert any("another drop path" in v for v in report.notes.values())  # nested residuals
    _, _, report = pair("tiny_vit")
    assert any("input shapes" in v for v in report.notes.values())  # traced at the first call
    text = str(report)
    assert "converted" in text and "note" in text and len(report) == len(report.converted)


# ----------------------------------------------------------------------------------------------
# Semantics details, on ViT (cheap) unless the detail needs another block.


@pytest.mark.parametrize("materialize", [True, False])
def test_all_dropped(materialize):
    """drop_prob 1: no branch runs; timm's output; the branch parameters get zeros (timm's
    values), or undefined gradients with materialize_grads=False."""
    original, patched, _ = pair("vit", materialize_grads=materialize)
    set_drop_prob(original, 1.0), set_drop_prob(patched, 1.0)
    original.train(), patched.train()
    x = images()
    want, want_grads = run(original, x, 0)
    with RowCounter(patched.blocks[1].mlp) as mlp:
        got, got_grads = run(patched, x, 0)
    assert mlp.rows == 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for k, g in got_grads.items():
        if k.startswith(("blocks.1.", "blocks.2.")):
            assert (g is not None) == materialize, k
            assert g is None or torch.count_nonzero(g) == 0
        else:
            torch.testing.assert_close(g, want_grads[k], rtol=1e-10, atol=1e-12)


def test_no_residual_all_dropped():
    """The masked form (a drop path not followed by a residual add: RegNetZ's first blocks)
    with every sample dropped: zeros, and zero gradients everywhere upstream, as timm."""
    original, patched, _ = pair("regnetz")
    set_drop_prob(original, 1.0), set_drop_prob(patched, 1.0)
    original.train(), patched.train()
    freeze_batch_norms(original, patched)
    x = images()
    want, want_grads = run(original, x, 0)
    got, got_grads = run(patched, x, 0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)


def test_drop_prob_schedule_and_flags_are_read_each_call():
    original, patched, _ = pair("vit")
    original.train(), patched.train()
    x = images()
    for p in (0.2, 0.8, 0.0):
        set_drop_prob(original, p), set_drop_prob(patched, p)
        want, _ = run(original, x, 11)
        got, _ = run(patched, x, 11)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    set_drop_prob(original, 0.5), set_drop_prob(patched, 0.5)
    for model in (original, patched):  # timm's DropPath follows its own training flag
        for m in model.modules():
            if isinstance(m, DropPath):
                m.eval()
    assert torch.equal(run(patched, x, 1)[0], run(original, x, 1)[0])


def test_maskedbranch_drop_path_in_the_slot():
    """A maskedbranch.DropPath in a block's slot: its mode and generator are used."""
    torch.manual_seed(0)
    model = vit().double()
    for blk in model.blocks[1:]:
        for slot in ("drop_path1", "drop_path2"):
            setattr(blk, slot, mb.DropPath(0.5, mode="batch", generator=torch.Generator().manual_seed(3)))
    original = copy.deepcopy(model)
    mb_timm.patch(model)
    model.train(), original.train()
    want, want_grads = run(original, images(), 0)
    got, got_grads = run(model, images(), 1)  # another default seed: the generators decide
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)


def test_attention_mask_routed_per_row():
    """A per-sample attention mask [B, 1, N, N] reaches the attention with the kept rows; a
    shared one passes unchanged."""
    torch.manual_seed(0)
    block = timm_vit.Block(16, 2, drop_path=0.5).double()
    patched = copy.deepcopy(block)
    mb_timm.patch(nn.ModuleList([patched]))
    block.train(), patched.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 5, 16, generator=g, dtype=torch.float64)
    per_sample = torch.randn(BATCH, 1, 5, 5, generator=g, dtype=torch.float64)
    shared = torch.randn(5, 5, generator=g, dtype=torch.float64)
    for attn_mask in (per_sample, shared, None):
        outs = []
        for m in (block, patched):
            torch.manual_seed(4)
            outs.append(m(x, attn_mask=attn_mask))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)


def test_input_shapes_and_attributes_give_new_plans():
    """A block called with another input size, or whose attribute changed, is traced again."""
    torch.manual_seed(0)
    block = timm.models.swin_transformer.SwinTransformerBlock(16, (4, 4), num_heads=2, window_size=2, shift_size=1, drop_path=0.5)
    block = block.double()
    patched = copy.deepcopy(block)
    mb_timm.patch(nn.ModuleList([patched]))
    block.train(), patched.train()
    for size in (4, 4, 6):
        for m in (block, patched):
            m.set_input_size((size, size), window_size=2)
        x = torch.randn(BATCH, size, size, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(size))
        torch.manual_seed(8)
        want = block(x)
        torch.manual_seed(8)
        torch.testing.assert_close(patched(x), want, rtol=1e-12, atol=1e-12)


def test_timm_grad_checkpointing_replays_the_masks():
    original, patched, _ = pair("vit")
    patched.set_grad_checkpointing(True)
    original.train(), patched.train()
    want, want_grads = run(original, images(), 21)
    got, got_grads = run(patched, images(), 21)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)


def test_hooks_on_converted_blocks_run():
    original, patched, _ = pair("vit")
    for model in (original, patched):
        model.blocks[2].register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
        model.blocks[2].register_forward_hook(lambda mod, args, out: out + 1)
        model.train()
    want, _ = run(original, images(), 5)
    got, _ = run(patched, images(), 5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Residual shapes beyond the families: small blocks, one pattern each.


class Blocks:
    """Blocks holding timm's DropPath, each a pattern the rewrite must handle."""

    class PostAct(nn.Module):  # an activation after the add (ResNet-like)
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            return torch.relu(x + self.drop_path(self.fc(x)))

    class NoShortcut(nn.Module):  # drop path on the whole output: the masked form
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            return nn.functional.gelu(self.drop_path(self.fc(x))) + 1

    class SharedNorm(nn.Module):  # two residuals reading one norm output
        def __init__(self):
            super().__init__()
            self.norm, self.a, self.b = nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 6)
            self.drop_path1, self.drop_path2 = DropPath(0.5), DropPath(0.3)

        def forward(self, x):
            n = self.norm(x)
            return x + self.drop_path1(self.a(n)) + self.drop_path2(self.b(n))

    class Tokens(nn.Module):  # the batch size read once, reused inside the branch and the tail
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)
            self.gamma = nn.Parameter(torch.full((6,), 0.5))

        def forward(self, x):
            B, N, C = x.shape
            y = self.fc(x.reshape(B * N, C)).reshape(B, N * C)
            return x + self.gamma * self.drop_path(y).view(B, N, C)

    class InPlace(nn.Module):  # base.add_(...), with base read again afterwards (fx records
        def __init__(self):  # ``x += y`` on a proxy as ``x = x + y``, as timm's fx tracing does)
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            x = x * 1.0
            s = x
            x.add_(self.drop_path(self.fc(x * 2)))  # (fc does not save x, which changes)
            return x + s

    class PerToken(nn.Module):  # drops rows of [B * N, C]: tokens, not samples
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            B, N, C = x.shape
            return x + self.drop_path(self.fc(x.reshape(B * N, C))).view(B, N, C)


@pytest.mark.parametrize("name", ["PostAct", "NoShortcut", "SharedNorm", "Tokens", "InPlace", "PerToken"])
def test_residual_patterns(name):
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(6, 6), getattr(Blocks, name)(), getattr(Blocks, name)()).double()
    patched = copy.deepcopy(original)
    report = mb_timm.patch(patched)
    assert sorted(report.converted) == ["1", "2"]
    original.train(), patched.train()
    x = torch.randn(BATCH, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RowCounter(patched) as counted:
            got, got_grads = run(patched, x, 5)
    with RowCounter(original) as dense:
        want, want_grads = run(original, x, 5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)
    warned = [str(w.message) for w in caught if "maskedbranch" in str(w.message)]
    if name == "PerToken":  # timm's semantics kept (tokens dropped), with a warning
        assert warned and "not the samples" in warned[0] and counted.rows == dense.rows
    else:
        assert not warned and counted.rows < dense.rows


# ----------------------------------------------------------------------------------------------
# DDP with find_unused_parameters=False: the patched model trains as DDP of timm's model.


def _ddp_run(rank):
    torch.manual_seed(0)
    original = vit().double()
    patched = copy.deepcopy(original)
    mb_timm.patch(patched)
    ddps = [nn.parallel.DistributedDataParallel(m, process_group=dist.new_group(backend="gloo")) for m in (original, patched)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01) for m in ddps]
    rows = []
    hooks = [b.mlp.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0])) for b in patched.blocks[1:]]
    worst = 0.0
    for step in range(3):
        x = images(batch=4, seed=100 * step + rank)
        grads = []
        for model, opt in zip(ddps, opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(1000 * step + rank)  # other masks on every rank and step
            model(x).square().mean().backward()
            grads.append({k: p.grad for k, p in model.module.named_parameters()})
            opt.step()
        worst = max(worst, max((grads[1][k] - g).abs().max().item() for k, g in grads[0].items()))
    for h in hooks:
        h.remove()
    params = max((a - b).abs().max().item() for a, b in zip(original.parameters(), patched.parameters()))
    return {"worst_grad": worst, "params": params, "rows": rows}


def _ddp_worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        result = ("ok", _ddp_run(rank))
    except Exception:  # noqa: BLE001 - reported by the test
        result = ("error", traceback.format_exc())
    torch.save({"timm": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_without_find_unused_parameters_trains_as_timm():
    results = results_of(run_ranks(_ddp_worker, 2, 240, "the DDP job"), "timm")
    for r, res in enumerate(results):
        assert res["worst_grad"] < 1e-10 and res["params"] < 1e-10, f"rank {r}: {res}"
    rows = [res["rows"] for res in results]  # the rows each MLP call saw (none when all dropped)
    assert rows[0] != rows[1]  # the ranks skipped different samples
    assert any(len(r) < 6 or min(r) < 4 for r in rows)  # samples were skipped


# ----------------------------------------------------------------------------------------------
# BatchNorm in a branch.


def test_batch_norm_dense_while_it_trains():
    """Default: a branch whose BatchNorm uses batch statistics runs on every sample, with
    timm's own drop path: bitwise timm."""
    original, patched, _ = pair("resnet")
    original.train(), patched.train()
    x = images()
    want, want_grads = run(original, x, 2)
    got, got_grads = run(patched, x, 2)
    assert torch.equal(got, want)
    assert_grads_equal(got_grads, want_grads, rtol=0, atol=0)
    for a, b in zip(original.buffers(), patched.buffers()):
        assert torch.equal(a, b)


def test_batch_norm_kept():
    """batch_norm="kept": the BatchNorm normalizes over the kept samples, and its running
    statistics follow them. Reference: timm's block on the kept samples (drop_prob 0) and on the
    dropped ones (drop_prob 1), each on its own."""
    from timm.models.resnet import BasicBlock

    torch.manual_seed(0)
    block = BasicBlock(8, 8, drop_path=DropPath(0.5, scale_by_keep=False)).double()
    kept_ref, dropped_ref, patched = copy.deepcopy(block), copy.deepcopy(block), copy.deepcopy(block)
    kept_ref.drop_path, dropped_ref.drop_path = nn.Identity(), DropPath(1.0)
    mb_timm.patch(nn.ModuleList([patched]), batch_norm="kept")
    for m in (kept_ref, dropped_ref, patched):
        m.train()
    x = torch.randn(BATCH, 8, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weights = torch.randn(BATCH, 8, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    keep = torch.empty(BATCH).bernoulli_(0.5).bool()  # the mask the patched block draws first
    assert 0 < keep.sum() < BATCH
    torch.manual_seed(7)
    out = patched(x)
    (out * weights).sum().backward()
    xr = x.detach().clone().requires_grad_()
    ref = torch.empty_like(out)
    ref[keep], ref[~keep] = kept_ref(xr[keep]), dropped_ref(xr[~keep])
    (ref * weights).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)
    for (k, p), q, r in zip(patched.named_parameters(), kept_ref.parameters(), dropped_ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad + r.grad, rtol=1e-10, atol=1e-12, msg=k)
    torch.testing.assert_close(patched.bn1.running_mean, kept_ref.bn1.running_mean)


# ----------------------------------------------------------------------------------------------
# Tracing, scripting, export, feature extraction: timm's own forward.


def test_torchscript_and_export_see_timms_forward():
    original, patched, _ = pair("vit", torch.float32)
    x = images(dtype=torch.float32)
    for training in (True, False):
        original.train(training), patched.train(training)
        scripted = torch.jit.script(patched)
        assert all(mb_timm.is_patched(b) for b in patched.blocks[1:])  # the model is unchanged
    assert torch.equal(scripted(x), original(x))
    exported = torch.export.export(patched, (x,))
    assert torch.equal(exported.module()(x), original(x))


def test_fx_feature_extraction():
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    original, patched, _ = pair("convnext")
    x = images()
    assert get_graph_node_names(patched) == get_graph_node_names(original)
    for model in (original, patched):
        model.eval()
    nodes = ["stages.2", "stages.3"]
    got = create_feature_extractor(patched, nodes)(x)
    want = create_feature_extractor(original, nodes)(x)
    assert all(torch.equal(got[k], want[k]) for k in nodes)
    got = timm.models.create_feature_extractor(patched, nodes)(x)
    assert all(torch.equal(got[k], want[k]) for k in nodes)


def test_features_only_model_trains_as_timm():
    torch.manual_seed(0)
    original = timm.create_model(
        "convnext_atto", pretrained=False, features_only=True, drop_path_rate=DROP, depths=(1, 1, 2, 1),
        dims=(8, 16, 24, 32), ls_init_value=1.0).double()
    patched = copy.deepcopy(original)
    assert len(mb_timm.patch(patched)) == 4
    x = images()
    original.train(), patched.train()
    outs = []
    for model in (original, patched):
        torch.manual_seed(6)
        outs.append(model(x))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# What the patch refuses, and its bookkeeping.


def resnest():
    return timm.create_model("resnest14d", pretrained=False, drop_path_rate=0.2, num_classes=5)


def test_refuses_what_it_cannot_convert():
    """ResNeSt applies its drop path to the block input (no branch to skip)."""
    model = resnest()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as e:
        mb_timm.patch(model)
    msg = str(e.value)
    assert "layer2.0" in msg and "ResNestBottleneck" in msg and "no branch to skip" in msg and "strict=False" in msg
    assert all(f in msg for f in mb_timm.TESTED_FAMILIES)
    assert not any(mb_timm.is_patched(m) for m in model.modules())
    assert all(torch.equal(a, before[k]) for k, a in model.state_dict().items())
    report = mb_timm.patch(model, strict=False)
    assert len(report) == 0 and "layer2.0" in report.skipped and "skipped layer2.0" in str(report)


def test_refuses_drop_path_subclass_and_models_without_drop_path():
    class OddDrop(DropPath):
        def forward(self, x):
            return x

    model = vit()
    model.blocks[1].drop_path2 = OddDrop(0.1)
    with pytest.raises(ValueError, match="overrides DropPath.forward"):
        mb_timm.patch(model)
    with pytest.raises(ValueError, match="no drop-path residual"):
        mb_timm.patch(nn.Sequential(nn.Linear(2, 2)))
    assert len(mb_timm.patch(nn.Sequential(nn.Linear(2, 2)), strict=False)) == 0
    with pytest.raises(TypeError, match="model"):
        mb_timm.patch("vit")
    with pytest.raises(ValueError, match="batch_norm"):
        mb_timm.patch(vit(), batch_norm="ghost")


class ShapeDependent(nn.Module):
    """A residual whose forward branches on the batch size: untraceable with routed rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop_path = DropPath(0.5)

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        return x + self.drop_path(self.fc(x))


def test_block_untraceable_at_run_time_keeps_timms_computation():
    torch.manual_seed(0)
    original = nn.Sequential(ShapeDependent(), ShapeDependent()).double()
    patched = copy.deepcopy(original)
    report = mb_timm.patch(patched)
    assert len(report) == 2 and all("input shapes" in v for v in report.notes.values())
    original.train(), patched.train()
    x = torch.randn(BATCH, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="cannot be traced for these inputs"):
        got, got_grads = run(patched, x, 3)
    want, want_grads = run(original, x, 3)
    assert torch.equal(got, want)
    assert_grads_equal(got_grads, want_grads, rtol=0, atol=0)


def test_patch_twice_unpatch_copy_and_pickle():
    original, patched, report = pair("swin")
    again = mb_timm.patch(patched)
    assert len(again) == 0 and sorted(again.already) == sorted(report.converted)
    x = images()
    patched.train()
    run(patched, x, 1)  # build the plans: they are not pickled
    for clone in (copy.deepcopy(patched), torch.load(_saved(patched), weights_only=False)):
        assert sum(mb_timm.is_patched(m) for m in clone.modules()) == len(report)
        torch.testing.assert_close(run(clone, x, 2)[0], run(patched, x, 2)[0], rtol=1e-12, atol=1e-12)
    assert mb_timm.unpatch(patched) == len(report)
    assert all(type(a) is type(b) for a, b in zip(patched.modules(), original.modules()))
    assert not any(hasattr(m, "_maskedbranch_timm") for m in patched.modules())


def _saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return buf


def test_options_update_on_repatch():
    original, patched, _ = pair("vit")
    set_drop_prob(patched, 1.0)
    patched.train()
    for materialize in (False, True):
        mb_timm.patch(patched, materialize_grads=materialize)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, grads = run(patched, images(), 0)
        assert (grads["blocks.1.mlp.fc1.weight"] is not None) == materialize
