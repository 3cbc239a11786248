"""MaskedBranch against the references: outputs, every gradient (inputs, parameters, gate
weights), argument checks, the no-live-row case, extra per-row arguments, BatchNorm, no-grad."""
import copy

import pytest
import torch
from torch import nn

import maskedbranch as mb
from maskedbranch import MaskedBranch, masked_branch, reference

from param_conversion import conversions_replace_parameters

N, B, D_IN, D_OUT = 3, 10, 5, 4


def make_branches(n=N, d_in=D_IN, d_out=D_OUT, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(d_in, 7), nn.Tanh(), nn.Linear(7, d_out)).to(dtype) for _ in range(n)
    ]


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


def dense_coef(gate, batch=B, n=N, dtype=torch.float64):
    if isinstance(gate, int):
        c = torch.zeros(batch, n, dtype=dtype)
        if gate >= 0:
            c[:, gate] = 1
        return c
    return reference.live_mask(gate, n).to(dtype) if gate.dim() == 1 else gate.to(dtype)


def grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def zero_grads(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


def all_params_in_graph(out, params):
    """Whether every parameter has an AccumulateGrad node in out's graph (so its hooks fire)."""
    seen, stack, found = set(), [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            found.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions)
    return all(id(p) in found for p in params)


# ----------------------------------------------------------------------------------------------
# Outputs and gradients.


@pytest.mark.parametrize("kind", ["int", "ids", "mask", "weights"])
@pytest.mark.parametrize("materialize", [False, True])
def test_matches_references(kind, materialize):
    gate = gates()[kind]
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    dense = copy.deepcopy(m)
    ifelse = copy.deepcopy(m)
    if kind == "weights":
        gate = gate.clone().requires_grad_(True)
        gate_d = gate.detach().clone().requires_grad_(True)
        gate_i = gate.detach().clone().requires_grad_(True)
    else:
        gate_d = gate_i = gate
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    x_d = x.detach().clone().requires_grad_(True)
    x_i = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(B, D_OUT, dtype=torch.float64)

    out = m(x, gate)
    out_d = reference.masked_branch_dense(list(dense.branches), x_d, gate_d)
    out_i = reference.masked_branch_ifelse(list(ifelse.branches), x_i, gate_i)
    torch.testing.assert_close(out, out_d)
    torch.testing.assert_close(out, out_i)
    assert all_params_in_graph(out, list(m.parameters()))

    out.backward(grad_out)
    out_d.backward(grad_out)
    out_i.backward(grad_out)
    torch.testing.assert_close(x.grad, x_d.grad)
    torch.testing.assert_close(x.grad, x_i.grad)

    live = dense_coef(gate_d).ne(0).any(0)
    for i in range(N):
        for p, pd, pi in zip(m.branches[i].parameters(), dense.branches[i].parameters(), ifelse.branches[i].parameters()):
            if live[i]:
                torch.testing.assert_close(p.grad, pd.grad)
                torch.testing.assert_close(p.grad, pi.grad)
            elif materialize:  # materialized zeros
                assert p.grad is not None and torch.count_nonzero(p.grad) == 0
            else:  # undefined: left as is (None here), as if/else leaves it
                assert p.grad is None and pi.grad is None

    if kind == "weights":
        nz = gate.detach() != 0
        torch.testing.assert_close(gate.grad[nz], gate_d.grad[nz])  # the dense formula's value
        torch.testing.assert_close(gate.grad[nz], gate_i.grad[nz])
        assert torch.count_nonzero(gate.grad[~nz]) == 0  # the branch never ran there
        assert torch.count_nonzero(gate_d.grad[~nz]) > 0  # where dense differs


def test_gradcheck_float64():
    torch.manual_seed(0)
    m = MaskedBranch(make_branches())
    names = [k for k, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in m.parameters()]
    g = gates()
    pattern = g["weights"] != 0
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    values = g["weights"][pattern].clone().requires_grad_(True)

    def run(gate_of, x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x, gate_of))

    # Weights: only the nonzero entries vary (a zero entry made nonzero changes the routing).
    def weighted(x, values, *ps):
        w = torch.zeros(B, N, dtype=torch.float64).masked_scatter(pattern, values)
        return run(w, x, *ps)

    assert torch.autograd.gradcheck(weighted, (x, values, *params))
    for kind in ("int", "ids", "mask"):
        assert torch.autograd.gradcheck(lambda x, *ps: run(g[kind], x, *ps), (x, *params))


