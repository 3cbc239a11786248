"""MaskedBranch and masked_branch against the references (maskedbranch/reference.py: the dense
0/1 formula and the if/else model): outputs and every gradient (inputs, parameters, gate
weights) for each gate kind, float64 gradcheck, extra per-row arguments, BatchNorm, the
no-live-row case, branches that disagree, in-place ops. (What a branch that did not run gives
its parameters: tests/test_tied_params.py; the ModuleList behaviour: tests/test_module_list.py.)"""
import copy

import numpy as np
import pytest
import torch
from torch import nn

from maskedbranch import MaskedBranch, masked_branch, reference
from harness import GPU

N, B, D_IN, D_OUT = 3, 10, 5, 4


def make_branches(n=N, d_in=D_IN, d_out=D_OUT, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(d_in, 7), nn.Tanh(), nn.Linear(7, d_out)).to(dtype) for _ in range(n)]


def gates(batch=B, n=N, seed=1):
    """One gate of every kind, with rows that reach no branch and a branch no row reaches."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, n - 1, (batch,), generator=g)  # branch n-1 is never chosen
    ids[0], ids[1] = -1, 0
    mask = torch.rand(batch, n, generator=g) < 0.5
    mask[0] = False
    mask[:, n - 1] = False
    weights = torch.rand(batch, n, generator=g, dtype=torch.float64) * mask
    return {"int": 1, "ids": ids, "mask": mask, "weights": weights}


def fresh(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


# ----------------------------------------------------------------------------------------------
# Outputs and gradients.


@pytest.mark.parametrize("kind", ["int", "ids", "mask", "weights"])
def test_matches_references(kind):
    gate = gates()[kind]
    m = MaskedBranch(make_branches())
    dense, ifelse = copy.deepcopy(m), copy.deepcopy(m)
    if kind == "weights":
        gate = gate.clone().requires_grad_(True)
    gate_d, gate_i = (fresh(gate), fresh(gate)) if kind == "weights" else (gate, gate)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    x_d, x_i = fresh(x), fresh(x)
    grad_out = torch.randn(B, D_OUT, dtype=torch.float64)

    out = m(x, gate)
    out_d = reference.masked_branch_dense(list(dense), x_d, gate_d)
    out_i = reference.masked_branch_ifelse(list(ifelse), x_i, gate_i)
    torch.testing.assert_close(out, out_d)
    torch.testing.assert_close(out, out_i)
    for o in (out, out_d, out_i):
        o.backward(grad_out)
    torch.testing.assert_close(x.grad, x_d.grad)
    torch.testing.assert_close(x.grad, x_i.grad)
    # parameters: the if/else model's gradients, None for a branch that did not run (one process)
    for p, pd, pi in zip(m.parameters(), dense.parameters(), ifelse.parameters()):
        assert (p.grad is None) == (pi.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, pd.grad)
            torch.testing.assert_close(p.grad, pi.grad)
        else:
            assert pd.grad is None or torch.count_nonzero(pd.grad) == 0  # the dense formula's zeros
    if kind == "weights":
        nz = gate.detach() != 0
        torch.testing.assert_close(gate.grad[nz], gate_d.grad[nz])  # the dense formula's value
        torch.testing.assert_close(gate.grad[nz], gate_i.grad[nz])
        assert torch.count_nonzero(gate.grad[~nz]) == 0  # the branch never ran there
        assert torch.count_nonzero(gate_d.grad[~nz]) > 0  # where dense differs


def test_gradcheck_float64():
    m = MaskedBranch(make_branches())
    names = [k for k, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in m.parameters()]
    g = gates()
    pattern = g["weights"] != 0
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    values = g["weights"][pattern].clone().requires_grad_(True)

    def run(gate, x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x, gate))

    # weights: only the nonzero entries vary (making a zero entry nonzero changes the routing)
    def weighted(x, values, *ps):
        return run(torch.zeros(B, N, dtype=torch.float64).masked_scatter(pattern, values), x, *ps)

    assert torch.autograd.gradcheck(weighted, (x, values, *params))
    for kind in ("int", "ids", "mask"):
        assert torch.autograd.gradcheck(lambda x, *ps: run(g[kind], x, *ps), (x, *params))


def test_gate_weights_in_another_dtype():
    m = MaskedBranch(make_branches(dtype=torch.float64))
    w32 = gates()["weights"].float().requires_grad_(True)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    out = m(x, w32)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference.masked_branch_ifelse(list(m), x, w32.detach().double()))
    out.sum().backward()
    assert w32.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_id_dtypes_and_scalar_gates(dtype):
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64)
    ids = gates()["ids"]
    if dtype != torch.uint8:  # (no -1 in uint8)
        torch.testing.assert_close(m(x, ids.to(dtype)), reference.masked_branch_ifelse(list(m), x, ids))
    torch.testing.assert_close(m(x, ids.clamp(min=0).to(dtype)), reference.masked_branch_ifelse(list(m), x, ids.clamp(min=0)))
    torch.testing.assert_close(m(x, torch.tensor(2, dtype=dtype)), m[2](x))
    torch.testing.assert_close(m(x, np.int64(1)), m[1](x))


def test_int_gate_is_the_branch():
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    for _ in range(2):  # the first call builds the cache, the second takes the fast path
        out = m(x, 2)
        assert torch.equal(out, m[2](x))
        assert out.grad_fn.name() == m[2](x).grad_fn.name()  # nothing wrapped around it


def test_all_rows_to_one_branch_is_the_branch():
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    for gate in (torch.full((B,), 1), torch.zeros(B, N, dtype=torch.bool).index_fill_(1, torch.tensor([1]), True)):
        assert torch.equal(m(x, gate), m[1](x))


def test_deterministic():
    m = MaskedBranch(make_branches(dtype=torch.float32))
    x = torch.randn(64, D_IN, requires_grad=True)
    gate = torch.randint(-1, N, (64,))
    results = []
    for _ in range(2):
        x.grad = None
        out = m(x, gate)
        out.pow(2).sum().backward()
        results.append((out.detach(), x.grad.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_conv_branches_4d():
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 1)).double() for _ in range(3)]
    m = MaskedBranch(branches)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    gate = torch.tensor([0, 2, -1, 2, 0, 0])
    out = m(x, gate)
    torch.testing.assert_close(out, reference.masked_branch_ifelse(branches, x, gate))
    assert out.shape == (6, 4, 5, 5)
    out.sum().backward()
    assert torch.count_nonzero(x.grad[2]) == 0


def test_functional_form():
    branches = make_branches()
    m = MaskedBranch(branches)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    for gate in gates().values():
        torch.testing.assert_close(masked_branch(branches, x, gate), m(x, gate))
    fns = [torch.sin, torch.cos, lambda t: 2 * t]  # plain functions as branches
    ids = gates()["ids"]
    torch.testing.assert_close(masked_branch(fns, x, ids), reference.masked_branch_ifelse(fns, x, ids))
    out = masked_branch(fns, x, torch.full((B,), -1))
    assert out.shape == x.shape and torch.count_nonzero(out) == 0


# ----------------------------------------------------------------------------------------------
# Extra per-row arguments.


class Conditioned(nn.Module):
    """A branch with per-row conditioning, a per-row mask, a shared tensor and a scalar."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D_OUT).double()
        self.cond = nn.Linear(2, D_OUT).double()

    def forward(self, x, cond, shared, scale=1.0, mask=None):
        y = self.lin(x) + self.cond(cond) + shared
        return scale * (y if mask is None else y * mask[:, None])


