"""DropPath / stochastic depth: the residual forms (drop_add_residual, ResidualDropPath) equal
the dense formula ``x + drop_path(branch(x))`` under the same mask, in outputs and every
gradient; statistics of the draws; the branch runs on the kept rows only; what the parameters of
a skipped branch receive; extra per-row arguments. (Parity with timm and torchvision:
tests/test_peers.py; refused arguments: tests/test_bad_inputs.py; autocast: tests/test_amp.py.)"""
import copy
import math

import pytest
import torch
from torch import nn

import maskedbranch as mb
from harness import GPU, TOL, accumulator_hooks, conversions_replace_parameters


def gen(seed):
    return torch.Generator().manual_seed(seed)


def draw(batch, keep_prob, seed):
    """The mask maskedbranch draws from ``generator=gen(seed)``."""
    return torch.empty(batch).bernoulli_(keep_prob, generator=gen(seed))


def factor(keep_prob, scale_by_keep, dtype):
    """The factor of kept rows as timm computes it (a mask of ``dtype`` divided by keep_prob)."""
    if not scale_by_keep or keep_prob == 0.0:
        return 1.0
    return torch.ones((), dtype=dtype).div_(keep_prob).item()


def dense_residual(x, branch, mask, keep_prob, scale_by_keep=True, args=(), kwargs=None):
    """timm's way: the branch runs on every row, then ``x + branch(x) * mask / keep_prob``."""
    y = branch(x, *args, **(kwargs or {}))
    coef = mask.to(torch.float64) * factor(keep_prob, scale_by_keep, x.dtype)
    return x + y * coef.to(y.dtype).reshape(-1, *([1] * (y.dim() - 1)))


def mlp(c=8, hidden=16, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(c), nn.Linear(c, hidden), nn.GELU(), nn.Linear(hidden, c)).to(dtype)


def forward_backward(fn, x0, branch, grad_seed):
    x = x0.detach().clone().requires_grad_(True)
    out = fn(x)
    gy = torch.randn(out.shape, generator=gen(grad_seed)).to(out.dtype)
    out.backward(gy)
    got = [out.detach(), x.grad] + [p.grad for p in branch.parameters()]
    branch.zero_grad(set_to_none=True)
    return got


def run_both(x0, branch, p, mode, scale_by_keep, seed, args=(), kwargs=None):
    """maskedbranch's residual and the dense formula under the same mask: outputs and grads."""
    got = forward_backward(
        lambda x: mb.drop_add_residual(x, branch, p, True, mode=mode, scale_by_keep=scale_by_keep, generator=gen(seed), args=args, kwargs=kwargs),
        x0, branch, seed + 1000,
    )
    mask = draw(x0.shape[0] if mode == "row" else 1, 1.0 - p, seed).expand(x0.shape[0])
    want = forward_backward(lambda x: dense_residual(x, branch, mask, 1.0 - p, scale_by_keep, args, kwargs), x0, branch, seed + 1000)
    return got, want, mask


def assert_close_all(got, want, dtype):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and w is not None, f"entry {i}: missing gradient"
        tol = dict(TOL[dtype])
        if dtype in (torch.bfloat16, torch.float16):
            # the routed sums over rows skip the dropped rows and scale in float32: a few ulp of
            # the largest entry apart from the dense formula's
            tol["atol"] = 4 * torch.finfo(dtype).eps * max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=f"entry {i}")


# ----------------------------------------------------------------------------------------------
# Equality with the dense formula under the same mask: outputs and all gradients. A skipped
# branch's parameters get zeros by default, as the dense formula gives them.


@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("scale_by_keep", [True, False])
def test_residual_matches_dense(dtype, mode, p, scale_by_keep):
    branch = mlp(8, 16, dtype)
    x0 = torch.randn(12, 5, 8).to(dtype)
    for seed in range(4):
        got, want, _ = run_both(x0, branch, p, mode, scale_by_keep, seed)
        assert_close_all(got, want, dtype)


@pytest.mark.parametrize("shape", [(10, 8), (10, 4, 8), (1, 4, 8)], ids=["BC", "BTC", "B1"])
def test_residual_shapes(shape):
    branch = mlp(8, 16, torch.float64)
    x0 = torch.randn(shape, dtype=torch.float64)
    for seed in range(6):
        assert_close_all(*run_both(x0, branch, 0.5, "row", True, seed)[:2], torch.float64)


