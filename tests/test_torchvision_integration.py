"""maskedbranch.integrations.torchvision: patched torchvision models against the unpatched ones.

The masks are made identical by seeding torch's default generator before each forward:
torchvision draws its per-sample mask with ``torch.empty([B, 1, ...], dtype=x.dtype).bernoulli_(1 - p)``
on x's device (the CPU here) and maskedbranch with ``torch.empty(B).bernoulli_(1 - p)`` on the
host, which consume the same stream, in the same order. Every training comparison also checks
that the patched model really ran a branch on fewer rows and that the masks matter (another seed
gives another output). Tiny models of every family whose blocks own a ``StochasticDepth``.
"""
import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

torchvision = pytest.importorskip("torchvision")

from harness import Counting, results_of, run_ranks, run_scenarios  # noqa: E402
from torchvision.models import convnext, efficientnet, maxvit, swin_transformer  # noqa: E402
from torchvision.models.video import mvit  # noqa: E402
from torchvision.models.video import swin_transformer as swin3d  # noqa: E402

import maskedbranch as mb  # noqa: E402
from maskedbranch.integrations import torchvision as mb_tv  # noqa: E402

BATCH = 4
P = 0.5


def _mvit_model():
    blocks = [
        mvit.MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]),
        mvit.MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 1, 1]),
        mvit.MSBlockConfig(2, 32, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 1, 1]),
    ]
    return mvit.MViT((32, 32), 4, blocks, residual_pool=True, residual_with_cls_embed=False, rel_pos_embed=True,
                     proj_after_attn=True, dropout=0.0, stochastic_depth_prob=P, num_classes=10)


# name -> (builder, input shape, (block class, the branch module whose rows are counted))
FAMILIES = {
    "convnext": (lambda: convnext.ConvNeXt([convnext.CNBlockConfig(16, 32, 2), convnext.CNBlockConfig(32, None, 2)],
                                           stochastic_depth_prob=P, layer_scale=0.5, num_classes=10),
                 (BATCH, 3, 32, 32), (convnext.CNBlock, "block")),
    "swin": (lambda: swin_transformer.SwinTransformer([4, 4], 16, [2, 2], [2, 2], [2, 2], stochastic_depth_prob=P,
                                                      num_classes=10),
             (BATCH, 3, 32, 32), (swin_transformer.SwinTransformerBlock, "attn")),
    "swin_v2": (lambda: swin_transformer.SwinTransformer(
                    [4, 4], 16, [2, 2], [2, 2], [2, 2], stochastic_depth_prob=P, num_classes=10,
                    block=swin_transformer.SwinTransformerBlockV2, downsample_layer=swin_transformer.PatchMergingV2),
                (BATCH, 3, 32, 32), (swin_transformer.SwinTransformerBlockV2, "attn")),
    "swin3d": (lambda: swin3d.SwinTransformer3d([2, 4, 4], 16, [2, 2], [2, 2], [2, 2, 2], stochastic_depth_prob=P,
                                                num_classes=10),
               (BATCH, 3, 4, 32, 32), (swin_transformer.SwinTransformerBlock, "attn")),
    "efficientnet": (lambda: efficientnet.EfficientNet(
                         [efficientnet.MBConvConfig(1, 3, 1, 16, 16, 2), efficientnet.MBConvConfig(4, 3, 2, 16, 24, 2)],
                         dropout=0.2, stochastic_depth_prob=P, num_classes=10),
                     (BATCH, 3, 32, 32), (efficientnet.MBConv, "block")),
    "efficientnet_v2": (lambda: efficientnet.EfficientNet(
                            [efficientnet.FusedMBConvConfig(1, 3, 1, 16, 16, 2),
                             efficientnet.FusedMBConvConfig(4, 3, 2, 16, 24, 2),
                             efficientnet.MBConvConfig(4, 3, 1, 24, 24, 2)],
                            dropout=0.2, stochastic_depth_prob=P, num_classes=10, last_channel=64),
                        (BATCH, 3, 32, 32), (efficientnet.FusedMBConv, "block")),
    "maxvit": (lambda: maxvit.MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[16, 32],
                                     block_layers=[2, 1], head_dim=8, stochastic_depth_prob=P, num_classes=10),
               (BATCH, 3, 32, 32), (maxvit.PartitionAttentionLayer, "attn_layer")),
    "mvit": (_mvit_model, (BATCH, 3, 4, 32, 32), (mvit.MultiscaleBlock, "mlp")),
}
BATCH_NORM_FAMILIES = ("efficientnet", "efficientnet_v2", "maxvit")


