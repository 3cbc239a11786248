"""Mixed precision: MaskedBranch, ResidualDropPath and DropPath under autocast (bfloat16 and
float16 on the CPU; both on CUDA when a GPU is present), mixed dtypes without autocast, and
GradScaler with float16.

What autocast gives, and what these tests hold the library to:

* a branch runs under autocast like any module (a Linear returns the autocast dtype);
* MaskedBranch returns what its branches return (the autocast dtype for Linear/conv branches),
  as the if/else model does; gate weights stay in their dtype and get float32 gradients;
* a float32 residual stream plus a low-precision branch output (ResidualDropPath,
  drop_add_residual) gives float32, as ``x + drop_path(branch(x))`` does;
* parameters and their gradients stay float32.

Tolerances against the float32 model: bfloat16 keeps 8 significant bits (a relative error up to
2**-8 per rounding), float16 11 bits; after two layers the outputs are compared with
``rtol=atol=3e-2`` (bf16) and ``5e-3`` (fp16) - loose enough for rounding, far below the effect
of a wrong row or a dropped branch (O(1)). Gradients sum over rows, so their tolerance scales
with the largest entry.
"""
import copy

import pytest
import torch
from torch import nn

import maskedbranch as mb
from harness import GPU
from maskedbranch import reference

D = 16
B = 12
TOL = {torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}

CPU_DTYPES = [torch.bfloat16, torch.float16]
cuda = pytest.mark.skipif(not GPU, reason="needs a GPU and a CUDA build")


def branch(d=D):
    return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


def gates(n=3, device="cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, n, (B,), generator=g)
    mask = torch.rand(B, n, generator=g) < 0.5
    weights = torch.rand(B, n, generator=g) * mask
    return {"int": 1, "ids": ids, "mask": mask, "weights": weights, "all_dead": -1}


def grads(module):
    return {k: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for k, p in module.named_parameters()}


def autocast_dtype_of(module, x, device_type, dtype):
    with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
        return module(x).dtype


# ----------------------------------------------------------------------------------------------
# MaskedBranch


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("kind", list(gates()))
def test_masked_branch_cpu_autocast(kind, dtype):
    torch.manual_seed(0)
    module = mb.MaskedBranch([branch() for _ in range(3)])
    fp32 = copy.deepcopy(module)
    x = torch.randn(B, D)
    gate = gates()[kind]
    if kind == "weights":
        gate = gate.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        if kind == "all_dead":
            # the dtype of an output no branch produced is learned from tensor-gate calls that
            # ran a branch (a first call with no live row can only run a branch on meta tensors,
            # where CPU autocast does not apply; an int gate keeps no signature, as if/else)
            module(x, torch.zeros(B, dtype=torch.long))
        y = module(x, gate)
    # what autocast gives a branch is what MaskedBranch gives (the if/else model's dtype)
    assert y.dtype == autocast_dtype_of(module[0], x, "cpu", dtype) == dtype
    y_ref = fp32(x, gate.detach() if kind == "weights" else gate)
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])
    if kind != "all_dead":  # (the reference reads an int gate as a Python index)
        with torch.autocast("cpu", dtype=dtype):
            y_ifelse = reference.masked_branch_ifelse(list(module), x, gate.detach() if kind == "weights" else gate)
        torch.testing.assert_close(y.float(), y_ifelse.float(), **TOL[dtype])
    else:
        assert torch.count_nonzero(y) == 0 and not y.requires_grad  # nothing ran (one process)
        return
    # backward: float32 gradients, close to the float32 ones
    w = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    (y.float() * w).sum().backward()
    (y_ref * w).sum().backward()
    for (k, p), (_, q) in zip(module.named_parameters(), fp32.named_parameters()):
        assert (p.grad is None) == (q.grad is None), k
        if p.grad is not None:
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, q.grad, **TOL[dtype], msg=lambda m: f"{k}: {m}")
    if kind == "weights":
        assert gate.grad.dtype == torch.float32