def test_gate_weights_in_another_dtype():
    m = MaskedBranch(make_branches(dtype=torch.float64))
    w32 = gates()["weights"].float().requires_grad_(True)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    out = m(x, w32)
    assert out.dtype == torch.float64
    ref = reference.masked_branch_ifelse(list(m.branches), x, w32.detach().double())
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert w32.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8])
def test_id_dtypes_and_scalar_gates(dtype):
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64)
    ids = gates()["ids"]
    torch.testing.assert_close(m(x, ids.to(dtype)), reference.masked_branch_ifelse(list(m.branches), x, ids))
    torch.testing.assert_close(m(x, torch.tensor(2, dtype=dtype)), m.branches[2](x))
    import numpy as np

    torch.testing.assert_close(m(x, np.int64(1)), m.branches[1](x))


def test_int_gate_is_the_branch():
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    out = m(x, 2)
    assert torch.equal(out, m.branches[2](x))
    assert all_params_in_graph(out, list(m.parameters()))


def test_all_rows_to_one_branch_is_the_branch():
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    for gate in (torch.full((B,), 1), torch.zeros(B, N, dtype=torch.bool).index_fill_(1, torch.tensor([1]), True)):
        out = m(x, gate)
        assert torch.equal(out, m.branches[1](x))
        assert all_params_in_graph(out, list(m.parameters()))


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
    assert x.grad is not None and torch.count_nonzero(x.grad[2]) == 0


def test_state_dict_keys_and_repr():
    m = MaskedBranch([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert "branches.0.weight" in m.state_dict() and "branches.1.bias" in m.state_dict()
    assert isinstance(m.branches, nn.ModuleList) and m.num_branches == 2
    assert "num_branches=2" in repr(m)
    ml = nn.ModuleList([nn.Linear(2, 2)])
    assert MaskedBranch(ml).branches is ml
    assert MaskedBranch(nn.Linear(2, 2) for _ in range(3)).num_branches == 3


def test_functional_form():
    branches = make_branches()
    m = MaskedBranch(branches)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    for gate in gates().values():
        torch.testing.assert_close(masked_branch(branches, x, gate), m(x, gate))
    # plain functions as branches
    fns = [torch.sin, torch.cos, lambda t: 2 * t]
    torch.testing.assert_close(masked_branch(fns, x, gates()["ids"]), reference.masked_branch_ifelse(fns, x, gates()["ids"]))
    out = masked_branch(fns, x, torch.full((B,), -1))
    assert out.shape == x.shape and torch.count_nonzero(out) == 0


# ----------------------------------------------------------------------------------------------
# Gradients for every parameter; no-grad mode.


@pytest.mark.parametrize("kind", ["int", "ids", "mask", "weights"])
def test_every_parameter_in_graph_and_no_grad_anchors_nothing(kind):
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64)
    gate = gates()[kind]
    out = m(x, gate)
    assert out.requires_grad and all_params_in_graph(out, list(m.parameters()))
    with torch.no_grad():
        out = m(x, gate)
    assert not out.requires_grad and out.grad_fn is None and not out._is_view()
    with torch.inference_mode():
        out = m(x, gate)
    assert not out.requires_grad and not out._is_view()


def test_frozen_parameters_are_not_anchored():
    m = MaskedBranch(make_branches())
    for p in m.parameters():
        p.requires_grad_(False)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    out = m(x, 1)
    assert not out.requires_grad and not out._is_view()


@pytest.mark.parametrize("materialize", [False, True])
def test_partly_frozen_dead_branch(materialize):
    """A frozen parameter of a branch that did not run gets no gradient; the others of that
    branch still get theirs (their hooks fire; zeros with materialize)."""
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    frozen = m.branches[2][0].weight
    frozen.requires_grad_(False)
    fired = []
    for p in m.branches[2].parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    m(x, 1).sum().backward()
    assert frozen.grad is None
    assert len(fired) == 3
    for p in fired:
        assert (p.grad is not None and torch.count_nonzero(p.grad) == 0) if materialize else p.grad is None


def _accumulator_hooks(params, fired):
    """DDP's way of learning that a parameter's gradient is ready: a hook on its accumulator
    (held, so that it stays the parameter's), which fires even for an undefined gradient."""
    held = []
    for p in params:
        acc = p.view_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda grad_inputs, grad_outputs, p=p: fired.append(p))
        held.append(acc)
    return held