def test_residual_channels_last_conv():
    torch.manual_seed(0)
    branch = nn.Sequential(nn.Conv2d(6, 12, 3, padding=1), nn.GELU(), nn.Conv2d(12, 6, 1)).double()
    branch = branch.to(memory_format=torch.channels_last)
    x0 = torch.randn(9, 6, 5, 7, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    partial = 0
    for seed in range(6):
        got, want, mask = run_both(x0, branch, 0.5, "row", True, seed)
        partial += 0 < int(mask.sum()) < 9
        assert_close_all(got, want, torch.float64)
        assert got[0].is_contiguous(memory_format=torch.channels_last)
    assert partial


def test_residual_non_contiguous_x():
    branch = mlp(8, 16, torch.float64)
    base = torch.randn(8, 12, 10, dtype=torch.float64)
    for x0 in (base.transpose(0, 1)[..., :8], base[::2, :, 1:9], base.permute(1, 0, 2)[:, ::2, :8]):
        assert not x0.is_contiguous()
        for seed in range(4):
            assert_close_all(*run_both(x0, branch, 0.5, "row", True, seed)[:2], torch.float64)


def test_gradcheck_float64():
    branch = mlp(4, 6, torch.float64)
    names = [k for k, _ in branch.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in branch.parameters()]
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    seed = next(s for s in range(100) if 0 < int(draw(7, 0.5, s).sum()) < 7)  # some rows dropped

    def fn(x, *ps):
        f = lambda t: torch.func.functional_call(branch, dict(zip(names, ps)), (t,))  # noqa: E731
        return mb.drop_add_residual(x, f, 0.5, True, generator=gen(seed), params=ps)

    assert torch.autograd.gradcheck(fn, (x, *params))


# ----------------------------------------------------------------------------------------------
# Statistics of the draws.


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_row_kept_count_within_binomial_bound(p):
    seen = []

    def branch(t):
        seen.append(t.shape[0])
        return t * 2

    batch, calls, keep, g = 256, 40, 1.0 - p, gen(5)
    x = torch.randn(batch, 3)
    for _ in range(calls):
        mb.drop_add_residual(x, branch, p, True, generator=g)
    n = batch * calls
    assert abs(sum(seen) - n * keep) <= 5 * math.sqrt(n * keep * (1 - keep))


@pytest.mark.parametrize("p", [0.25, 0.5])
def test_batch_kept_fraction_within_binomial_bound(p):
    calls = []
    g, n, keep = gen(9), 2000, 1.0 - p
    x = torch.randn(2, 3)
    for _ in range(n):
        mb.drop_add_residual(x, lambda t: (calls.append(1), t)[1], p, True, mode="batch", generator=g)
    assert abs(len(calls) - n * keep) <= 5 * math.sqrt(n * keep * (1 - keep))


def test_mean_output_tends_to_undropped():
    branch = mlp(6, 12, torch.float64)
    x = torch.randn(8, 6, dtype=torch.float64)
    p, n = 0.4, 4000
    xs = x.repeat(n, 1)  # rows are drawn independently: n copies of a row are n draws
    with torch.no_grad():
        y = branch(x)
        mean = mb.drop_add_residual(xs, branch, p, True, generator=gen(21)).view(n, 8, 6).mean(0)
        # per element: out = x + y * Bernoulli(1-p) / (1-p); std of the mean = |y| sqrt(p/(1-p)/n)
        assert ((mean - (x + y)).abs() <= 5 * y.abs() * math.sqrt(p / (1 - p) / n) + 1e-9).all()
        mean = mb.drop_add_residual(xs, branch, p, True, scale_by_keep=False, generator=gen(22)).view(n, 8, 6).mean(0)
        assert ((mean - (x + (1 - p) * y)).abs() <= 5 * y.abs() * math.sqrt(p * (1 - p) / n) + 1e-9).all()
        total = sum(mb.drop_add_residual(x, branch, p, True, mode="batch", generator=gen(23 + k)) for k in range(2000))
        assert ((total / 2000 - (x + y)).abs() <= 5 * y.abs() * math.sqrt(p / (1 - p) / 2000) + 1e-9).all()


def test_generator_reproducible_and_default_untouched():
    x = torch.randn(64, 4)
    branch = mlp(4, 8)
    for fn in (lambda g: mb.drop_path(x, 0.5, True, generator=g), lambda g: mb.drop_add_residual(x, branch, 0.5, True, generator=g)):
        state = torch.get_rng_state()
        a, b = fn(gen(11)), fn(gen(11))
        assert torch.equal(a, b)
        assert torch.equal(torch.get_rng_state(), state)  # an explicit generator leaves the default alone
    assert torch.equal((mb.drop_path(x, 0.5, True, generator=gen(11)) != 0).any(1).float(), draw(64, 0.5, 11))


def test_tiny_keep_float16_no_nan():
    # 1 / keep_prob overflows float16: kept rows become inf as in timm, dropped ones stay 0
    x = torch.ones(64, 3, dtype=torch.float16)
    for mode in ("row", "batch"):
        assert not mb.drop_path(x, 1 - 1e-6, True, mode=mode, generator=gen(0)).isnan().any()
        assert not mb.drop_add_residual(x, torch.neg, 1 - 1e-6, True, mode=mode, generator=gen(0)).isnan().any()


# ----------------------------------------------------------------------------------------------
# What runs, and what a skipped branch's parameters receive.


class CountingBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x)
        return self.lin(x)