def test_masked_branch_switching_autocast_on_and_off():
    """Training under autocast and evaluating without (or the other way round) on one module:
    each call returns its own dtype (the output signature cache keys on the autocast state)."""
    torch.manual_seed(0)
    module = mb.MaskedBranch([branch() for _ in range(3)])
    x = torch.randn(B, D)
    ids = gates()["ids"]
    assert module(x, ids).dtype == torch.float32
    for gate in (ids, 0, -1):  # a routed call, an int gate, no live row at all
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert module(x, gate).dtype == torch.bfloat16
        assert module(x, gate).dtype == torch.float32
    # a fresh module whose first call is under autocast with an int gate (the other branches are
    # checked on fake tensors, which go through autocast)
    fresh = mb.MaskedBranch([branch() for _ in range(3)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fresh(x, 2).dtype == torch.bfloat16
        assert fresh(x, -1).dtype == torch.bfloat16


def test_masked_branch_mixed_output_dtypes_are_refused_under_autocast():
    """A branch that stays float32 under autocast next to one that does not: refused as without
    autocast (the outputs disagree), not silently combined."""
    torch.manual_seed(0)
    module = mb.MaskedBranch([nn.Linear(D, D), nn.Sequential(nn.Tanh())])
    x = torch.randn(B, D)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="same trailing shape and dtype"):
        module(x, torch.tensor([0, 1] * (B // 2)))


# ----------------------------------------------------------------------------------------------
# ResidualDropPath / DropPath


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_residual_drop_path_cpu_autocast(mode, dtype):
    torch.manual_seed(0)
    module = mb.ResidualDropPath(branch(), 0.5, mode=mode).train()
    fp32 = copy.deepcopy(module)
    x = torch.randn(B, 5, D)
    for seed in range(3):
        module.zero_grad(set_to_none=True), fp32.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=dtype):
            y = module(x)
        torch.manual_seed(seed)
        y_ref = fp32(x)
        # float32 stream + low-precision branch: float32, as x + drop_path(branch(x)) gives
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, y_ref, **TOL[dtype])
        y.square().sum().backward()
        y_ref.square().sum().backward()
        for (k, p), (_, q) in zip(module.named_parameters(), fp32.named_parameters()):
            assert (p.grad is None) == (q.grad is None), k
            if p.grad is not None:
                assert p.grad.dtype == torch.float32
                torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-2 * q.grad.abs().max().item())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_residual_drop_path_low_precision_stream(dtype):
    """A stream already in the low dtype stays in it."""
    torch.manual_seed(0)
    module = mb.ResidualDropPath(branch(), 0.5).train()
    x = torch.randn(B, D).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        assert module(x).dtype == dtype


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_drop_path_cpu_autocast(dtype):
    """DropPath scales the branch output in its own dtype (as timm's x * mask does)."""
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    dp = mb.DropPath(0.4).train()
    x = torch.randn(B, D)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=dtype):
        h = lin(x)
        y = dp(h)
    assert y.dtype == h.dtype == dtype
    torch.manual_seed(1)
    want = mb.drop_path(h.float(), 0.4, True)
    torch.testing.assert_close(y.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_residual_low_precision_branch_on_float32_stream_without_autocast(mode, dtype):
    """A branch that computes in a low dtype of its own on a float32 stream: float32 out, as
    ``x + drop_path(branch(x))`` promotes, and the same values up to the branch's rounding."""

    class LowPrecision(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = branch().to(dtype)

        def forward(self, x):
            return self.f(x.to(dtype))

    torch.manual_seed(0)
    block = mb.ResidualDropPath(LowPrecision(), 0.5, mode=mode).train()
    x = torch.randn(B, D)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        block.generator = gen
        y = block(x)
        assert y.dtype == torch.float32
        keep = torch.empty(B if mode == "row" else 1).bernoulli_(0.5, generator=torch.Generator().manual_seed(seed))
        want = x + mb.drop_path(block.branch(x), 0.0) * (keep.expand(B)[:, None] / 0.5).to(dtype)
        torch.testing.assert_close(y, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_masked_branch_weights_under_autocast(dtype):
    """Float32 weights with low-precision branch outputs: weighted like the if/else model,
    float32 gradients for the weights close to the float32 model's."""
    torch.manual_seed(0)
    module = mb.MaskedBranch([branch() for _ in range(3)])
    x = torch.randn(B, D)
    w = gates()["weights"].requires_grad_(True)
    w32 = w.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype):
        y = module(x, w)
    y32 = module(x, w32)
    torch.testing.assert_close(y.float(), y32, **TOL[dtype])
    y.float().square().sum().backward()
    y32.square().sum().backward()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, w32.grad, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * w32.grad.abs().max().item())


# ----------------------------------------------------------------------------------------------
# GradScaler with float16.


def _scaler_run(device, materialize, inject_inf=False, steps=4):
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"pre": nn.Linear(D, D), "mb": mb.MaskedBranch([branch() for _ in range(3)], materialize_grads=materialize),
         "rdp": mb.ResidualDropPath(branch(), 0.5)}
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    data = torch.Generator().manual_seed(1)
    scales, skipped = [], []
    for step in range(steps):
        x = torch.randn(B, D, generator=data).to(device)
        gate = torch.randint(-1, 2, (B,), generator=data)  # branch 2 never used: zero/None grads
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with torch.autocast(device, dtype=torch.float16):
            h = model["pre"](x)
            out = model["rdp"](model["mb"](h, gate).float() + h)
            loss = out.float().square().mean()
        scaler.scale(loss).backward()
        if inject_inf and step == 1:
            model["pre"].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return model, scales, skipped