def test_extra_per_row_args():
    torch.manual_seed(0)
    branches = [Conditioned() for _ in range(N)]
    m = MaskedBranch(branches)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    cond = torch.randn(B, 2, dtype=torch.float64, requires_grad=True)
    shared = torch.randn(D_OUT, dtype=torch.float64, requires_grad=True)  # not per-row: unchanged
    mask = torch.rand(B) < 0.7  # a bool per-row mask: routed without a gradient
    gate = gates()["weights"]
    out = m(x, gate, cond, shared, scale=0.5, mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    x2, cond2, shared2 = fresh(x), fresh(cond), fresh(shared)
    ref = torch.zeros(B, D_OUT, dtype=torch.float64)
    for i, br in enumerate(branches):
        r = gate[:, i].nonzero().flatten()
        ref = ref.index_add(0, r, br(x2[r], cond2[r], shared2, scale=0.5, mask=mask[r]) * gate[r, i, None])
    torch.testing.assert_close(out, ref)
    ref.backward(grad_out)
    for a, b in zip([x.grad, cond.grad, shared.grad], [x2.grad, cond2.grad, shared2.grad]):
        torch.testing.assert_close(a, b)
    # int gate: everything passed through unchanged
    torch.testing.assert_close(m(x, 1, cond, shared, mask=mask), branches[1](x, cond, shared, mask=mask))


# ----------------------------------------------------------------------------------------------
# BatchNorm in a branch: each branch normalizes its own rows, as with if/else.


def test_batchnorm_matches_ifelse():
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(D_IN, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, D_OUT)).double() for _ in range(N)]
    m = MaskedBranch(branches)
    ref = copy.deepcopy(m)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(32, D_IN, dtype=torch.float64)
        gate = torch.randint(0, N, (32,), generator=g)
        gate[:6] = torch.tensor([0, 0, 1, 1, 2, 2])  # every branch gets >= 2 rows
        out, out_ref = m(x, gate), reference.masked_branch_ifelse(list(ref), x, gate)
        torch.testing.assert_close(out, out_ref)
        out.pow(2).sum().backward()
        out_ref.pow(2).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    for b, c in zip(m.buffers(), ref.buffers()):
        torch.testing.assert_close(b, c)
    before = [br[1].running_mean.clone() for br in m]
    m(torch.randn(8, D_IN, dtype=torch.float64), 2)  # int gate: only that branch's statistics move
    assert torch.equal(m[0][1].running_mean, before[0]) and not torch.equal(m[2][1].running_mean, before[2])