@pytest.mark.parametrize("materialize", [False, True])
def test_freezing_changed_after_first_call(materialize):
    """A dead branch's parameters are linked once per set of live branches. One unfrozen after
    that must be anchored from then on; one frozen after it gets no gradient."""
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    unfrozen, frozen = m.branches[2][0].weight, m.branches[2][2].bias
    unfrozen.requires_grad_(False)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    m(x, 1).sum().backward()  # links branch 2's parameters without `unfrozen`
    m.zero_grad()
    unfrozen.requires_grad_(True)
    frozen.requires_grad_(False)
    fired = []
    held = _accumulator_hooks([p for p in m.branches[2].parameters() if p.requires_grad], fired)
    m(x, 1).sum().backward()
    assert len(fired) == 3 and any(p is unfrozen for p in fired)
    assert frozen.grad is None
    for p in fired:
        assert (p.grad is not None and torch.count_nonzero(p.grad) == 0) if materialize else p.grad is None
    del held


@pytest.mark.parametrize("materialize", [False, True])
def test_parameter_data_of_another_dtype(materialize):
    """``p.data = ...`` of another dtype gives p a new accumulator (autograd drops the old one):
    a dead branch links the new one, and zeros come in the new dtype."""
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    m(x, 1).sum().backward()
    m.zero_grad()
    for p in m.branches[2].parameters():
        p.data = p.data.float()
    fired = []
    held = _accumulator_hooks(list(m.branches[2].parameters()), fired)
    m(x, 1).sum().backward()
    assert len(fired) == 4
    for p in m.branches[2].parameters():
        assert (p.grad is not None and p.grad.dtype == torch.float32) if materialize else p.grad is None
    del held


def test_same_dead_set_twice_in_one_graph():
    """Calls with the same live branch share the node that anchors the dead ones: two calls in
    one graph, and two graphs, still give every parameter the reference gradient."""
    m = MaskedBranch(make_branches(), materialize_grads=True)
    ref = copy.deepcopy(m)
    x1, x2 = (torch.randn(B, D_IN, dtype=torch.float64) for _ in range(2))
    (m(x1, 1) * 2 + m(x2, 1)).sum().backward()
    y1, y2 = m(x1, 0), m(x2, 0)  # two graphs, one backward each
    y1.sum().backward()
    y2.sum().backward()
    b = ref.branches
    (b[1](x1) * 2 + b[1](x2)).sum().backward()
    (b[0](x1) + b[0](x2)).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, torch.zeros_like(q) if q.grad is None else q.grad)


def test_dead_parameter_caches_are_bounded():
    """A table keeps, per set of live branches, the dead parameters and their shared node. The
    sets of a many-branch layer could vary without bound: both caches stop at the bound, and a
    set past it is still anchored."""
    n = 11
    m = MaskedBranch(make_branches(n=n))
    bound = mb.nn._MAX_CACHED_MASKS
    x = torch.randn(1, D_IN, dtype=torch.float64)
    for live in range(1, bound + 20):  # one row, whose mask is the set of live branches
        out = m(x, torch.tensor([[bool(live >> i & 1) for i in range(n)]]))
    table = m._table()
    assert len(table._dead) == bound and len(table._sets) == bound
    assert all_params_in_graph(out, list(m.parameters()))


def test_parameters_replaced_by_a_conversion():
    """.double() may put new parameter objects in place (overwrite_module_params_on_conversion):
    the branches that did not run must anchor the new ones."""
    m = MaskedBranch(make_branches(dtype=torch.float32), materialize_grads=True)
    x = torch.randn(B, D_IN)
    m(x, 1)
    old = list(m.parameters())
    with conversions_replace_parameters():
        m.double()
    assert not any(p is q for p, q in zip(m.parameters(), old))
    m(x.double(), 1).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_shared_parameters():
    shared = nn.Linear(D_IN, D_OUT).double()
    m = MaskedBranch([shared, nn.Sequential(shared, nn.Tanh()), nn.Linear(D_IN, D_OUT).double()])
    x = torch.randn(B, D_IN, dtype=torch.float64)
    gate = torch.tensor([1] * B)
    out = m(x, gate)
    out.sum().backward()
    ref = copy.deepcopy(m)
    reference.masked_branch_ifelse(list(ref.branches), x, gate).sum().backward()
    torch.testing.assert_close(shared.weight.grad, ref.branches[0].weight.grad)


