"""What the parameters of MaskedBranch's branches that did not run receive.

``materialize_grads=None`` (the default) in one process: nothing, as with if/else (they are not
in the graph). ``False``: they are tied into the output's graph with an undefined gradient (their
accumulators' hooks fire, which is what DDP's reducer listens to); ``True``: zeros. The
distributed defaults are tested with real processes in tests/test_ddp_masked_branch.py."""
import copy

import pytest
import torch
from torch import nn

from maskedbranch import MaskedBranch, _structure, reference
from harness import accumulator_hooks, conversions_replace_parameters

N, B, D_IN, D_OUT = 3, 10, 5, 4
TIED = [False, True]


def make_branches(n=N, dtype=torch.float64):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D_IN, 7), nn.Tanh(), nn.Linear(7, D_OUT)).to(dtype) for _ in range(n)]


def gates():
    """Every kind, each leaving branch 2 without rows."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(B, N, generator=g) < 0.5
    mask[:, 2] = False
    mask[0, :2] = True
    return {
        "int": 1,
        "ids": torch.tensor([0, 1, -1, 0, 1, 1, 0, -1, 0, 1]),
        "mask": mask,
        "weights": torch.rand(B, N, generator=g, dtype=torch.float64) * mask,
    }


def params_in_graph(out):
    """ids of the leaf tensors that out's backward reaches (their AccumulateGrad nodes)."""
    seen, stack, found = set(), [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            found.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions)
    return found


def assert_dead_grads(params, materialize):
    for p in params:
        if materialize:
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0
        else:
            assert p.grad is None


@pytest.mark.parametrize("materialize", [None, *TIED])
@pytest.mark.parametrize("kind", list(gates()))
def test_dead_branches_in_the_graph(kind, materialize):
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    ref = copy.deepcopy(m)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    for _ in range(2):  # the int gate's first call and its fast path
        m.zero_grad(set_to_none=True)
        out = m(x, gates()[kind])
        found = params_in_graph(out)
        assert all(id(p) in found for p in m[1].parameters())
        assert all((id(p) in found) == (materialize is not None) for p in m[2].parameters())
        out.backward(torch.ones_like(out))
    assert_dead_grads(m[2].parameters(), materialize)
    ref_out = reference.masked_branch_ifelse(list(ref), x, gates()[kind])
    ref_out.backward(torch.ones_like(ref_out))
    for p, q in zip(m.parameters(), ref.parameters()):  # the live ones: exact
        if q.grad is None:
            assert_dead_grads([p], materialize)
        else:
            torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("materialize", [None, *TIED])
def test_no_grad_and_frozen_tie_nothing(materialize):
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    for gate in gates().values():
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx():
                out = m(x, gate)
            assert not out.requires_grad and out.grad_fn is None
    for p in m.parameters():
        p.requires_grad_(False)
    assert not m(x, 1).requires_grad and not m(x, gates()["ids"]).requires_grad


@pytest.mark.parametrize("materialize", TIED)
def test_partly_frozen_dead_branch(materialize):
    """A frozen parameter of a branch that did not run gets no gradient; the others of that
    branch still get theirs (hooks fire; zeros with materialize)."""
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    frozen = m[2][0].weight
    frozen.requires_grad_(False)
    fired = []
    held = accumulator_hooks([p for p in m[2].parameters() if p.requires_grad], fired)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    m(x, 1).sum().backward()
    assert frozen.grad is None and len(fired) == 3
    assert_dead_grads(fired, materialize)
    del held


@pytest.mark.parametrize("materialize", TIED)
def test_freezing_changed_after_first_call(materialize):
    """The tied parameters are cached per set of live branches; a parameter unfrozen after the
    first call is tied from then on, one frozen after it is not."""
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    unfrozen, frozen = m[2][0].weight, m[2][2].bias
    unfrozen.requires_grad_(False)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    m(x, 1).sum().backward()
    m.zero_grad()
    unfrozen.requires_grad_(True)
    frozen.requires_grad_(False)
    fired = []
    held = accumulator_hooks([p for p in m[2].parameters() if p.requires_grad], fired)
    m(x, 1).sum().backward()
    assert len(fired) == 3 and any(p is unfrozen for p in fired) and frozen.grad is None
    assert_dead_grads(fired, materialize)
    del held


