"""maskedbranch.integrations.timm: patched timm models against the unpatched ones.

The masks are made identical by seeding torch's default generator before each forward: timm
draws its per-sample mask with ``x.new_empty((B, 1, ...)).bernoulli_(keep_prob)`` and maskedbranch
with ``torch.empty(B).bernoulli_(keep_prob)`` on the host, which consume the same stream (checked
below), in the same order. Every training comparison also checks that the patched model really
computed fewer rows (forward pre-hooks count the rows every leaf module sees) and that the masks
matter (another seed gives another output).
"""
import copy
import io
import os
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import leave_job, results_of, run_ranks
from timm_models import (  # skips the module when timm is not usable
    BATCH,
    DROP,
    DropPath,
    RowCounter,
    assert_grads_equal,
    freeze_batch_norms,
    images,
    mb_timm,
    pair,
    run,
    set_drop_prob,
    timm,
    timm_vit,
    vit,
)

import maskedbranch as mb


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
    leave_job()


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
        blocks = [m for m in clone.modules() if mb_timm.is_patched(m) and not any(mb_timm.is_patched(c) for c in m.children())]
        assert len(blocks) == len(report) and mb_timm.is_patched(clone)  # the blocks, and the model holding them
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