def find_seed(batch, keep, kept):
    return next(s for s in range(10000) if int(draw(batch, keep, s).sum()) == kept)


def test_branch_runs_on_kept_rows_only():
    branch = CountingBranch()
    x = torch.randn(32, 4)
    for s in range(10):
        mb.drop_add_residual(x, branch, 0.5, True, generator=gen(s))
    want = [int(draw(32, 0.5, s).sum()) for s in range(10)]
    assert [t.shape[0] for t in branch.inputs] == [k for k in want if k > 0]
    x = torch.randn(6, 4, requires_grad=True)
    for p, training, g in ((0.1, True, gen(find_seed(6, 0.9, 6))), (0.0, True, None), (0.5, False, None)):
        branch.inputs.clear()
        out = mb.drop_add_residual(x, branch, p, training, generator=g)
        assert len(branch.inputs) == 1 and branch.inputs[0] is x  # nothing dropped: x itself, no copy
        torch.testing.assert_close(out, x + branch.lin(x) * factor(1 - p, training, torch.float32) if training else x + branch.lin(x))


def hooked(module):
    """The names of the parameters whose accumulator ran (DDP's signal), once backward is done."""
    fired = []
    held = accumulator_hooks(list(module.parameters()), fired)
    names = {id(p): k for k, p in module.named_parameters()}
    return lambda: (held, {names[id(p)] for p in fired})[1]


@pytest.mark.parametrize("materialize", [True, False, None], ids=["default-zeros", "undefined", "auto"])
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_everything_dropped(mode, materialize):
    """The branch does not run. Its parameters get zeros by default (the dense formula's value:
    timm's training), an undefined gradient with hooks firing with ``False`` (what DDP needs),
    and nothing in one process with ``None`` (if/else)."""
    for form in ("function", "module"):
        branch = CountingBranch()
        fired = hooked(branch)
        x = torch.randn(6, 4, requires_grad=True)
        kw = {} if materialize is True else {"materialize_grads": materialize}
        if form == "function":
            out = mb.drop_add_residual(x, branch, 1.0, True, mode=mode, **kw)
        else:
            out = mb.ResidualDropPath(branch, 1.0, mode=mode, **kw)(x)
        assert branch.inputs == [] and torch.equal(out, x) and out.data_ptr() != x.data_ptr()
        out.sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))
        assert fired() == (set() if materialize is None else {"lin.weight", "lin.bias"})
        for p in branch.parameters():
            assert (p.grad is not None and torch.count_nonzero(p.grad) == 0) if materialize else p.grad is None