# ----------------------------------------------------------------------------------------------
# No row reaches any branch.


@pytest.mark.parametrize("kind", ["int", "ids", "mask", "weights"])
@pytest.mark.parametrize("first_call", [True, False])
def test_no_live_row(kind, first_call):
    """Zeros shaped as the branches' output (learned from an earlier call, or found by running a
    branch on meta tensors); like the if/else model that ran nothing, no graph in one process."""
    m = MaskedBranch(make_branches(d_out=D_OUT))
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    if not first_call:
        m(x, gates()["ids"])
    gate = {
        "int": -1,
        "ids": torch.full((B,), -1),
        "mask": torch.zeros(B, N, dtype=torch.bool),
        "weights": torch.zeros(B, N, dtype=torch.float64, requires_grad=True),
    }[kind]
    out = m(x, gate)
    assert out.shape == (B, D_OUT) and out.dtype == torch.float64  # shape from the branches, not x
    assert torch.count_nonzero(out) == 0 and not out.requires_grad


def test_empty_batch():
    m = MaskedBranch(make_branches())
    x = torch.randn(0, D_IN, dtype=torch.float64, requires_grad=True)
    for gate in (torch.empty(0, dtype=torch.long), torch.empty(0, N, dtype=torch.bool), 1):
        assert m(x, gate).shape == (0, D_OUT)


def test_no_live_row_without_meta_support():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x[x.sum(1) > -1e9]  # data-dependent: cannot run on meta tensors

    m = MaskedBranch([DataDependent(), DataDependent()])
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="no row reached any branch.*Make one call with at least one live row"):
        m(x, torch.full((4,), -1))
    m(x, torch.tensor([0, 1, 0, -1]))  # a live call teaches the output signature
    out = m(x, torch.full((4,), -1))
    assert out.shape == (4, 3) and torch.count_nonzero(out) == 0