@pytest.mark.parametrize("materialize", TIED)
def test_parameter_data_of_another_dtype(materialize):
    """``p.data = ...`` of another dtype gives p a new accumulator: it is the one reached, and
    zeros come in the new dtype."""
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    x = torch.randn(B, D_IN, dtype=torch.float64, requires_grad=True)
    m(x, 1).sum().backward()
    m.zero_grad()
    for p in m[2].parameters():
        p.data = p.data.float()
    fired = []
    held = accumulator_hooks(list(m[2].parameters()), fired)
    m(x, 1).sum().backward()
    assert len(fired) == 4
    for p in m[2].parameters():
        assert (p.grad is not None and p.grad.dtype == torch.float32) if materialize else p.grad is None
    del held


def test_parameters_replaced_by_a_conversion():
    """.double() may put new parameter objects in place (overwrite_module_params_on_conversion):
    the branches that did not run tie the new ones."""
    m = MaskedBranch(make_branches(dtype=torch.float32), materialize_grads=True)
    x = torch.randn(B, D_IN)
    m(x, 1)
    m(x, gates()["ids"])
    old = list(m.parameters())
    with conversions_replace_parameters():
        m.double()
    assert not any(p is q for p, q in zip(m.parameters(), old))
    for gate in (1, gates()["ids"]):
        m.zero_grad(set_to_none=True)
        m(x.double(), gate).sum().backward()
        assert all(p.grad is not None for p in m.parameters())


def test_same_live_set_twice_in_one_graph():
    """Calls with the same live branches in one graph, and in two graphs: every parameter gets
    the reference gradient (zeros where its branch never ran)."""
    m = MaskedBranch(make_branches(), materialize_grads=True)
    ref = copy.deepcopy(m)
    x1, x2 = (torch.randn(B, D_IN, dtype=torch.float64) for _ in range(2))
    (m(x1, 1) * 2 + m(x2, 1)).sum().backward()
    y1, y2 = m(x1, 0), m(x2, 0)
    y1.sum().backward()
    y2.sum().backward()
    (ref[1](x1) * 2 + ref[1](x2)).sum().backward()
    (ref[0](x1) + ref[0](x2)).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, torch.zeros_like(q) if q.grad is None else q.grad)


def test_many_live_sets_past_the_cache_bound(monkeypatch):
    """The tied parameters are cached for at most MAX_CACHED_SETS sets of live branches (a
    many-branch layer could see any number); a set past the bound is still tied."""
    monkeypatch.setattr(_structure, "MAX_CACHED_SETS", 4)
    n = 6
    m = MaskedBranch(make_branches(n), materialize_grads=True)
    x = torch.randn(1, D_IN, dtype=torch.float64)
    for live in range(1, 2**n - 1, 3):  # one row, whose mask is the set of live branches
        m.zero_grad(set_to_none=True)
        m(x, torch.tensor([[bool(live >> i & 1) for i in range(n)]])).sum().backward()
        for i in range(n):
            grads = [p.grad for p in m[i].parameters()]
            assert all(g is not None for g in grads)
            assert any(torch.count_nonzero(g) > 0 for g in grads) == bool(live >> i & 1)
    assert len(m._unit.table._tied) <= 4


@pytest.mark.parametrize("materialize", [None, *TIED])
def test_shared_parameters(materialize):
    """A parameter that a live branch shares with a dead one gets the live branch's gradient."""
    shared = nn.Linear(D_IN, D_OUT).double()
    m = MaskedBranch([shared, nn.Sequential(shared, nn.Tanh()), nn.Linear(D_IN, D_OUT).double()], materialize_grads=materialize)
    ref = copy.deepcopy(m)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    for gate in (torch.tensor([1] * B), 1, torch.tensor([1, 2] * (B // 2))):
        m.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        m(x, gate).sum().backward()
        reference.masked_branch_ifelse(list(ref), x, gate, N).sum().backward()
        torch.testing.assert_close(shared.weight.grad, ref[0].weight.grad)


@pytest.mark.parametrize("gate", [-1, torch.full((B,), -1)], ids=["int", "ids"])
@pytest.mark.parametrize("materialize", TIED)
def test_no_live_row_upstream_parameters_get_gradients(gate, materialize):
    """Whatever produced x is tied in too when no row reaches a branch (DDP needs its hooks)."""
    pre = nn.Linear(3, D_IN).double()
    m = MaskedBranch(make_branches(), materialize_grads=materialize)
    fired = []
    held = accumulator_hooks(list(pre.parameters()) + list(m.parameters()), fired)
    out = m(pre(torch.randn(B, 3, dtype=torch.float64)), gate)
    assert torch.count_nonzero(out) == 0
    out.sum().backward()
    assert len(fired) == 2 + 4 * N
    assert_dead_grads(list(pre.parameters()) + list(m.parameters()), materialize)
    del held
