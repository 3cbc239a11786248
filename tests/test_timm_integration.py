"""maskedbranch.integrations.timm: patched timm blocks against the unpatched model.

The masks are made identical by seeding torch's default generator before each forward: timm
draws its per-sample mask with ``x.new_empty((B, 1, ...)).bernoulli_(keep_prob)`` and maskedbranch
with ``torch.empty(B).bernoulli_(keep_prob)`` on the host, which consume the same stream (checked
below), in the same block order. Every training test also checks that the masks were not trivial
(some samples dropped and some kept, so the comparison means something) and that the patched
branches really ran on fewer rows.
"""
import copy
import io

import pytest
import torch
from torch import nn

try:
    import timm
    from timm.models import convnext as timm_convnext
    from timm.models import vision_transformer as timm_vit

    from maskedbranch.integrations import timm as mb_timm
except Exception as e:  # noqa: BLE001 - timm is optional (an extra); any import failure skips
    pytest.skip(f"timm is not usable here: {type(e).__name__}: {e}", allow_module_level=True)

import maskedbranch as mb

BATCH = 8
DROP = 0.5


# ----------------------------------------------------------------------------------------------
# Tiny models (no downloads).


def unit_post_norms(model):
    """Swin-V2 zero-initializes its post-norms (every branch would add exactly zero)."""
    for blk in model.modules():
        if isinstance(blk, timm.models.swin_transformer_v2.SwinTransformerV2Block):
            nn.init.ones_(blk.norm1.weight)
            nn.init.ones_(blk.norm2.weight)
    return model


def vit(**kw):
    args = dict(img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=2, num_classes=5, drop_path_rate=DROP)
    args.update(kw)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **args)


MODELS = {
    "vit": lambda: vit(),
    "vit_layerscale": lambda: vit(init_values=0.5),
    "vit_res_post": lambda: timm_vit.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, drop_path_rate=DROP,
        block_fn=timm_vit.ResPostBlock, class_token=False, global_pool="avg",
    ),
    "deit": lambda: timm.create_model(
        "deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
        num_heads=2, depth=2, num_classes=5, drop_path_rate=DROP,
    ),
    "convnext": lambda: timm.create_model(
        "convnext_atto", pretrained=False, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), num_classes=5,
        drop_path_rate=DROP, ls_init_value=1.0,  # timm's 1e-6 would make every branch negligible
    ),
    "convnext_conv_mlp": lambda: timm.create_model(
        "convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), num_classes=5,
        drop_path_rate=DROP, conv_mlp=True, ls_init_value=1.0,
    ),
    "swin": lambda: timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=2, window_size=4,
        embed_dim=16, depths=(2, 2), num_heads=(1, 2), num_classes=5, drop_path_rate=DROP,
    ),
    "swinv2": lambda: unit_post_norms(timm.create_model(
        "swinv2_tiny_window8_256", pretrained=False, img_size=32, patch_size=2, window_size=4,
        embed_dim=16, depths=(2, 2), num_heads=(1, 2), num_classes=5, drop_path_rate=DROP,
    )),
}

BLOCK_TYPES = {
    "vit": timm_vit.Block,
    "vit_layerscale": timm_vit.Block,
    "vit_res_post": timm_vit.ResPostBlock,
    "deit": timm_vit.Block,
    "convnext": timm_convnext.ConvNeXtBlock,
    "convnext_conv_mlp": timm_convnext.ConvNeXtBlock,
    "swin": timm.models.swin_transformer.SwinTransformerBlock,
    "swinv2": timm.models.swin_transformer_v2.SwinTransformerV2Block,
}


def pair(name, dtype=torch.float64):
    torch.manual_seed(0)
    original = MODELS[name]().to(dtype)
    patched = copy.deepcopy(original)
    report = mb_timm.patch(patched)
    return original, patched, report