# ----------------------------------------------------------------------------------------------
# No row reaches any branch.


@pytest.mark.parametrize("kind", ["int", "ids", "mask", "weights"])
@pytest.mark.parametrize("first_call", [True, False])
def test_no_live_row(kind, first_call):
    m = MaskedBranch(make_branches(d_out=D_OUT))
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    if not first_call:
        m(x, gates()["ids"])  # learns the output signature
    gate = {
        "int": -1,
        "ids": torch.full((B,), -1),
        "mask": torch.zeros(B, N, dtype=torch.bool),
        "weights": torch.zeros(B, N, dtype=torch.float64, requires_grad=True),
    }[kind]
    out = m(x, gate)
    assert out.shape == (B, D_OUT) and out.dtype == torch.float64  # shape from the branches, not x
    assert torch.count_nonzero(out) == 0
    assert all_params_in_graph(out, list(m.parameters()))
    assert all_params_in_graph(out, [x])  # x stays in the graph
    out.backward(torch.randn_like(out))
    if kind == "int":  # no plan: x is anchored like the parameters (undefined gradient)
        assert x.grad is None
    else:  # a zero gradient through the routing
        assert x.grad is not None and torch.count_nonzero(x.grad) == 0
    if kind == "weights":
        assert torch.count_nonzero(gate.grad) == 0
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("gate", [-1, torch.full((B,), -1)], ids=["int", "ids"])
@pytest.mark.parametrize("materialize", [False, True])
def test_no_live_row_upstream_parameters_get_gradients(gate, materialize):
    """Whatever produced x keeps receiving gradients when no row reaches a branch (DDP needs it)."""
    pre = nn.Linear(3, D_IN).double()
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    fired = []
    for p in pre.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    out = m(pre(torch.randn(B, 3, dtype=torch.float64)), gate)
    assert all_params_in_graph(out, list(pre.parameters()) + list(m.parameters()))
    out.sum().backward()
    for p in pre.parameters():
        assert p.grad is None or torch.count_nonzero(p.grad) == 0
    if materialize or not isinstance(gate, int):
        assert len(fired) == 2 and all(torch.count_nonzero(p.grad) == 0 for p in pre.parameters())


def test_empty_batch():
    m = MaskedBranch(make_branches())
    x = torch.randn(0, D_IN, dtype=torch.float64, requires_grad=True)
    for gate in (torch.empty(0, dtype=torch.long), torch.empty(0, N, dtype=torch.bool)):
        out = m(x, gate)
        assert out.shape == (0, D_OUT)
        out.sum().backward()


def test_no_live_row_without_meta_support():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x[x.sum(1) > -1e9]  # data-dependent: cannot run on meta tensors

    m = MaskedBranch([DataDependent(), DataDependent()])
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="no row reached any branch"):
        m(x, torch.full((4,), -1))
    m(x, torch.tensor([0, 1, 0, -1]))  # a live call teaches the output signature
    out = m(x, torch.full((4,), -1))
    assert out.shape == (4, 3) and torch.count_nonzero(out) == 0


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
        if mask is not None:
            y = y * mask[:, None]
        return scale * y