def test_skipped_branch_after_a_conversion_replaced_its_parameters():
    block = mb.ResidualDropPath(CountingBranch(), 1.0, mode="batch")
    block(torch.randn(6, 4, requires_grad=True))
    with conversions_replace_parameters():
        block.double()
    block(torch.randn(6, 4, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert all(p.grad is not None and p.dtype == torch.float64 for p in block.parameters())


def test_output_can_be_modified_in_place():
    branch = CountingBranch()
    for p, mode in ((1.0, "row"), (1.0, "batch"), (0.5, "row"), (0.0, "row")):
        x = torch.randn(8, 4, requires_grad=True)
        out = mb.drop_add_residual(x * 1, branch, p, True, mode=mode, generator=gen(3))
        ref = dense_residual(x * 1, branch, draw(8 if mode == "row" else 1, 1 - p, 3).expand(8), 1 - p)
        out.relu_()  # e.g. ResNet's in-place ReLU after the residual add
        torch.testing.assert_close(out, ref.relu())


def test_params_argument_and_bound_methods():
    x = torch.randn(3, 4)
    for call, tied in [
        (lambda lin: mb.drop_add_residual(x, lambda t: lin(t), 1.0, True, params=lin.parameters()), True),
        (lambda lin: mb.drop_add_residual(x, lin.forward, 1.0, True), True),  # a bound method of a module
        (lambda lin: mb.drop_add_residual(x.requires_grad_(True), lambda t: lin(t), 1.0, True), False),  # nothing to tie
    ]:
        lin = nn.Linear(4, 4)
        fired = hooked(lin)
        call(lin).sum().backward()
        assert fired() == ({"weight", "bias"} if tied else set())
        assert all((p.grad is not None and torch.count_nonzero(p.grad) == 0) == tied for p in lin.parameters())


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
        y = (self.lin(x) + self.cond(cond)[:, None, :]) * keep_tokens[..., None].to(x.dtype) * gain
        return y if bias is None else y + bias


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_residual_module_routes_per_row_args(mode):
    torch.manual_seed(0)
    block = mb.ResidualDropPath(CondBranch(), 0.5, mode=mode).double()
    b, t, c = 10, 3, 8
    x0, cond0 = torch.randn(b, t, c, dtype=torch.float64), torch.randn(b, 3, dtype=torch.float64)
    tokens = torch.rand(b, t) > 0.3
    bias = torch.randn(c, dtype=torch.float64)  # not per-row (first dim != batch): passed as is
    for seed in range(5):
        results = []
        mask = draw(b if mode == "row" else 1, 0.5, seed).expand(b)
        for run in ("ours", "dense"):
            x, cond = x0.clone().requires_grad_(True), cond0.clone().requires_grad_(True)
            block.branch.rows.clear()
            if run == "ours":
                block.generator = gen(seed)
                out = block(x, cond, tokens, 2.0, bias=bias)
                rows = list(block.branch.rows)
            else:
                out = dense_residual(x, block.branch, mask, 0.5, True, (cond, tokens, 2.0), dict(bias=bias))
            out.backward(torch.randn(out.shape, generator=gen(seed), dtype=torch.float64))
            zero = torch.zeros_like
            results.append([out, x.grad, zero(cond) if cond.grad is None else cond.grad] + [p.grad for p in block.parameters()])
            block.zero_grad(set_to_none=True)
        for g, w in zip(*results):
            torch.testing.assert_close(g, w)
        assert rows == ([int(mask.sum())] if mask.sum() else [])


def test_residual_module_eval_repr_state_and_copies():
    branch = mlp()
    block = mb.ResidualDropPath(branch, 0.25)
    assert "drop_prob=0.250, mode=row" in repr(block)
    assert "scale_by_keep=False" in repr(mb.ResidualDropPath(mlp(), 0.1, mode="batch", scale_by_keep=False))
    assert list(block.state_dict()) == [f"branch.{k}" for k in branch.state_dict()]
    x = torch.randn(4, 3, 8)
    torch.testing.assert_close(block.eval()(x), x + branch(x))
    block.generator = gen(1)  # survives deepcopy (an EMA copy of the model), drawing the same
    twin = copy.deepcopy(block).train()
    block.train()
    torch.testing.assert_close(twin(x), block(x))


def test_residual_module_pickles_without_its_branch_wrapper():
    """A whole-module pickle holds the branch, not the wrapper derived from it."""
    import pickle

    block = mb.ResidualDropPath(mlp(), 0.25)
    x = torch.randn(4, 3, 8)
    data = pickle.dumps(block)
    assert b"CheckedBranch" not in data
    loaded = pickle.loads(data)
    torch.testing.assert_close(loaded.eval()(x), block.eval()(x))
    assert loaded._checked_branch.branch is loaded.branch


def test_drop_prob_changed_after_construction():
    """Drop-path schedules set ``drop_prob`` on the modules during training."""
    branch = CountingBranch()
    block = mb.ResidualDropPath(branch, 0.0)
    dp = mb.DropPath(0.0).train()
    x = torch.randn(64, 4)
    block.drop_prob = dp.drop_prob = 1.0
    assert torch.equal(block(x), x) and branch.inputs == []
    assert torch.equal(dp(x), torch.zeros_like(x))


@pytest.mark.cuda
@pytest.mark.skipif(not GPU, reason="needs a GPU and a CUDA build")
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_cuda_matches_dense_without_sync(mode):
    branch = mlp(16, 32, torch.float32).cuda()
    x0 = torch.randn(24, 5, 16, device="cuda")
    gy = torch.randn_like(x0)
    torch.cuda.synchronize()
    for p in (0.0, 0.5, 1.0):
        for seed in range(4):
            x = x0.clone().requires_grad_(True)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = mb.drop_add_residual(x, branch, p, True, mode=mode, generator=gen(seed))
                out.backward(gy)
                y = mb.drop_path(x0, p, True, mode=mode, generator=gen(seed))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            mask = draw(24 if mode == "row" else 1, 1 - p, seed).expand(24).cuda()
            torch.testing.assert_close(out, dense_residual(x0, branch, mask, 1 - p), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(y, x0 * (mask * factor(1 - p, True, torch.float32))[:, None, None])
            branch.zero_grad(set_to_none=True)