def build(name, dtype=torch.float64):
    torch.manual_seed(0)
    return FAMILIES[name][0]().to(dtype)


def pair(name, dtype=torch.float64, **options):
    original = build(name, dtype)
    patched = copy.deepcopy(original)
    report = mb_tv.patch(patched, **options)
    return original, patched, report


def images(name, dtype=torch.float64, seed=0, batch=BATCH):
    shape = (batch,) + FAMILIES[name][1][1:]
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def run(model, x, seed):
    """Output and gradients of one training forward / backward with the default generator at ``seed``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}


def assert_grads_equal(got, want, **tol):
    assert got.keys() == want.keys()
    for k, g in got.items():
        w = want[k]
        if w is None or g is None:
            assert g is None and w is None or torch.count_nonzero(g if w is None else w) == 0, k
        else:
            torch.testing.assert_close(g, w, msg=k, **tol)


def freeze_batch_norms(*models):
    for model in models:
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()


class RowCounter:
    """Rows that the ``attr`` submodule of every ``cls`` block of a model sees, summed."""

    def __init__(self, model, name):
        cls, attr = FAMILIES[name][2]
        self.modules = [getattr(b, attr) for b in model.modules() if isinstance(b, cls)]
        self.rows = 0

    def __enter__(self):
        def count(module, args):
            self.rows += args[0].shape[0]
        self.hooks = [m.register_forward_pre_hook(count) for m in self.modules]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


# ----------------------------------------------------------------------------------------------
# Every family: keys, eval, training with the same masks.


@pytest.mark.parametrize("name", FAMILIES)
def test_keys_load_both_ways_and_eval_is_bitwise(name):
    original, patched, report = pair(name, torch.float32)
    assert len(report) > 0 and mb_tv.is_patched(patched) and not mb_tv.is_patched(original)
    assert list(patched.state_dict()) == list(original.state_dict())
    fresh = build(name, torch.float32)
    mb_tv.patch(fresh)
    fresh.load_state_dict(original.state_dict())
    original.load_state_dict(patched.state_dict())
    original.eval(), fresh.eval()
    x = images(name, torch.float32)
    assert torch.equal(fresh(x), original(x))


@pytest.mark.parametrize("name", FAMILIES)
def test_training_equals_torchvision_with_the_same_seed(name):
    original, patched, _ = pair(name)
    original.train(), patched.train()
    if name in BATCH_NORM_FAMILIES:
        freeze_batch_norms(original, patched)  # frozen: their branches are routed too
    x = images(name)
    with RowCounter(original, name) as dense:
        want, want_grads = run(original, x, 3)
    with RowCounter(patched, name) as routed:
        got, got_grads = run(patched, x, 3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)
    assert routed.rows < dense.rows, (routed.rows, dense.rows)
    assert not torch.equal(run(patched, x, 4)[0], got)  # the masks matter


def test_float32_training_matches_to_float_tolerance():
    original, patched, _ = pair("convnext", torch.float32)
    original.train(), patched.train()
    x = images("convnext", torch.float32)
    want, want_grads = run(original, x, 5)
    got, got_grads = run(patched, x, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_grads_equal(got_grads, want_grads, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", BATCH_NORM_FAMILIES)
def test_batch_norm_that_trains_keeps_torchvision_computation(name):
    """Default batch_norm="dense": a branch whose BatchNorm uses batch statistics runs on every
    sample with torchvision's own forward (bitwise); "kept" routes it anyway."""
    original, patched, report = pair(name)
    assert report.notes
    original.train(), patched.train()
    mb_conv = (efficientnet.MBConv, efficientnet.FusedMBConv, maxvit.MBConv)
    branches = [b.block if hasattr(b, "block") else b.layers
                for b in patched.modules() if isinstance(b, mb_conv) and type(b).__module__ == mb_tv.__name__]
    rows = []
    hooks = [m.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0])) for m in branches]
    x = images(name)
    want, want_grads = run(original, x, 2)
    got, got_grads = run(patched, x, 2)
    assert rows and all(r == BATCH for r in rows)  # dense: BatchNorm over every sample
    if name == "maxvit":  # its attention blocks (no BatchNorm) are routed
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)
    else:
        assert torch.equal(got, want)
        assert all(torch.equal(got_grads[k], w) for k, w in want_grads.items())
    mb_tv.patch(patched, batch_norm="kept")
    rows.clear()
    for seed in range(2, 8):  # several draws: one seed may keep every sample (torch's RNG streams differ by release)
        run(patched, x, seed)
    for h in hooks:
        h.remove()
    assert rows and sum(rows) < BATCH * len(rows)  # routed: BatchNorm over the kept samples