def images(dtype=torch.float64, batch=BATCH, seed=1):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def run(model, x, seed):
    """Forward + backward with the default generator seeded: returns (output, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out  # deit distilled in train mode: (cls, dist)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    grads = {k: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}
    return out.detach(), grads


class RowCounter:
    """Samples seen by the ``mlp`` of every block (its input is [rows, ...] in every supported
    block; the attention of a Swin block sees windows, not samples)."""

    def __init__(self, model):
        self.rows = []
        self.handles = []
        for m in model.modules():
            if isinstance(m, tuple(BLOCK_TYPES.values())):
                self.handles.append(m.mlp.register_forward_hook(self.hook))

    def hook(self, module, args, out):
        self.rows.append(args[0].shape[0])

    def close(self):
        for h in self.handles:
            h.remove()


def assert_grads_close(got, want, **tol):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{k}: {m}", **tol)


# ----------------------------------------------------------------------------------------------
# Masks: the premise of the comparison.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mask_streams_match(dtype):
    """timm's draw and maskedbranch's consume the default generator identically."""
    torch.manual_seed(123)
    timm_mask = torch.empty(64, 1, 1, dtype=dtype).bernoulli_(0.6)
    torch.manual_seed(123)
    ours = torch.empty(64, dtype=torch.float32).bernoulli_(0.6)
    assert torch.equal(timm_mask.flatten().float(), ours)


# ----------------------------------------------------------------------------------------------
# Equality with the unpatched model.


@pytest.mark.parametrize("name", list(MODELS))
def test_report_and_state_dict(name):
    original, patched, report = pair(name)
    blocks = [n for n, m in original.named_modules() if type(m) is BLOCK_TYPES[name]]
    assert blocks and sorted(report.converted) == sorted(blocks)
    assert set(report.converted.values()) == {BLOCK_TYPES[name].__qualname__}
    assert not report.skipped and not report.already
    assert len(report) == len(blocks) and "converted" in str(report)
    for n in blocks:
        m = patched.get_submodule(n)
        assert mb_timm.is_patched(m) and isinstance(m, BLOCK_TYPES[name])
    assert list(patched.state_dict()) == list(original.state_dict())
    for (k, a), (_, b) in zip(original.state_dict().items(), patched.state_dict().items()):
        assert torch.equal(a, b), k
    # a checkpoint of the original loads into the patched model and back
    patched.load_state_dict(original.state_dict())
    original.load_state_dict(patched.state_dict())


@pytest.mark.parametrize("name", list(MODELS))
def test_eval_equal(name):
    original, patched, _ = pair(name)
    original.eval(), patched.eval()
    x = images()
    with torch.no_grad():
        assert torch.equal(patched(x), original(x))


@pytest.mark.parametrize("name", list(MODELS))
def test_train_same_mask_equal(name):
    original, patched, _ = pair(name)
    original.train(), patched.train()
    x = images()
    counter = RowCounter(patched)
    total_dense = 0
    for seed in (3, 4):
        want, want_grads = run(original, x, seed)
        got, got_grads = run(patched, x, seed)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert_grads_close(got_grads, want_grads, rtol=1e-10, atol=1e-12)
        total_dense += BATCH * len(counter.handles)
    counter.close()
    # the comparison is not vacuous: the masks dropped rows, so the output depends on them...
    other, _ = run(original, x, 99)
    assert not torch.allclose(other, want)
    # ...and the patched branches ran on fewer rows than the batch (some did not run at all)
    assert sum(counter.rows) < total_dense
    assert any(0 < r < BATCH for r in counter.rows)


@pytest.mark.parametrize("name", ["vit", "convnext", "swin"])
def test_train_float32_equal(name):
    original, patched, _ = pair(name, torch.float32)
    original.train(), patched.train()
    x = images(torch.float32)
    want, want_grads = run(original, x, 7)
    got, got_grads = run(patched, x, 7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_grads_close(got_grads, want_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["vit", "convnext", "swin"])
def test_all_dropped_and_none_dropped(name):
    """drop_prob 1: no branch runs, the output is timm's (the branches' contribution is zero),
    and the branch parameters get a zero gradient (undefined here: no DDP to fill it)."""
    original, patched, _ = pair(name)
    for model in (original, patched):
        for m in model.modules():
            if isinstance(m, timm.layers.DropPath):
                m.drop_prob = 1.0
    original.train(), patched.train()
    x = images()
    counter = RowCounter(patched)
    want, want_grads = run(original, x, 0)
    got, got_grads = run(patched, x, 0)
    counter.close()
    assert counter.rows == [r for r in counter.rows if r == 0 or r == BATCH]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_close(got_grads, want_grads, rtol=1e-10, atol=1e-12)
    # drop_prob 0 in training: the identity drop path, timm's operations
    for model in (original, patched):
        for m in model.modules():
            if isinstance(m, timm.layers.DropPath):
                m.drop_prob = 0.0
    want, _ = run(original, x, 0)
    got, _ = run(patched, x, 0)
    assert torch.equal(got, want)


def test_materialize_grads():
    """materialize_grads=True: the parameters of a branch that no sample keeps get zero tensors
    (for FSDP2) instead of undefined gradients; patching again switches it on converted blocks."""
    torch.manual_seed(0)
    model = vit()
    for m in model.modules():
        if isinstance(m, timm.layers.DropPath):
            m.drop_prob = 1.0
    model.train()
    x = images(torch.float32, batch=2)
    for materialize, defined in ((False, False), (True, True), (False, False)):
        mb_timm.patch(model, materialize_grads=materialize)
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        dropped = [blk for blk in model.blocks if isinstance(blk.drop_path2, timm.layers.DropPath)]
        assert dropped
        for blk in dropped:
            for p in blk.mlp.parameters():
                assert (p.grad is not None) == defined
                if defined:
                    assert torch.count_nonzero(p.grad) == 0
    mb_timm.unpatch(model)
    assert not any(hasattr(m, "_maskedbranch_materialize_grads") for m in model.modules())


def test_drop_prob_schedule_is_read_each_call():
    original, patched, _ = pair("vit")
    original.train(), patched.train()
    x = images()
    for p in (0.2, 0.8):
        for model in (original, patched):
            for m in model.modules():
                if isinstance(m, timm.layers.DropPath):
                    m.drop_prob = p
        want, _ = run(original, x, 11)
        got, _ = run(patched, x, 11)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_drop_path_module_training_flag_is_honoured():
    """timm's DropPath follows its own ``training`` flag (not the block's): so does the patch."""
    original, patched, _ = pair("vit")
    original.train(), patched.train()
    for model in (original, patched):
        for m in model.modules():
            if isinstance(m, timm.layers.DropPath):
                m.eval()
    x = images()
    want, _ = run(original, x, 1)
    got, _ = run(patched, x, 1)
    assert torch.equal(got, want)


def test_maskedbranch_drop_path_in_the_slot():
    """A maskedbranch.DropPath in a block's slot: its mode and generator are used."""
    torch.manual_seed(0)
    model = vit().double()
    for blk in model.blocks:
        for slot in ("drop_path1", "drop_path2"):
            if isinstance(getattr(blk, slot), timm.layers.DropPath):
                setattr(blk, slot, mb.DropPath(0.5, mode="batch", generator=torch.Generator().manual_seed(3)))
    original = copy.deepcopy(model)
    mb_timm.patch(model)
    model.train(), original.train()
    x = images()
    want, want_grads = run(original, x, 0)
    got, got_grads = run(model, x, 1)  # another default seed: the generators decide
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_close(got_grads, want_grads, rtol=1e-10, atol=1e-12)