# ----------------------------------------------------------------------------------------------
# Branches that do not fit (each error leaves the module working).


def test_branches_disagreeing():
    x = torch.randn(B, D_IN, dtype=torch.float64)
    half = torch.tensor([0, 1] * (B // 2))
    m = MaskedBranch([nn.Linear(D_IN, 3).double(), nn.Linear(D_IN, 4).double()])
    with pytest.raises(ValueError, match=r"branches\[1\] returns rows of shape \[4\].*branches\[0\] rows of shape \[3\].*same trailing shape"):
        m(x, half)
    with pytest.raises(ValueError, match=r"branches\[1\] would return rows of shape \[4\].*first call with inputs like these"):
        m(x, torch.zeros(B, dtype=torch.long))  # no row reaches branch 1: checked on meta tensors

    class NoMeta(nn.Module):  # cannot run on meta tensors: compared when it first runs
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D_IN, 4).double()

        def forward(self, x):
            assert x.device.type != "meta"
            return self.lin(x)

    m = MaskedBranch([nn.Linear(D_IN, 3).double(), NoMeta()])
    m(x, torch.zeros(B, dtype=torch.long))  # in calls of their own, learned per input signature
    with pytest.raises(ValueError, match=r"branches\[1\].*branches\[0\] \(in an earlier call with inputs like these\)"):
        m(x, torch.ones(B, dtype=torch.long))

    class ToFloat(nn.Module):
        def forward(self, x):
            return x.float()

    m = MaskedBranch([nn.Linear(D_IN, 3).double(), nn.Sequential(nn.Linear(D_IN, 3).double(), ToFloat())])
    with pytest.raises(ValueError, match=r"dtype torch\.float32.*same trailing shape and dtype"):
        m(x, half)
    torch.testing.assert_close(m(x, 0), m[0](x))


class Changing(nn.Module):
    change = None

    def forward(self, x):
        return x if self.change is None else self.change(x)


@pytest.mark.parametrize("gate", [torch.tensor([0, 1] * (B // 2)), torch.tensor([0] * B)], ids=["ids", "ids-one-branch"])
def test_branch_output_checked(gate):
    """A tensor gate combines rows: one row out per row in, and a tensor, on every call."""
    branch = Changing()
    m = MaskedBranch([branch, nn.Identity()])
    x = torch.randn(B, 3, dtype=torch.float64)
    for _ in range(2):
        m(x, gate)
    for change, exc, match in [(lambda t: t[:1], ValueError, "one row per input row"), (lambda t: (t,), TypeError, "return a tensor")]:
        branch.change = change
        with pytest.raises(exc, match=rf"branches\[0\].*{match}"):
            m(x, gate)
    branch.change = None
    torch.testing.assert_close(m(x, gate), x)


def test_int_gate_returns_what_the_branch_returns():
    """An int gate is if/else: the chosen branch's output, whatever it is (multi-task heads of
    different sizes, a tuple), in a training loop as between steps."""
    heads = MaskedBranch([nn.Linear(3, 2), nn.Linear(3, 5), Changing()])
    heads[2].change = lambda t: (t, t.sum())
    opt = torch.optim.SGD(heads.parameters(), lr=0.1)
    x = torch.randn(B, 3)
    for step in range(4):
        for k, width in ((0, 2), (1, 5)):
            y = heads(x, k)
            assert y.shape == (B, width)
            y.sum().backward()
        out = heads(x, 2)
        assert isinstance(out, tuple) and out[0] is x
        opt.step()
        opt.zero_grad()
    assert heads(x[:1], 1).shape == (1, 5)


@pytest.mark.parametrize("kind", ["ids", "mask", "weights"])
def test_branches_modifying_their_input_in_place(kind):
    """Each branch gets its rows as a tensor of its own: in-place ops on it (a leading
    ReLU(inplace=True)) neither fail nor disturb the other branches' saved inputs."""
    torch.manual_seed(0)
    m = MaskedBranch([
        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(D_IN, D_OUT)).double(),
        nn.Linear(D_IN, D_OUT).double(),
        nn.Sequential(nn.Tanh(), nn.Linear(D_IN, D_OUT)).double(),
    ])
    g = torch.Generator().manual_seed(5)
    gate = {
        "ids": torch.arange(B) % N,
        "mask": torch.rand(B, N, generator=g) < 0.6,
        "weights": torch.rand(B, N, generator=g, dtype=torch.float64),
    }[kind]
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    x2 = fresh(x)
    out, ref = m(x + 0, gate), reference.masked_branch_ifelse(list(m), x2 + 0, gate)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("materialize", [None, False, True])
@pytest.mark.parametrize("gate", [0, 1, "ids"])
def test_inplace_on_output(gate, materialize):
    """In-place ops on the output (nn.ReLU(inplace=True) after it) give the if/else model's
    gradients, also when a branch returns its input (the int gate returns what the branch
    returns, as if/else does; the tie of dead branches is a copy)."""
    m = MaskedBranch([nn.Identity(), *make_branches(2, D_IN, D_IN)], materialize_grads=materialize)
    g = gate if isinstance(gate, int) else torch.tensor([1, 0, 1, -1, 0, 1, 1, 0, 0, 1])
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    x_ref = fresh(x)
    ref_m = copy.deepcopy(m)
    out = m(x * 1, g)
    out.relu_()
    out.square().sum().backward()
    want = reference.masked_branch_ifelse(list(ref_m), x_ref * 1, g, N)
    want.relu_()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, q in zip(m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(p.grad, q.grad if q.grad is not None or materialize is not True else torch.zeros_like(q))


# ----------------------------------------------------------------------------------------------
# CUDA: host-device synchronizations.


@pytest.mark.cuda
@pytest.mark.skipif(not GPU, reason="needs a GPU and a CUDA build")
def test_cuda_matches_cpu_and_syncs():
    m_cpu = MaskedBranch(make_branches(dtype=torch.float32))
    m = copy.deepcopy(m_cpu).cuda()
    x_cpu = torch.randn(64, D_IN)
    x = x_cpu.cuda().requires_grad_(True)
    host_gates = [torch.randint(-1, N, (64,)), torch.rand(64, N) < 0.5, torch.rand(64, N) * (torch.rand(64, N) < 0.5)]
    for gate in [1, *host_gates]:
        m(x, gate).sum().backward()  # warm up (first-call checks, allocator)
    torch.cuda.synchronize()
    for gate in [1, *host_gates]:
        torch.testing.assert_close(m(x, gate).cpu(), m_cpu(x_cpu, gate), atol=1e-5, rtol=1e-4)
        torch.cuda.set_sync_debug_mode("error")
        try:
            m(x, gate).sum().backward()  # int and host gates: no synchronization at all
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_tensor_gate_checks_every_branch_at_the_first_call():
    """A branch that disagrees on the output's trailing shape or dtype fails at the first call
    with a tensor gate, though no row reaches it (checked on meta tensors), not hours later when
    a row first does; the module keeps working for the int gate, which returns what its branch
    returns."""
    m = MaskedBranch([nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(3, 5)])
    x = torch.randn(B, 3)
    for gate in (torch.tensor([0, 1] * (B // 2)), torch.zeros(B, 3, dtype=torch.bool).index_fill_(1, torch.tensor([0]), True)):
        with pytest.raises(ValueError, match=r"branches\[2\] would return rows of shape \[5\].*branches\[0\] returns rows of shape \[4\]"):
            m(x, gate)
    assert m(x, 2).shape == (B, 5) and m(x, 0).shape == (B, 4)
    half = MaskedBranch([nn.Linear(3, 4), nn.Linear(3, 4).double()])
    with pytest.raises(ValueError, match=r"branches\[1\] would return rows of shape \[4\] and dtype torch.float64"):
        half(x, torch.zeros(B, dtype=torch.long))
