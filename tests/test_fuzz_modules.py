"""Property-based fuzzing (hypothesis) of MaskedBranch / masked_branch and drop_add_residual /
ResidualDropPath against the if/else and dense references of maskedbranch.reference, with
nonlinear branches: outputs, x's, the parameters' and the gate weights' gradients, and what
dead branches' parameters receive for each materialize_grads setting. Derandomized; the error
bound (with the branches' absolute linearizations) is explained in tests/fuzzing.py.
"""
from __future__ import annotations

import copy

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import maskedbranch as mb
from fuzzing import (  # noqa: F401 - one_thread is an autouse fixture
    DROP_CASES, DTYPES, ID_DTYPES, LAYOUTS, RAN, _factor, _grad, _mask, abs_branch, assert_within, batches, branch_counts,
    check_example_count, densities, eps, flat_ifelse, fuzz, gate_patterns, make_branches, make_gate, make_x, one_thread,
    row_numel, seeds, trailing_shapes,
)
from maskedbranch import reference as ref


# ----------------------------------------------------------------------------------------------
# MaskedBranch / masked_branch against the if/else and dense references


@fuzz("masked_branch")
@given(
    batch=batches,
    n=branch_counts,
    trailing=trailing_shapes,
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    kind=st.sampled_from(["int", "int_none", "scalar", "ids", "bool", "float", "float_grad"]),
    pattern=gate_patterns,
    density=densities,
    functional=st.booleans(),
    materialize=st.sampled_from([None, True, False]),
    data=st.data(),
    seed=seeds,
)
def test_masked_branch(batch, n, trailing, dtype, layout, kind, pattern, density, functional, materialize, data, seed):
    RAN["masked_branch"] += 1
    gen = torch.Generator().manual_seed(seed)
    branches = make_branches(n, trailing, dtype, gen, linear=len(trailing) == 1)
    x = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    if kind == "int":
        gate = data.draw(st.integers(0, n - 1), label="k")
    elif kind == "int_none":
        gate = -1
    elif kind == "scalar":
        gate = torch.tensor(data.draw(st.integers(-1, n - 1), label="k"), dtype=data.draw(st.sampled_from(ID_DTYPES[:-1])))
    elif kind == "ids":
        gate = make_gate(gen, "ids", pattern, density, batch, n, data.draw(st.sampled_from(ID_DTYPES)), False)
    elif kind == "bool":
        gate = make_gate(gen, "bool", pattern, density, batch, n, torch.bool, data.draw(st.booleans()))
    else:
        wdtype = data.draw(st.sampled_from([dtype, torch.float32, torch.float64]), label="weights dtype")
        gate = make_gate(gen, "float", pattern, density, batch, n, wdtype, data.draw(st.booleans()))
        gate = gate.detach().requires_grad_(kind == "float_grad")
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")

    module = mb.MaskedBranch(copy.deepcopy(branches), materialize_grads=materialize)
    out = mb.masked_branch(list(module), x, gate) if functional else module(x, gate)
    assert out.shape == x.shape and out.dtype == dtype

    def ref_gate(to=None, absolute=False):
        """The gate as the references take it: an int k >= 0, ids [B] or a [B, N] gate."""
        g = gate
        if isinstance(g, Tensor) and g.dim() == 0:
            g = int(g)
        if isinstance(g, int):
            return g if g >= 0 else torch.full((batch,), -1)
        if g.is_floating_point():
            g = g.detach().to(to or g.dtype)
            return (g.abs() if absolute else g).requires_grad_(gate.requires_grad)
        return g

    # references: if/else in the same dtype, in float64, and the absolute float64 bounds
    br_i = copy.deepcopy(branches)
    x_i, gate_i = x.detach().clone().requires_grad_(True), ref_gate()
    want = flat_ifelse(br_i, x_i, gate_i, n, trailing)
    br_a = [abs_branch(b) for b in branches]
    x_a, gate_a = x.detach().double().requires_grad_(True), ref_gate(torch.float64, absolute=True)
    bound = flat_ifelse(br_a, x_a, gate_a, n, trailing)
    if want is None:  # no row reached any branch: zeros of x's shape (and nothing to bound)
        want, bound = torch.zeros_like(x), torch.zeros_like(x, dtype=torch.float64)
    assert_within(out.detach(), want.detach(), bound.detach(), dtype, n + 1, "out")
    dense = ref.masked_branch_dense(copy.deepcopy(branches), x.detach(), ref_gate(), n)
    assert_within(out.detach(), dense.detach(), bound.detach(), dtype, 2 * n + 2, "out vs dense")

    # gradients: x, every parameter, the gate's weights
    if out.requires_grad:  # not when nothing ran and nothing is tied (no graph, as for if/else)
        out.backward(grad_out)
    if want.requires_grad:
        want.backward(grad_out)
    if bound.requires_grad:
        bound.backward(grad_out.double().abs())

    if x.grad is None:  # allowed only when no row reached any branch (x anchored, undefined gradient)
        assert x_i.grad is None or torch.count_nonzero(x_i.grad) == 0, "x.grad"
    else:
        assert_within(x.grad, _grad(x_i, x), _grad(x_a, x_a), dtype, n + 16, "x.grad")
    g = ref_gate()
    live = torch.arange(n) == g if isinstance(g, int) else ref.live_mask(g, n).any(0)
    for i in range(n):
        for (name, p), pi, pa in zip(module[i].named_parameters(), br_i[i].parameters(), br_a[i].parameters()):
            what = f"branches[{i}].{name}.grad"
            if live[i]:  # the whole batch (even an empty one) or some rows reached it
                assert_within(p.grad, pi.grad, pa.grad, dtype, batch + 16, what)
            elif batch == 0:  # an empty batch may run a branch on zero rows: zeros or undefined
                assert p.grad is None or torch.count_nonzero(p.grad) == 0, what
            elif materialize and not functional:
                assert p.grad is not None and torch.count_nonzero(p.grad) == 0, f"{what}: zeros"
            else:
                assert p.grad is None, f"{what}: undefined (the branch did not run)"
    if kind == "float_grad":
        numel_row = row_numel(trailing)
        low = dtype if eps(dtype) >= eps(gate.dtype) else gate.dtype
        # undefined only when nothing ran (no graph, as for if/else)
        assert gate.grad is not None or torch.count_nonzero(gate.detach()) == 0, "gate.grad undefined"
        got = _grad(gate, gate)
        assert_within(got, _grad(gate_i, gate), _grad(gate_a, gate_a), low, numel_row + 16, "gate.grad")
        assert torch.count_nonzero(got[gate.detach() == 0]) == 0