def test_extra_per_row_args():
    torch.manual_seed(0)
    branches = [Conditioned() for _ in range(N)]
    m = MaskedBranch(branches)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    cond = torch.randn(B, 2, dtype=torch.float64, requires_grad=True)
    shared = torch.randn(D_OUT, dtype=torch.float64, requires_grad=True)  # not per-row: unchanged
    mask = torch.rand(B) < 0.7  # bool per-row mask: routed without a gradient
    gate = gates()["weights"]
    out = m(x, gate, cond, shared, scale=0.5, mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    x2, cond2, shared2 = (t.detach().clone().requires_grad_(True) for t in (x, cond, shared))
    ref = torch.zeros(B, D_OUT, dtype=torch.float64)
    for i, br in enumerate(branches):
        r = gate[:, i].nonzero().flatten()
        y = br(x2[r], cond2[r], shared2, scale=0.5, mask=mask[r])
        ref = ref.index_add(0, r, y * gate[r, i, None])
    torch.testing.assert_close(out, ref)
    grads_m = [x.grad, cond.grad, shared.grad]
    ref.backward(grad_out)
    for a, b in zip(grads_m, [x2.grad, cond2.grad, shared2.grad]):
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
    for step in range(3):
        x = torch.randn(32, D_IN, dtype=torch.float64)
        gate = torch.randint(0, N, (32,), generator=g)
        gate[:2] = torch.tensor([0, 0])  # each branch gets >= 2 rows in practice; keep it certain
        gate[2:4] = 1
        gate[4:6] = 2
        out = m(x, gate)
        out_ref = reference.masked_branch_ifelse(list(ref.branches), x, gate)
        torch.testing.assert_close(out, out_ref)
        out.pow(2).sum().backward()
        out_ref.pow(2).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    for b, c in zip(m.buffers(), ref.buffers()):
        torch.testing.assert_close(b, c)
    # int gate: only that branch's statistics move
    before = [bn.running_mean.clone() for bn in (br[1] for br in m.branches)]
    m(torch.randn(8, D_IN, dtype=torch.float64), 2)
    assert torch.equal(m.branches[0][1].running_mean, before[0])
    assert not torch.equal(m.branches[2][1].running_mean, before[2])


# ----------------------------------------------------------------------------------------------
# Refused inputs: each error names the argument and leaves the module working.


def _bad_gates():
    ok_w = gates()["weights"]
    return [
        ("list", [0, 1], TypeError),
        ("float", 1.0, TypeError),
        ("bool", True, TypeError),
        ("str", "0", TypeError),
        ("int too big", N, IndexError),
        ("int too small", -2, IndexError),
        ("float ids", torch.zeros(B), TypeError),
        ("bool ids", torch.zeros(B, dtype=torch.bool), TypeError),
        ("short ids", torch.zeros(B - 1, dtype=torch.long), ValueError),
        ("wrong columns", torch.zeros(B, N + 1), ValueError),
        ("wrong rows", torch.zeros(B + 1, N), ValueError),
        ("int matrix", torch.zeros(B, N, dtype=torch.long), TypeError),
        ("3-d", torch.zeros(B, N, 1), ValueError),
        ("complex", torch.zeros(B, N, dtype=torch.complex64), TypeError),
        ("0-d float", torch.tensor(1.0), TypeError),
        ("0-d out of range", torch.tensor(N), IndexError),
        ("meta device", torch.zeros(B, dtype=torch.long, device="meta"), ValueError),
        ("id out of range", torch.tensor([0] * (B - 1) + [N]), IndexError),
        ("id below -1", torch.tensor([0] * (B - 1) + [-2]), IndexError),
        ("nan weight", ok_w.clone().index_put_((torch.tensor(2), torch.tensor(0)), torch.tensor(float("nan"), dtype=torch.float64)), ValueError),
        ("inf weight", torch.full((B, N), float("inf")), ValueError),
    ]


@pytest.mark.parametrize("name,gate,exc", _bad_gates(), ids=[b[0] for b in _bad_gates()])
def test_bad_gate(name, gate, exc):
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    with pytest.raises(exc, match="gate"):
        m(x, gate)
    ids = gates()["ids"]
    torch.testing.assert_close(m(x, ids), reference.masked_branch_ifelse(list(m.branches), x, ids))


def test_bad_x_and_args():
    m = MaskedBranch([Conditioned() for _ in range(N)])
    x = torch.randn(B, D_IN, dtype=torch.float64)
    cond = torch.randn(B, 2, dtype=torch.float64)
    shared = torch.zeros(D_OUT, dtype=torch.float64)
    with pytest.raises(TypeError, match="x"):
        m([[1.0]], 0, cond, shared)
    with pytest.raises(ValueError, match="x"):
        m(torch.tensor(1.0), 0, cond, shared)
    with pytest.raises(ValueError, match=r"args\[0\]"):
        m(x, gates()["ids"], cond.to("meta"), shared)
    with pytest.raises(ValueError, match="mask"):
        m(x, gates()["ids"], cond, shared, mask=torch.ones(B, device="meta"))
    m(x, gates()["ids"], cond, shared)


def test_bad_branches_at_construction():
    with pytest.raises(ValueError, match="branches"):
        MaskedBranch([])
    with pytest.raises(TypeError, match="branches"):
        MaskedBranch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="branches"):
        MaskedBranch(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"branches\[1\]"):
        MaskedBranch([nn.Linear(2, 2), torch.sin])
    with pytest.raises(ValueError, match=r"branches\[1\]\.1.*SyncBatchNorm"):
        MaskedBranch([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2))])


