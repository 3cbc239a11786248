"""DropPath / stochastic depth: semantics against timm and torchvision, equality with the dense
formula under the same mask, statistics, fast paths and argument checks."""
import importlib
import importlib.util
import math

import pytest
import torch
from torch import nn

import maskedbranch as mb

from param_conversion import conversions_replace_parameters

dp_mod = importlib.import_module("maskedbranch.drop_path")  # the module; mb.drop_path is the function

# ----------------------------------------------------------------------------------------------
# Helpers: the formulas we must match.


def draw(batch, keep_prob, seed):
    """The mask maskedbranch draws for ``generator=torch.Generator().manual_seed(seed)``."""
    return torch.empty(batch).bernoulli_(keep_prob, generator=torch.Generator().manual_seed(seed))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def factor(keep_prob, scale_by_keep, dtype):
    if not scale_by_keep or keep_prob == 0.0:
        return 1.0
    return torch.ones((), dtype=dtype).div_(keep_prob).item()


def dense_residual(x, branch, mask, keep_prob, scale_by_keep=True, args=(), kwargs=None):
    """timm's way: the branch runs on every row, then ``x + branch(x) * mask / keep_prob``."""
    y = branch(x, *args, **(kwargs or {}))
    coef = mask.to(torch.float64) * factor(keep_prob, scale_by_keep, x.dtype)
    return x + y * coef.to(y.dtype).reshape(-1, *([1] * (y.dim() - 1)))


def tv_stochastic_depth(input, p, mode, training=True):
    """torchvision.ops.stochastic_depth, written from its documentation: zero the whole input
    ("batch") or random rows ("row") with probability p, scale survivors by 1 / (1 - p)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ("batch", "row"):
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input
    survival = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return input * noise


def timm_drop():
    """timm's drop.py. It only needs torch, but importing the timm package pulls torchvision in;
    without torchvision, load the installed file on its own."""
    try:
        return importlib.import_module("timm.layers.drop")
    except ImportError:
        spec = importlib.util.find_spec("timm")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("timm is not installed")
        path = f"{list(spec.submodule_search_locations)[0]}/layers/drop.py"
        file_spec = importlib.util.spec_from_file_location("_timm_layers_drop", path)
        module = importlib.util.module_from_spec(file_spec)
        try:
            file_spec.loader.exec_module(module)
        except (ImportError, FileNotFoundError) as e:
            pytest.skip(f"timm's drop.py could not be loaded: {e}")
        return module


def mlp(c=8, hidden=16, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(c), nn.Linear(c, hidden), nn.GELU(), nn.Linear(hidden, c)).to(dtype)


def conv_branch(c=6, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.GELU(), nn.Conv2d(2 * c, c, 1))
    return net.to(dtype=dtype, memory_format=torch.channels_last)


TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def grads(x, module):
    return [x.grad] + [p.grad for p in module.parameters()]


def assert_close_all(got, want, dtype):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None or torch.count_nonzero(g) == 0, f"entry {i}"
            continue
        assert g is not None, f"entry {i}: missing gradient"
        tol = dict(TOL[dtype])
        if dtype == torch.bfloat16:  # sums over rows round differently: a few ulp of the largest entry
            tol["atol"] *= max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=f"entry {i}")


def run_both(x0, branch, p, mode, scale_by_keep, seed, dtype, args=(), kwargs=None, backward=True):
    """maskedbranch's residual and the dense formula under the same mask; outputs and grads."""
    keep = 1.0 - p
    x = x0.detach().clone().requires_grad_(True)
    out = mb.drop_add_residual(x, branch, p, True, mode, scale_by_keep, gen(seed), args=args, kwargs=kwargs)
    got = [out.detach()]
    if backward:
        gy = torch.randn(out.shape, generator=gen(seed + 1000)).to(dtype)
        out.backward(gy)
        got += [t.detach().clone() if t is not None else None for t in grads(x, branch)]
    branch.zero_grad(set_to_none=True)

    mask = draw(x0.shape[0] if mode == "row" else 1, keep, seed).expand(x0.shape[0])
    xr = x0.detach().clone().requires_grad_(True)
    ref = dense_residual(xr, branch, mask, keep, scale_by_keep, args, kwargs)
    want = [ref.detach()]
    if backward:
        ref.backward(gy)
        want += [t.detach().clone() if t is not None else None for t in grads(xr, branch)]
    branch.zero_grad(set_to_none=True)
    if mask.sum() == 0:  # all dropped: the dense formula gives the params zero gradients
        want = want[:2] + [None] * (len(want) - 2)
    return got, want, mask