# ----------------------------------------------------------------------------------------------
# drop_add_residual / ResidualDropPath against the dense formula x + coef * branch(x)


@fuzz("residual")
@given(**DROP_CASES, materialize=st.sampled_from([True, True, None, False]))
def test_residual(batch, trailing, dtype, layout, p, mode, scale_by_keep, training, module, seed, materialize):
    RAN["residual"] += 1
    gen = torch.Generator().manual_seed(seed)
    linear = len(trailing) == 1
    (branch,) = make_branches(1, trailing, dtype, gen, linear)
    x = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")
    g = torch.Generator().manual_seed(seed)
    b_m = copy.deepcopy(branch)
    if module:
        out = mb.ResidualDropPath(b_m, p, mode=mode, scale_by_keep=scale_by_keep, generator=g, materialize_grads=materialize).train(training)(x)
    else:
        out = mb.drop_add_residual(x, b_m, p, training, mode=mode, scale_by_keep=scale_by_keep, generator=g, materialize_grads=materialize)
    assert out.shape == x.shape and out.dtype == dtype

    if training and p > 0:
        coef = (_mask(batch, p, mode, seed).double() * _factor(p, scale_by_keep, dtype)).to(dtype)
    else:
        coef = torch.ones(batch, dtype=dtype)
    shape = (-1, *([1] * len(trailing)))

    def dense(br, xx):
        return xx + coef.to(xx.dtype).reshape(shape) * br(xx)

    b_r, x_r = copy.deepcopy(branch), x.detach().clone().requires_grad_(True)
    want = dense(b_r, x_r)
    b_a, x_a = abs_branch(branch), x.detach().double().requires_grad_(True)
    bound = dense(b_a, x_a)  # its gradients are the absolute bounds; its value |x| + coef * |branch(x)| once x is |x|
    with torch.no_grad():
        out_bound = x_a.abs() + coef.double().abs().reshape(shape) * b_a(x_a)
    assert_within(out.detach(), want.detach(), out_bound, dtype, 3, "out")
    out.backward(grad_out)
    want.backward(grad_out)
    bound.backward(grad_out.double().abs())
    assert_within(x.grad, x_r.grad, x_a.grad, dtype, 16, "x.grad")
    ran = bool((coef != 0).any())
    for (name, pm), pr, pa in zip(b_m.named_parameters(), b_r.parameters(), b_a.parameters()):
        if batch == 0:  # the branch may run on the empty batch or be skipped: zeros or undefined
            assert pm.grad is None or torch.count_nonzero(pm.grad) == 0, name
        elif ran:
            assert_within(pm.grad, pr.grad, pa.grad, dtype, batch + 16, f"branch.{name}.grad")
        elif materialize:  # the branch never ran: zeros (the default, as the dense formula gives)
            assert pm.grad is not None and torch.count_nonzero(pm.grad) == 0, name
        else:  # or an undefined gradient
            assert pm.grad is None, name


def test_example_count():
    """Runs last: each property of this file ran its examples (when the whole file ran)."""
    check_example_count(["masked_branch", "residual"])