def test_sync_batchnorm_converted_after_construction():
    m = MaskedBranch([nn.Sequential(nn.Linear(D_IN, 4), nn.BatchNorm1d(4)) for _ in range(2)])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(m))
    with pytest.raises(ValueError, match="SyncBatchNorm"):
        model[0](torch.randn(4, D_IN), 0)


def test_branches_disagreeing():
    x = torch.randn(B, D_IN, dtype=torch.float64)
    # trailing shape, seen in one call
    m = MaskedBranch([nn.Linear(D_IN, 3).double(), nn.Linear(D_IN, 4).double()])
    with pytest.raises(ValueError, match="branches.*disagree"):
        m(x, torch.tensor([0, 1] * (B // 2)))
    # trailing shape, on the first call with an int gate: the other branch is probed
    m = MaskedBranch([nn.Linear(D_IN, 3).double(), nn.Linear(D_IN, 4).double()])
    with pytest.raises(ValueError, match="branches.*disagree"):
        m(x, 0)
    # dtype
    class ToFloat(nn.Module):
        def forward(self, x):
            return x.float()

    m = MaskedBranch([nn.Linear(D_IN, 3).double(), nn.Sequential(nn.Linear(D_IN, 3).double(), ToFloat())])
    with pytest.raises(ValueError, match="branches.*disagree.*float32"):
        m(x, 0)
    # one row per input row
    class Drop(nn.Module):
        def forward(self, x):
            return x[:1]

    m = MaskedBranch([nn.Identity(), Drop()])
    with pytest.raises(ValueError, match=r"branches\[1\].*one row per input row"):
        m(x, torch.tensor([0, 1] * (B // 2)))
    torch.testing.assert_close(m(x, 0), x)  # still works

    class NotTensor(nn.Module):
        def forward(self, x):
            return (x,)

    with pytest.raises(TypeError, match=r"branches\[0\]"):
        MaskedBranch([NotTensor()])(x, 0)


def test_branch_changing_between_calls():
    """A branch whose output signature changes for the same inputs is caught on the later call."""

    class Flaky(nn.Module):
        calls = 0

        def forward(self, x):
            Flaky.calls += 1
            return x if Flaky.calls < 3 else x[:, :2]

    m = MaskedBranch([Flaky(), nn.Identity()])
    x = torch.randn(4, 3)
    m(x, 0)  # first call: Flaky runs, Identity is probed on meta tensors
    m(x, 0)
    with pytest.raises(ValueError, match="earlier call"):
        m(x, 0)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda x: x[:1], ValueError, "one row per input row"),
        (lambda x: x.float(), ValueError, "earlier call"),
        (lambda x: x[:, :2], ValueError, "earlier call"),
        (lambda x: x.unsqueeze(1), ValueError, "earlier call"),
        (lambda x: (x,), TypeError, "return a tensor"),
    ],
)
def test_output_checked_on_every_int_gate_call(change, exc, match):
    """Once a call like this one was confirmed, later calls compare in C++; a branch that then
    changes its output is still caught, and inputs of a new shape are learned afresh."""

    class Changing(nn.Module):
        changed = False

        def forward(self, x):
            return change(x) if self.changed else x

    branch = Changing()
    m = MaskedBranch([branch, nn.Identity()])
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(3):
        m(x, 0)
    m(torch.randn(5, 2, 7, dtype=torch.float64), 0)  # a new input signature
    m(x, 0)
    branch.changed = True
    with pytest.raises(exc, match=match):
        m(x, 0)
    branch.changed = False
    torch.testing.assert_close(m(x, 0), x)  # the module still works
    copy.deepcopy(m)(x, 0)  # the C++ signature is not copied, and is learned again


@pytest.mark.parametrize("kind", ["ids", "mask", "weights"])
def test_branches_modifying_their_input_in_place(kind):
    """Each branch gets its rows as a tensor of its own: in-place ops on it (a leading
    ReLU(inplace=True)) neither fail nor disturb the other branches' saved inputs."""
    torch.manual_seed(0)
    branches = [
        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(D_IN, D_OUT)).double(),
        nn.Linear(D_IN, D_OUT).double(),
        nn.Sequential(nn.Tanh(), nn.Linear(D_IN, D_OUT)).double(),
    ]
    m = MaskedBranch(branches)
    g = torch.Generator().manual_seed(5)
    gate = {
        "ids": torch.arange(B) % N,
        "mask": torch.rand(B, N, generator=g) < 0.6,
        "weights": torch.rand(B, N, generator=g, dtype=torch.float64),
    }[kind]
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    out = m(x + 0, gate)
    x2 = x.detach().clone().requires_grad_(True)
    ref = reference.masked_branch_ifelse(list(m.branches), x2 + 0, gate)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("gate", [1, "ids"])
def test_inplace_on_output(gate):
    """In-place ops on the output (e.g. nn.ReLU(inplace=True) after it) work: the anchor of the
    branches that did not run goes into the output's own history, and gradients stay exact."""
    m = MaskedBranch(make_branches())
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    g = gate if isinstance(gate, int) else torch.tensor([1, 0, 1, -1, 0, 1, 1, 0, 0, 1])[:B]
    fired = []
    for p in m.branches[2].parameters():  # branch 2 never runs: anchored
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    out = m(x, g)
    assert not out._is_view()
    out.relu_()
    out.square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    ref_branches = copy.deepcopy(list(m.branches))
    want = reference.masked_branch_ifelse(ref_branches, x_ref, g, N)
    want.relu().square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, q in zip(m.parameters(), nn.ModuleList(ref_branches).parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert len(fired) == 4  # the anchored parameters' hooks ran (what DDP relies on)


def test_inplace_on_output_of_a_view_branch():
    """A branch returning its input (or a view of it) cannot take the anchor into its history:
    the output is then the anchor's view, and in-place ops on it hit autograd's rule for views
    returned by a custom function."""
    m = MaskedBranch([nn.Identity(), nn.Linear(D_IN, D_IN).double()])
    x = torch.randn(B, D_IN, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="view"):
        m(x, 0).relu_()
    m(x, 1).relu_()  # a Linear's output: fine
    with torch.no_grad():
        m(x, 0).relu_()  # nothing anchored without grad


# ----------------------------------------------------------------------------------------------
# CUDA: host-device synchronizations.

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and mb.WITH_CUDA), reason="needs a GPU and a CUDA build")


def _count_syncs(fn):
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@cuda
def test_cuda_matches_cpu_and_syncs():
    torch.manual_seed(0)
    m_cpu = MaskedBranch(make_branches(dtype=torch.float32))
    m = copy.deepcopy(m_cpu).cuda()
    x_cpu = torch.randn(64, D_IN)
    x = x_cpu.cuda().requires_grad_(True)
    host_gates = {
        "ids": torch.randint(-1, N, (64,)),
        "mask": torch.rand(64, N) < 0.5,
        "weights": torch.rand(64, N) * (torch.rand(64, N) < 0.5),
    }
    for gate in [1, *host_gates.values()]:
        m(x, gate).sum().backward()  # warm up (first-call checks, allocator)
    torch.cuda.synchronize()

    for gate in [1, *host_gates.values()]:
        torch.testing.assert_close(m(x, gate).cpu(), m_cpu(x_cpu, gate), atol=1e-5, rtol=1e-4)

        def step():
            m(x, gate).sum().backward()

        torch.cuda.set_sync_debug_mode("error")
        try:
            step()  # int and host gates: no synchronization at all
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for gate in host_gates.values():
        dev_gate = gate.cuda()
        m(x, dev_gate)
        assert _count_syncs(lambda: m(x, dev_gate).sum().backward()) <= 1