# ----------------------------------------------------------------------------------------------
# drop_path / DropPath: the timm-compatible forms.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("scale_by_keep", [True, False])
def test_drop_path_bitwise_timm(dtype, p, scale_by_keep):
    timm = timm_drop()
    x = torch.randn(37, 3, 5).to(dtype)
    torch.manual_seed(7)
    want = timm.drop_path(x, p, True, scale_by_keep)
    torch.manual_seed(7)
    got = mb.drop_path(x, p, True, scale_by_keep)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [0.2, 0.6, 1.0])
def test_drop_path_bitwise_torchvision_formula(mode, dtype, p):
    x = torch.randn(29, 4, 3).to(dtype)
    for seed in range(6):
        torch.manual_seed(seed)
        want = tv_stochastic_depth(x, p, mode)
        torch.manual_seed(seed)
        got = mb.drop_path(x, p, True, mode=mode)
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_drop_path_matches_real_torchvision(mode):
    tv = pytest.importorskip("torchvision.ops")
    x = torch.randn(17, 6)
    for seed in range(4):
        torch.manual_seed(seed)
        want = tv.stochastic_depth(x, 0.4, mode, True)
        torch.manual_seed(seed)
        assert torch.equal(mb.drop_path(x, 0.4, True, mode=mode), want)


def test_drop_path_module_is_a_timm_drop_in():
    timm = timm_drop()
    for p in (0.0, 0.1, 0.25, 1 / 3):
        assert mb.DropPath(p).extra_repr() == timm.DropPath(p).extra_repr()
        assert repr(mb.DropPath(p)) == repr(timm.DropPath(p))
    ours, theirs = mb.DropPath(0.3), timm.DropPath(0.3)
    x = torch.randn(40, 7, requires_grad=True)
    torch.manual_seed(3)
    a = theirs(x)
    torch.manual_seed(3)
    b = ours(x)
    assert torch.equal(a, b)
    ga, = torch.autograd.grad(a.sum(), x)
    gb, = torch.autograd.grad(b.sum(), x)
    assert torch.equal(ga, gb)
    ours.eval()
    assert ours(x) is x  # identity in eval, no copy
    assert mb.DropPath(0.0).train()(x) is x
    assert "mode=batch" in repr(mb.DropPath(0.2, mode="batch"))


def test_keep_scale_rounds_like_torch():
    # the factor of kept rows is computed in Python (a constant for torch.compile); it must equal
    # torch's own rounding of 1 / keep_prob in each dtype, the value timm and torchvision use
    g = torch.Generator().manual_seed(0)
    keeps = torch.rand(3000, generator=g, dtype=torch.float64).tolist()
    keeps += (torch.rand(300, generator=g, dtype=torch.float64) * 1e-4).tolist()
    keeps += [1.0, 0.5, 0.9, 0.75, 1 / 3, 2.0**-53, 1e-5, 9.002520605120974e-05]
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for k in keeps:
            if k == 0.0:
                continue
            want = torch.ones((), dtype=dtype).div_(k).item()
            got = dp_mod._rounded_inverse(k, dtype)
            assert got == want or (math.isinf(got) and math.isinf(want)), (dtype, k, got, want)


def test_drop_path_tiny_keep_float16_no_nan():
    # 1 / keep_prob overflows float16: kept rows become inf as in timm, dropped ones stay 0
    x = torch.ones(64, 3, dtype=torch.float16)
    for mode in ("row", "batch"):
        out = mb.drop_path(x, 1 - 1e-6, True, mode=mode, generator=gen(0))
        assert not out.isnan().any()