def test_batch_mode_and_schedules_are_read_each_call():
    original, patched, _ = pair("convnext")
    original.train(), patched.train()
    x = images("convnext")
    for mode, p in (("batch", 0.5), ("row", 0.2), ("row", 0.9), ("row", 0.0)):
        for model in (original, patched):
            for m in model.modules():
                if isinstance(m, torchvision.ops.StochasticDepth):
                    m.p, m.mode = p, mode
        for seed in (0, 1):
            want, want_grads = run(original, x, seed)
            got, got_grads = run(patched, x, seed)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)


def test_maskedbranch_stochastic_depth_in_the_slot():
    """A maskedbranch.StochasticDepth with its own generator in a block's slot is honoured."""
    original, patched, _ = pair("convnext")
    for model, seed in ((original, 0), (patched, 0)):
        for b in model.modules():
            if isinstance(b, convnext.CNBlock):
                b.stochastic_depth = mb.DropPath(P, generator=torch.Generator().manual_seed(seed))
    original.train(), patched.train()
    x = images("convnext")
    want, want_grads = run(original, x, 0)
    got, got_grads = run(patched, x, 1)  # another default seed: the generators decide
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("materialize", [True, False])
def test_all_dropped(materialize):
    """p == 1: no branch runs; torchvision's output; the branches' parameters get zeros
    (torchvision's values) or no gradient with materialize_grads=False."""
    original, patched, _ = pair("swin", materialize_grads=materialize)
    for model in (original, patched):
        for m in model.modules():
            if isinstance(m, torchvision.ops.StochasticDepth):
                m.p = 1.0
        model.train()
    x = images("swin")
    want, want_grads = run(original, x, 0)
    with RowCounter(patched, "swin") as rows:
        got, got_grads = run(patched, x, 0)
    assert rows.rows == 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    branch = ".norm1.", ".attn.", ".norm2.", ".mlp."
    for k, g in got_grads.items():
        if k.startswith("features.") and any(b in k for b in branch):
            assert (g is not None) == materialize, k
            assert g is None or torch.count_nonzero(g) == 0, k
        else:
            torch.testing.assert_close(g, want_grads[k], rtol=1e-10, atol=1e-12)