def _plain_fp16_run(device, materialize, steps=4):
    """The same training without a scaler (the float16 forward is the same; gradients differ
    only by the rounding the scaling avoids)."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"pre": nn.Linear(D, D), "mb": mb.MaskedBranch([branch() for _ in range(3)], materialize_grads=materialize),
         "rdp": mb.ResidualDropPath(branch(), 0.5)}
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(B, D, generator=data).to(device)
        gate = torch.randint(-1, 2, (B,), generator=data)
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with torch.autocast(device, dtype=torch.float16):
            h = model["pre"](x)
            out = model["rdp"](model["mb"](h, gate).float() + h)
            loss = out.float().square().mean()
        loss.backward()
        opt.step()
    return model


def _check_scaler(device):
    for materialize in (None, False, True):
        model, scales, skipped = _scaler_run(device, materialize)
        assert not any(skipped) and scales == [2.0**10] * 4
        plain = _plain_fp16_run(device, materialize)
        for (k, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=lambda m: f"{k}: {m}")
        unused = model["mb"][2][0].weight
        assert unused.grad is None if not materialize else torch.count_nonzero(unused.grad) == 0
        # an inf gradient: the step is skipped and the scale backs off
        model, scales, skipped = _scaler_run(device, materialize, inject_inf=True)
        assert skipped == [False, True, False, False]
        assert scales[1] == scales[0] / 2


def test_grad_scaler_cpu_float16():
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler needs torch >= 2.3")
    try:
        torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            assert nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float16
    except (RuntimeError, AssertionError) as e:  # older torch: no float16 autocast on the CPU
        pytest.skip(f"float16 autocast / GradScaler on the CPU unsupported here: {e}")
    _check_scaler("cpu")


# ----------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast(dtype):
    torch.manual_seed(0)
    module = mb.MaskedBranch([branch() for _ in range(3)]).cuda()
    fp32 = copy.deepcopy(module)
    x = torch.randn(B, D, device="cuda")
    for kind, gate in gates().items():
        with torch.autocast("cuda", dtype=dtype):
            y = module(x, gate)
        assert y.dtype == dtype, kind
        torch.testing.assert_close(y.float(), fp32(x, gate), **TOL[dtype])
        y.float().sum().backward()
    rdp = mb.ResidualDropPath(branch(), 0.5).cuda().train()
    rdp_ref = copy.deepcopy(rdp)
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.autocast("cuda", dtype=dtype):
            y = rdp(x)
        torch.manual_seed(seed)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, rdp_ref(x), **TOL[dtype])
    with torch.autocast("cuda", dtype=dtype):
        h = nn.Linear(D, D).cuda()(x)
        assert mb.DropPath(0.3).train()(h).dtype == dtype


@pytest.mark.cuda
@cuda
def test_cuda_grad_scaler_float16():
    _check_scaler("cuda")