def test_drop_path_identity_and_drop_all():
    x = torch.randn(5, 3)
    assert mb.drop_path(x, 0.5) is x  # training defaults to False, as in timm
    assert mb.drop_path(x, 0.0, True) is x
    x = torch.randn(5, 3, requires_grad=True)
    for mode in ("row", "batch"):
        out = mb.drop_path(x, 1.0, True, mode=mode)
        assert torch.equal(out, torch.zeros_like(x)) and not out.isnan().any()
        g, = torch.autograd.grad(out.sum(), x)
        assert torch.equal(g, torch.zeros_like(x))


def test_drop_path_generator_reproducible_and_default_untouched():
    x = torch.randn(64, 4)
    a = mb.drop_path(x, 0.5, True, generator=gen(11))
    state = torch.get_rng_state()
    b = mb.drop_path(x, 0.5, True, generator=gen(11))
    assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), state)  # an explicit generator leaves the default alone
    rows = (a != 0).any(1).float()
    assert torch.equal(rows, draw(64, 0.5, 11))


# ----------------------------------------------------------------------------------------------
# Statistics with a fixed generator.


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_row_kept_count_within_binomial_bound(p):
    seen = []

    def branch(t):
        seen.append(t.shape[0])
        return t * 2

    batch, calls, keep = 256, 40, 1.0 - p
    g = gen(5)
    x = torch.randn(batch, 3)
    for _ in range(calls):
        mb.drop_add_residual(x, branch, p, True, generator=g)
    n = batch * calls
    kept = sum(seen)  # all-dropped calls don't run the branch
    sigma = math.sqrt(n * keep * (1 - keep))
    assert abs(kept - n * keep) <= 5 * sigma, (kept, n * keep, sigma)


@pytest.mark.parametrize("p", [0.25, 0.5])
def test_batch_kept_fraction_within_binomial_bound(p):
    calls = []
    branch = lambda t: (calls.append(1), t)[1]  # noqa: E731
    g, n, keep = gen(9), 2000, 1.0 - p
    x = torch.randn(2, 3)
    for _ in range(n):
        mb.drop_add_residual(x, branch, p, True, "batch", generator=g)
    sigma = math.sqrt(n * keep * (1 - keep))
    assert abs(len(calls) - n * keep) <= 5 * sigma


def test_mean_output_tends_to_undropped_row():
    # rows are drawn independently: many copies of the same rows in one call are many draws
    branch = mlp(6, 12, torch.float64)
    x = torch.randn(8, 6, dtype=torch.float64)
    p, n = 0.4, 4000
    xs = x.repeat(n, 1)
    with torch.no_grad():
        y = branch(x)
        mean = mb.drop_add_residual(xs, branch, p, True, generator=gen(21)).view(n, 8, 6).mean(0)
        # per element: out = x + y * Bernoulli(1-p) / (1-p); std of the mean = |y| sqrt(p/(1-p)/n)
        assert ((mean - (x + y)).abs() <= 5 * y.abs() * math.sqrt(p / (1 - p) / n) + 1e-9).all()
        # with scale_by_keep=False the mean tends to x + (1-p) y
        mean = mb.drop_add_residual(xs, branch, p, True, scale_by_keep=False, generator=gen(22)).view(n, 8, 6).mean(0)
        assert ((mean - (x + (1 - p) * y)).abs() <= 5 * y.abs() * math.sqrt(p * (1 - p) / n) + 1e-9).all()


def test_mean_output_tends_to_undropped_batch():
    torch.manual_seed(0)
    branch = nn.Linear(6, 6).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    p, n = 0.4, 2000
    g = gen(23)
    with torch.no_grad():
        y = branch(x)
        total = torch.zeros_like(x)
        for _ in range(n):
            total += mb.drop_add_residual(x, branch, p, True, "batch", generator=g)
        assert ((total / n - (x + y)).abs() <= 5 * y.abs() * math.sqrt(p / (1 - p) / n) + 1e-9).all()