def test_mvit_with_every_sample_dropped_keeps_the_token_grid():
    original, patched, _ = pair("mvit")
    for model in (original, patched):
        for m in model.modules():
            if isinstance(m, torchvision.ops.StochasticDepth):
                m.p = 1.0
        model.train()
    x = images("mvit")
    want, want_grads = run(original, x, 0)
    got, got_grads = run(patched, x, 0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# What stays torchvision's: tracing, scripting, hooks; copies and the API.


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_fx_feature_extraction_and_scripting_see_torchvision():
    from torchvision.models.feature_extraction import create_feature_extractor

    original, patched, _ = pair("convnext", torch.float32)
    x = images("convnext", torch.float32)
    extractor = create_feature_extractor(patched, {"features.1": "f"})
    want = create_feature_extractor(original, {"features.1": "f"})
    original.eval(), extractor.eval(), want.eval()
    assert torch.equal(extractor(x)["f"], want(x)["f"])
    scripted = torch.jit.script(copy.deepcopy(patched).eval())
    assert torch.equal(scripted(x), original(x))


def _halve(module, args):
    return (args[0] * 0.5,)


def _add_one(module, args, out):
    return out + 1


def test_hooks_patch_twice_unpatch_and_copies():
    original, patched, report = pair("convnext")
    again = mb_tv.patch(patched, materialize_grads=False)
    assert not again.converted and sorted(again.already) == sorted(report.converted)
    for model in (original, patched):
        model.features[1][1].register_forward_pre_hook(_halve)
        model.features[1][1].register_forward_hook(_add_one)
        model.train()
    x = images("convnext")
    want, _ = run(original, x, 7)
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    for model in (patched, copy.deepcopy(patched), pickle.loads(pickle.dumps(patched)), torch.load(buf, weights_only=False)):
        assert mb_tv.is_patched(model)
        torch.testing.assert_close(run(model, x, 7)[0], want, rtol=1e-12, atol=1e-12)
    block = patched.features[1][0]
    assert isinstance(block, convnext.CNBlock) and type(block).__module__ == "maskedbranch.integrations.torchvision"
    assert mb_tv.unpatch(patched) == len(report) and not mb_tv.is_patched(patched)
    assert type(block) is convnext.CNBlock


# ----------------------------------------------------------------------------------------------
# Refusals.


def test_refusals_name_the_right_tool():
    with pytest.raises(ValueError, match="ResNet has no torchvision StochasticDepth"):
        mb_tv.patch(torchvision.models.resnet18(num_classes=10))
    with pytest.raises(TypeError, match="model"):
        mb_tv.patch("convnext")
    with pytest.raises(ValueError, match="batch_norm"):
        mb_tv.patch(build("convnext"), batch_norm="sync")
    with pytest.raises(TypeError, match="materialize_grads"):
        mb_tv.patch(build("convnext"), materialize_grads="auto")

    class MyBlock(convnext.CNBlock):
        def forward(self, input):
            return input + self.stochastic_depth(self.block(input))

    model = build("convnext")
    model.features[1][0].__class__ = MyBlock
    with pytest.raises(ValueError, match="(?s)overrides the forward.*ResidualDropPath"):
        mb_tv.patch(model)
    assert not mb_tv.is_patched(model)  # refused before changing anything
    report = mb_tv.patch(model, strict=False)
    assert "features.1.0.stochastic_depth" in report.skipped and len(report) == 3

    sync = build("convnext")
    sync.features[1][0].block.append(nn.SyncBatchNorm(16))
    with pytest.raises(ValueError, match="SyncBatchNorm"):
        mb_tv.patch(sync)


def test_timm_refuses_torchvision_models_with_a_pointer():
    pytest.importorskip("timm")
    from maskedbranch.integrations import timm as mb_timm

    with pytest.raises(ValueError, match="maskedbranch.integrations.torchvision.patch"):
        mb_timm.patch(build("convnext"))
    timm_model = pytest.importorskip("timm").create_model("resnet18", num_classes=10)
    with pytest.raises(ValueError, match="maskedbranch.integrations.timm.patch"):
        mb_tv.patch(timm_model)


# ----------------------------------------------------------------------------------------------
# DDP with find_unused_parameters=False: the patched model trains as DDP of torchvision's model.


def _ddp_run(rank):
    original = build("convnext")
    patched = copy.deepcopy(original)
    mb_tv.patch(patched)
    ddps = [nn.parallel.DistributedDataParallel(m, process_group=dist.new_group(backend="gloo")) for m in (original, patched)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01) for m in ddps]
    rows = []
    hooks = [b.block.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
             for b in patched.modules() if isinstance(b, convnext.CNBlock)]
    worst = 0.0
    for step in range(3):
        x = images("convnext", seed=100 * step + rank)
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
    run_scenarios(rank, world, init_file, out_dir, {"torchvision": lambda r, group: _ddp_run(r)})


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_without_find_unused_parameters_trains_as_torchvision():
    results = results_of(run_ranks(_ddp_worker, 2, 240, "the DDP job"), "torchvision")
    for r, res in enumerate(results):
        assert res["worst_grad"] < 1e-10 and res["params"] < 1e-10, f"rank {r}: {res}"
    rows = [res["rows"] for res in results]  # the rows each branch call saw (none when all dropped)
    assert rows[0] != rows[1]  # the ranks skipped different samples
    assert any(len(r) < 12 or min(r) < BATCH for r in rows)  # samples were skipped


# ----------------------------------------------------------------------------------------------
# torch.compile.


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch, "compile") or torch.__version__ < "2.13", reason="fullgraph capture of routed rows needs torch >= 2.13")
def test_patched_convnext_compiles_whole_and_trains_as_eager():
    torch.compiler.reset()
    _, patched, _ = pair("convnext")
    patched.train()
    twin = copy.deepcopy(patched)
    backend = Counting()
    compiled = torch.compile(twin, backend=backend, fullgraph=True)
    x = images("convnext")
    for step in range(4):
        want, want_grads = run(patched, x, step)
        calls = backend.calls
        got, got_grads = run(compiled, x, step)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        assert_grads_equal({k.removeprefix("_orig_mod."): g for k, g in got_grads.items()}, want_grads, rtol=1e-9, atol=1e-9)
        assert backend.calls > calls, f"step {step} ran no compiled graph"
    assert backend.compiled == 1, backend.compiled  # new masks every step: no new graph
    torch.compiler.reset()