def test_vit_attention_mask_routed_per_row():
    """A per-sample attention mask [B, 1, N, N] reaches the attention with the kept rows."""
    torch.manual_seed(0)
    block = timm_vit.Block(16, 2, drop_path=0.5).double()
    patched = copy.deepcopy(block)
    mb_timm.patch(patched)
    block.train(), patched.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 5, 16, generator=g, dtype=torch.float64)
    mask = torch.randn(BATCH, 1, 5, 5, generator=g, dtype=torch.float64)  # additive, per sample
    shared = torch.randn(5, 5, generator=g, dtype=torch.float64)  # broadcast over the batch
    for attn_mask in (mask, shared, mask[:1]):
        outs = []
        for m in (block, patched):
            torch.manual_seed(4)
            outs.append(m(x, attn_mask=attn_mask))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)


def test_convnext_projecting_shortcut():
    """A ConvNeXt block whose shortcut projects (in_chs != out_chs): the branch reads x, the
    residual is shortcut(x)."""
    torch.manual_seed(0)
    block = timm_convnext.ConvNeXtBlock(8, 16, drop_path=0.5).double()
    assert not isinstance(block.shortcut, nn.Identity)
    patched = copy.deepcopy(block)
    mb_timm.patch(patched)
    block.train(), patched.train()
    x = torch.randn(BATCH, 8, 6, 6, dtype=torch.float64)
    grads = []
    for m in (block, patched):
        xx = x.clone().requires_grad_()
        torch.manual_seed(2)
        out = m(xx)
        out.square().sum().backward()
        grads.append((out.detach(), xx.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-12, atol=1e-12)


def test_grad_checkpointing_in_timm_replays_the_mask():
    """timm's own activation checkpointing (set_grad_checkpointing) around patched blocks: the
    recomputation draws the same masks (checkpoint restores the default generator)."""
    original, patched, _ = pair("vit")
    patched_ckpt = copy.deepcopy(patched)
    patched_ckpt.set_grad_checkpointing(True)
    for m in (original, patched, patched_ckpt):
        m.train()
    x = images()
    want, want_grads = run(original, x, 21)
    got, got_grads = run(patched_ckpt, x, 21)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_close(got_grads, want_grads, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# What the patch refuses, and its bookkeeping.


def test_refuses_unknown_blocks():
    torch.manual_seed(0)
    model = vit(block_fn=timm_vit.ParallelThingsBlock)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError) as e:
        mb_timm.patch(model)
    msg = str(e.value)
    assert "ParallelThingsBlock" in msg and "blocks.1" in msg
    for name in mb_timm.SUPPORTED_BLOCKS:
        assert name in msg
    assert "strict=False" in msg
    assert not any(mb_timm.is_patched(m) for m in model.modules())  # nothing was changed
    assert all(torch.equal(a, before[k]) for k, a in model.state_dict().items())


def test_strict_false_converts_what_it_knows():
    torch.manual_seed(0)
    model = vit(depth=3)
    model.blocks[1] = timm_vit.ParallelThingsBlock(32, 2, drop_path=0.3)
    report = mb_timm.patch(model, strict=False)
    assert sorted(report.converted) == ["blocks.0", "blocks.2"]
    assert list(report.skipped) == ["blocks.1"] and "ParallelThingsBlock" in report.skipped["blocks.1"]
    assert "skipped blocks.1" in str(report)
    model.train()
    model(images(torch.float32, batch=2)).sum().backward()


def test_refuses_subclass_overriding_forward_and_unknown_drop_module():
    class MyBlock(timm_vit.Block):
        def forward(self, x, attn_mask=None, is_causal=False):
            return super().forward(x) * 2

    class OddDrop(nn.Module):
        def forward(self, x):
            return x

    torch.manual_seed(0)
    model = vit()
    model.blocks[0] = MyBlock(32, 2, drop_path=0.1)
    with pytest.raises(ValueError, match="overrides forward"):
        mb_timm.patch(model)
    model = vit()
    model.blocks[1].drop_path2 = OddDrop()
    with pytest.raises(ValueError, match="unknown drop-path module"):
        mb_timm.patch(model)


def test_subclass_keeping_forward_is_converted():
    class Tagged(timm_vit.Block):
        pass

    model = nn.Sequential(Tagged(16, 2, drop_path=0.2))
    report = mb_timm.patch(model)
    assert report.converted == {"0": "Block"}


def test_refuses_model_without_supported_blocks():
    with pytest.raises(ValueError, match="nothing to convert"):
        mb_timm.patch(nn.Sequential(nn.Linear(2, 2)))
    assert len(mb_timm.patch(nn.Sequential(nn.Linear(2, 2)), strict=False)) == 0
    with pytest.raises(TypeError):
        mb_timm.patch("vit")


def test_patch_twice_unpatch_and_pickle():
    original, patched, report = pair("swin")
    again = mb_timm.patch(patched)
    assert len(again) == 0 and sorted(again.already) == sorted(report.converted)
    buf = io.BytesIO()
    torch.save(patched, buf)  # the converted classes are importable: the whole model pickles
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert sum(mb_timm.is_patched(m) for m in loaded.modules()) == len(report)
    assert mb_timm.unpatch(patched) == len(report)
    assert not any(mb_timm.is_patched(m) for m in patched.modules())
    assert all(type(a) is type(b) for a, b in zip(patched.modules(), original.modules()))


def test_block_called_directly():
    """A converted block is still a module of its own (blocks can be called one by one)."""
    torch.manual_seed(0)
    block = timm.models.swin_transformer.SwinTransformerBlock(16, (4, 4), num_heads=2, window_size=2, shift_size=1, drop_path=0.5)
    patched = copy.deepcopy(block)
    mb_timm.patch(nn.ModuleList([patched]))
    x = torch.randn(BATCH, 4, 4, 16)
    block.train(), patched.train()
    torch.manual_seed(8)
    want = block(x)
    torch.manual_seed(8)
    got = patched(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