# ----------------------------------------------------------------------------------------------
# Equality with the dense formula under the same mask: outputs and all gradients.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("scale_by_keep", [True, False])
def test_residual_matches_dense(dtype, mode, p, scale_by_keep):
    branch = mlp(8, 16, dtype)
    x0 = torch.randn(12, 5, 8).to(dtype)
    for seed in range(4):
        got, want, _ = run_both(x0, branch, p, mode, scale_by_keep, seed, dtype)
        assert_close_all(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,make",
    [((10, 8), lambda dt: mlp(8, 16, dt)), ((10, 4, 8), lambda dt: mlp(8, 16, dt)), ((1, 4, 8), lambda dt: mlp(8, 16, dt))],
    ids=["BC", "BTC", "B1"],
)
def test_residual_shapes(dtype, shape, make):
    branch = make(dtype)
    x0 = torch.randn(shape).to(dtype)
    for seed in range(6):
        got, want, _ = run_both(x0, branch, 0.5, "row", True, seed, dtype)
        assert_close_all(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_residual_channels_last_conv(dtype):
    branch = conv_branch(6, dtype)
    x0 = torch.randn(9, 6, 5, 7).to(dtype).contiguous(memory_format=torch.channels_last)
    saw_partial = False
    for seed in range(6):
        got, want, mask = run_both(x0, branch, 0.5, "row", True, seed, dtype)
        saw_partial |= 0 < int(mask.sum()) < 9
        assert_close_all(got, want, dtype)
        x = x0.clone().requires_grad_(True)
        out = mb.drop_add_residual(x, branch, 0.5, True, generator=gen(seed))
        assert out.is_contiguous(memory_format=torch.channels_last)
    assert saw_partial


def test_residual_non_contiguous_x():
    branch = mlp(8, 16, torch.float64)
    base = torch.randn(8, 12, 10, dtype=torch.float64)
    for x0 in (base.transpose(0, 1)[..., :8], base[::2, :, 1:9], base.permute(1, 0, 2)[:, ::2, :8]):
        assert not x0.is_contiguous()
        for seed in range(4):
            got, want, _ = run_both(x0, branch, 0.5, "row", True, seed, torch.float64)
            assert_close_all(got, want, torch.float64)


def test_residual_autocast_low_precision_branch():
    branch = mlp(8, 16, torch.float32)
    x0 = torch.randn(16, 8)
    for seed in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want, _ = run_both(x0, branch, 0.5, "row", True, seed, torch.bfloat16)
        assert got[0].dtype == torch.float32
        assert_close_all(got, want, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Fast paths and parameter anchoring.


class Spy:
    def __init__(self, monkeypatch):
        self.calls = {}
        for name in ("gather", "combine", "make_plan", "anchor"):
            real = getattr(dp_mod._ops, name)
            monkeypatch.setattr(dp_mod._ops, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def f(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(*a, **k)

        return f


class CountingBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rows = []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.lin(x)


def find_seed(batch, keep, want_kept):
    for seed in range(10000):
        if int(draw(batch, keep, seed).sum()) == want_kept:
            return seed
    raise AssertionError("no seed")


def test_fast_path_nothing_dropped(monkeypatch):
    spy = Spy(monkeypatch)
    branch = CountingBranch()
    x = torch.randn(6, 4, requires_grad=True)
    seed = find_seed(6, 0.9, 6)
    out = mb.drop_add_residual(x, branch, 0.1, True, generator=gen(seed))
    assert spy.calls == {} and branch.rows == [6]
    torch.testing.assert_close(out, x + branch.lin(x) / 0.9)
    out = mb.drop_add_residual(x, branch, 0.0, True)  # p == 0
    assert spy.calls == {}
    out = mb.drop_add_residual(x, branch, 0.5, False)  # eval
    assert spy.calls == {}
    torch.testing.assert_close(out, x + branch.lin(x))


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_fast_path_everything_dropped(monkeypatch, mode):
    spy = Spy(monkeypatch)
    branch = CountingBranch()
    x = torch.randn(6, 4, requires_grad=True)
    out = mb.drop_add_residual(x, branch, 1.0, True, mode)
    assert branch.rows == [] and set(spy.calls) == {"anchor"}
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    # the skipped branch's parameters are in the graph: their gradient hooks fire (what DDP's
    # reducer needs), the gradient itself is undefined; the grad of x passes through
    fired = hook_params(branch)
    out.sum().backward()
    assert fired == {"lin.weight", "lin.bias"}
    assert torch.equal(x.grad, torch.ones_like(x))
    assert branch.lin.weight.grad is None
    fired.clear()
    (x * 1).sum().backward()  # a plain skip: the hooks do not fire
    assert fired == set()


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_everything_dropped_materialized_grads(mode):
    branch = CountingBranch()
    x = torch.randn(6, 4, requires_grad=True)
    mb.drop_add_residual(x, branch, 1.0, True, mode, materialize_grads=True).sum().backward()
    assert branch.rows == []
    for p in branch.parameters():  # zero tensors, not None (FSDP2 reduces defined gradients only)
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    block = mb.ResidualDropPath(CountingBranch(), 1.0, mode, materialize_grads=True)
    block(x).sum().backward()
    assert all(p.grad is not None for p in block.parameters())


def test_skipped_branch_after_a_conversion_replaced_its_parameters():
    """.double() may put new parameter objects in place (overwrite_module_params_on_conversion):
    a dropped branch must anchor the new ones."""
    block = mb.ResidualDropPath(CountingBranch(), 1.0, "batch", materialize_grads=True)
    block(torch.randn(6, 4, requires_grad=True))
    with conversions_replace_parameters():
        block.double()
    block(torch.randn(6, 4, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert all(p.grad is not None and p.dtype == torch.float64 for p in block.parameters())


def test_partial_rows_run_branch_on_kept_rows_only():
    branch = CountingBranch()
    x = torch.randn(32, 4)
    seeds = range(10)
    for s in seeds:
        mb.drop_add_residual(x, branch, 0.5, True, generator=gen(s))
    want = [int(draw(32, 0.5, s).sum()) for s in seeds]
    assert branch.rows == [k for k in want if k > 0]


def test_output_can_be_modified_in_place():
    branch = CountingBranch()
    for p, mode in ((1.0, "row"), (1.0, "batch"), (0.5, "row"), (0.0, "row")):
        x = torch.randn(8, 4, requires_grad=True)
        out = mb.drop_add_residual(x * 1, branch, p, True, mode, generator=gen(3))
        out.relu_()  # e.g. ResNet's in-place ReLU after the residual add
        out.sum().backward()
        assert x.grad is not None


def hook_params(module):
    fired = set()
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.add(name))
    return fired


def test_params_argument_and_bound_methods():
    lin = nn.Linear(4, 4)
    fired = hook_params(lin)
    x = torch.randn(3, 4)
    mb.drop_add_residual(x, lambda t: lin(t), 1.0, True, params=lin.parameters()).sum().backward()
    assert fired == {"weight", "bias"}
    fired.clear()
    mb.drop_add_residual(x, lin.forward, 1.0, True).sum().backward()  # a bound method of a module
    assert fired == {"weight", "bias"}
    fired.clear()
    x.requires_grad_(True)
    mb.drop_add_residual(x, lambda t: lin(t), 1.0, True).sum().backward()  # nothing to anchor
    assert fired == set()


# ----------------------------------------------------------------------------------------------
# ResidualDropPath: the module form, with extra per-row arguments.


class CondBranch(nn.Module):
    """A branch with per-row extras: conditioning (float), a token mask (bool), a scalar."""

    def __init__(self, c=8):
        super().__init__()
        self.lin = nn.Linear(c, c)
        self.cond = nn.Linear(3, c)
        self.rows = []

    def forward(self, x, cond, keep_tokens, gain=1.0, *, bias=None):
        self.rows.append(x.shape[0])
        y = self.lin(x) + self.cond(cond)[:, None, :]
        y = y * keep_tokens[..., None].to(y.dtype) * gain
        return y if bias is None else y + bias


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_residual_module_routes_per_row_args(mode):
    torch.manual_seed(0)
    block = mb.ResidualDropPath(CondBranch(), 0.5, mode=mode)
    b, t, c = 10, 3, 8
    x0 = torch.randn(b, t, c, dtype=torch.float64)
    block.double()
    cond0 = torch.randn(b, 3, dtype=torch.float64)
    tokens = torch.rand(b, t) > 0.3
    bias = torch.randn(c, dtype=torch.float64)  # not per-row (first dim != batch): passed as is
    for seed in range(5):
        block.generator = gen(seed)
        x = x0.clone().requires_grad_(True)
        cond = cond0.clone().requires_grad_(True)
        block.branch.rows.clear()
        out = block(x, cond, tokens, 2.0, bias=bias)
        rows_seen = list(block.branch.rows)
        gy = torch.randn(out.shape, dtype=torch.float64)
        out.backward(gy)
        got = [out, x.grad, cond.grad] + [p.grad for p in block.parameters()]
        block.zero_grad(set_to_none=True)

        mask = draw(b if mode == "row" else 1, 0.5, seed).expand(b)
        xr = x0.clone().requires_grad_(True)
        condr = cond0.clone().requires_grad_(True)
        ref = dense_residual(xr, block.branch, mask, 0.5, True, (condr, tokens, 2.0), dict(bias=bias))
        ref.backward(gy)
        want = [ref, xr.grad, condr.grad] + [p.grad for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        if mask.sum() == 0:
            want = want[:3] + [None] * (len(want) - 3)
        for i, (g, w) in enumerate(zip(got, want)):
            if g is None and w is not None:  # dropped: cond is not in the graph, dense gives zeros
                assert torch.count_nonzero(w) == 0, f"entry {i}, seed {seed}"
            elif w is None:
                assert g is None or torch.count_nonzero(g) == 0
            else:
                torch.testing.assert_close(g, w, msg=f"entry {i}, seed {seed}")
        kept = int(mask.sum())
        assert rows_seen == ([kept] if kept else [])


def test_residual_module_eval_repr_and_state():
    branch = mlp()
    block = mb.ResidualDropPath(branch, 0.25)
    assert "drop_prob=0.250, mode=row" in repr(block)
    assert "scale_by_keep=False" in repr(mb.ResidualDropPath(mlp(), 0.1, "batch", False))
    assert set(block.state_dict()) == {f"branch.{k}" for k in branch.state_dict()}
    block.eval()
    x = torch.randn(4, 3, 8)
    torch.testing.assert_close(block(x), x + branch(x))
    # a generator on the module survives deepcopy (e.g. an EMA copy of the model)
    import copy

    block.generator = gen(1)
    copy.deepcopy(block)


def test_residual_module_refuses_sync_batchnorm():
    block = mb.ResidualDropPath(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)), 0.2)
    with pytest.raises(RuntimeError, match="collectives"):
        block(torch.randn(3, 4))
    block.eval()
    block(torch.randn(3, 4))  # eval: nothing is skipped
    # converted after construction, as nn.SyncBatchNorm.convert_sync_batchnorm(model) does
    block = mb.ResidualDropPath(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), 0.2)
    block(torch.randn(3, 4))
    block = nn.SyncBatchNorm.convert_sync_batchnorm(block)
    with pytest.raises(RuntimeError, match="SyncBatchNorm|collectives"):
        block(torch.randn(3, 4))


# ----------------------------------------------------------------------------------------------
# Bad inputs: clear errors.


BAD_PROBS = [-0.1, 1.5, float("nan"), float("inf")]


@pytest.mark.parametrize("bad", BAD_PROBS)
def test_bad_drop_prob(bad):
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match="drop_prob"):
        mb.drop_path(x, bad, True)
    with pytest.raises(ValueError, match="drop_prob"):
        mb.drop_add_residual(x, lambda t: t, bad, True)
    with pytest.raises(ValueError, match="drop_prob"):
        mb.DropPath(bad)
    with pytest.raises(ValueError, match="drop_prob"):
        mb.ResidualDropPath(nn.Identity(), bad)
    block = mb.ResidualDropPath(nn.Identity(), 0.1)
    block.drop_prob = bad  # set after construction (as drop-path schedules do)
    with pytest.raises(ValueError, match="drop_prob"):
        block(x)


def test_bad_drop_prob_type():
    with pytest.raises(TypeError, match="drop_prob"):
        mb.drop_path(torch.randn(3, 2), "0.5", True)


@pytest.mark.parametrize("bad", ["rows", "sample", None, "Batch"])
def test_bad_mode(bad):
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match="mode"):
        mb.drop_path(x, 0.5, True, mode=bad)
    with pytest.raises(ValueError, match="mode"):
        mb.drop_add_residual(x, lambda t: t, 0.5, True, bad)
    with pytest.raises(ValueError, match="mode"):
        mb.DropPath(0.5, mode=bad)
    with pytest.raises(ValueError, match="mode"):
        mb.ResidualDropPath(nn.Identity(), 0.5, bad)


class FakeCudaGenerator(torch.Generator):
    """Stands in for torch.Generator("cuda") where CUDA is absent."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def cuda_generators():
    gens = [FakeCudaGenerator()]
    if torch.cuda.is_available():
        gens.append(torch.Generator(device="cuda"))
    return gens


def test_wrong_generator_device():
    x = torch.randn(3, 2)
    for g in cuda_generators():
        with pytest.raises(ValueError, match="generator.*CPU"):
            mb.drop_path(x, 0.5, True, generator=g)
        with pytest.raises(ValueError, match="generator.*CPU"):
            mb.drop_add_residual(x, lambda t: t, 0.5, True, generator=g)
        with pytest.raises(ValueError, match="generator"):
            mb.DropPath(0.5, generator=g)
        with pytest.raises(ValueError, match="generator"):
            mb.ResidualDropPath(nn.Identity(), 0.5, generator=g)
    with pytest.raises(TypeError, match="generator"):
        mb.drop_path(x, 0.5, True, generator=123)


def test_bad_x_and_branch():
    with pytest.raises(ValueError, match="x"):
        mb.drop_path(torch.tensor(1.0), 0.5, True)
    with pytest.raises(TypeError, match="branch"):
        mb.drop_add_residual(torch.randn(2, 2), "mlp", 0.5, True)
    with pytest.raises(TypeError, match="branch"):
        mb.ResidualDropPath(lambda t: t, 0.5)
    with pytest.raises(ValueError, match="branch"):  # a residual branch must keep the row shape
        mb.drop_add_residual(torch.randn(8, 4), nn.Linear(4, 3), 0.5, True, generator=gen(find_seed(8, 0.5, 4)))


# ----------------------------------------------------------------------------------------------
# CUDA: no host-device synchronization.

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and mb.WITH_CUDA), reason="needs a GPU and a CUDA build of maskedbranch"
)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_cuda_matches_cpu_without_sync(mode):
    branch = mlp(16, 32, torch.float32).cuda()
    x0 = torch.randn(24, 5, 16, device="cuda")
    gy = torch.randn_like(x0)
    torch.cuda.synchronize()
    for p in (0.0, 0.5, 1.0):
        for seed in range(4):
            x = x0.clone().requires_grad_(True)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = mb.drop_add_residual(x, branch, p, True, mode, generator=gen(seed))
                out.backward(gy)
                y = mb.drop_path(x0, p, True, mode=mode, generator=gen(seed))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            mask = draw(24 if mode == "row" else 1, 1 - p, seed).expand(24).cuda()
            ref = dense_residual(x0, branch, mask, 1 - p)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(y, x0 * (mask * factor(1 - p, True, torch.float32))[:, None, None])
            branch.zero_grad(set_to_none=True)
