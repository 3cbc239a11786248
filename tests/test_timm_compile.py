"""Patched timm models under torch.compile: a ViT, ConvNeXt, Swin (whose attention reshapes
with -1, so a branch never sees zero samples) and a BatchNorm family compile whole
(``fullgraph=True``) in training, train as the patched model does in eager mode with the same
seed (same draws), and new masks every step add no graph.

aot_eager everywhere; inductor on the ViT and ConvNeXt (torch >= 2.13, where CI runs it). Tiny
models (tests/timm_models.py).
"""
import copy
import shutil
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import maskedbranch as mb
import timm_models
from harness import Counting
from timm_models import FAMILIES, mb_timm, freeze_batch_norms, images, pair, run, assert_grads_equal, set_drop_prob

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")]

FLAGS_NEEDED = torch.__version__ < "2.13"
TOL = dict(rtol=1e-9, atol=1e-9)
STEPS = 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    counters.clear()
    if FLAGS_NEEDED:
        with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
            yield
    else:
        yield
    torch.compiler.reset()


def check(name, backend, dtype=torch.float64, tol=TOL, steps=STEPS):
    _, patched, _ = pair(name, dtype)
    if name.startswith("resnet"):
        freeze_batch_norms(patched)  # BatchNorm frozen: its branches are routed (see patch's batch_norm)
    twin = copy.deepcopy(patched)
    compiled = torch.compile(twin, backend=backend, fullgraph=True)
    x = images(FAMILIES[name][1], dtype)
    graphs = []
    for step in range(steps):
        want = run(patched, x, step)
        calls = backend.calls
        out, grads = run(compiled, x, step)
        torch.testing.assert_close(out, want[0], **tol)
        assert_grads_equal({k.removeprefix("_orig_mod."): g for k, g in grads.items()}, want[1], **tol)
        assert backend.calls > calls, f"step {step} ran no compiled graph"
        graphs.append(backend.compiled)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] == graphs[-1] == 1, graphs


@pytest.mark.parametrize("name", ["vit", "convnext", "swin", "resnet"])
def test_patched_model_compiles_whole(name):
    check(name, Counting())


INDUCTOR = pytest.mark.skipif(
    torch.__version__ < "2.13" or (shutil.which("c++") is None and shutil.which("g++") is None),
    reason="inductor cases run on torch >= 2.13 with a C++ compiler",
)


@INDUCTOR
def test_patched_vit_through_inductor():
    check("vit", Counting("inductor"), dtype=torch.float32, tol=dict(rtol=1e-3, atol=1e-4), steps=3)


@INDUCTOR
def test_patched_convnext_through_inductor():
    # The CPU setting of docs/guides/compile.md: inductor's CPU layout optimization forces
    # channels_last on every convolution, and PyTorch's fake convolution cannot tell the layout
    # of a batch whose size is data-dependent (the branch's rows), so with it on the compiled
    # step fails its own stride assertions. Per compile, as a user passes
    # options={"layout_optimization": False}.
    import torch._inductor.config as inductor_config

    from maskedbranch._ops import RoutedConvLayoutWarning

    with inductor_config.patch(layout_optimization=False), warnings.catch_warnings():
        warnings.simplefilter("error", RoutedConvLayoutWarning)  # the option set: no warning
        check("convnext", Counting("inductor"), dtype=torch.float32, tol=dict(rtol=1e-3, atol=1e-4), steps=3)



# ----------------------------------------------------------------------------------------------
# Per-block drop rates and schedules: each block draws with its own rate, compiled as eager.


@INDUCTOR
def test_per_block_rates_under_plain_compile_draw_as_eager():
    """Plain ``torch.compile`` (inductor, Dynamo's default configuration, compile caches on) of a
    model whose blocks drop with different rates (timm's linear ``drop_path_rate``): at the same
    seed, the compiled model draws the masks eager draws, so it computes what eager computes.
    (The rate once reached the draw as a ``float`` argument, which inductor's caches served to
    blocks of another rate.)"""
    torch.manual_seed(0)
    patched = timm_models.create("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=5)
    mb_timm.patch(patched)
    assert len({getattr(b.drop_path1, "drop_prob", 0.0) for b in patched.blocks}) == 5  # 0 to DROP
    twin = copy.deepcopy(patched)
    compiled = torch.compile(twin)
    x = images(FAMILIES["vit"][1], torch.float32)
    for step in range(3):
        want = run(patched, x, step)
        out, grads = run(compiled, x, step)
        torch.testing.assert_close(out, want[0], rtol=1e-4, atol=1e-5, msg=f"step {step}")
        assert_grads_equal({k.removeprefix("_orig_mod."): g for k, g in grads.items()}, want[1], rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.6 specializes every float a graph reads (specialize_float): "
                    "each rate recompiles, as it would for any module attribute")
def test_drop_rate_schedule_adds_no_graph():
    """A schedule that raises every block's rate each step: one graph serves every rate once
    Dynamo has made the rates symbolic (a rate specialized into the graph recompiled it at each
    step, until the recompile limit)."""
    _, patched, _ = pair("vit")
    twin = copy.deepcopy(patched)
    backend = Counting()
    compiled = torch.compile(twin, backend=backend, fullgraph=True)
    x = images(FAMILIES["vit"][1])
    graphs = []
    for step in range(5):
        for model in (patched, twin):
            set_drop_prob(model, 0.1 + 0.05 * step)
        want = run(patched, x, step)
        out, grads = run(compiled, x, step)
        torch.testing.assert_close(out, want[0], **TOL)
        graphs.append(backend.compiled)
    assert graphs[1] == graphs[-1] <= 2, graphs


# ----------------------------------------------------------------------------------------------
# Plain torch.compile (Dynamo's default configuration) and batch-mode slots.

NO_FLAGS = dict(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False)
COND = torch.__version__ >= "2.13"


def check_plain(patched, x, steps=5):
    """Plain ``torch.compile`` without the capture flags: equal to eager at the same seed, no
    graph break, one graph for every mask."""
    twin = copy.deepcopy(patched)
    backend = Counting()
    compiled = torch.compile(twin, backend=backend)
    with torch._dynamo.config.patch(**NO_FLAGS), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            want = run(patched, x, step)
            out, grads = run(compiled, x, step)
            torch.testing.assert_close(out, want[0], **TOL)
            assert_grads_equal({k.removeprefix("_orig_mod."): g for k, g in grads.items()}, want[1], **TOL)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.compiled == 1, backend.compiled
    return backend


def test_patched_vit_under_plain_compile_has_no_graph_break():
    """The row drop paths take timm's dense formula with maskedbranch's draws (no flag to
    capture the kept rows' count): no graph break, one graph over steps with new masks, and the
    eager patched model's results."""
    _, patched, _ = pair("vit")
    check_plain(patched, images(FAMILIES["vit"][1]))


def test_batch_mode_slots_run_in_one_cond_each():
    """maskedbranch's DropPath in "batch" mode in a timm model: each slot is one torch.cond
    (torch >= 2.13) that runs its branch or not, under plain torch.compile."""
    _, patched, _ = pair("vit")
    for block in patched.blocks:
        for name in ("drop_path1", "drop_path2"):
            p = getattr(getattr(block, name), "drop_prob", 0.0)
            setattr(block, name, mb.DropPath(p, mode="batch"))
    backend = check_plain(patched, images(FAMILIES["vit"][1]), steps=6)
    if COND:
        assert "cond" in backend.code[0] and "maskedbranch.plan" not in backend.code[0]
