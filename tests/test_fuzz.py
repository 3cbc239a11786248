"""Property-based fuzzing (hypothesis) of the routing ops and drop_path against
maskedbranch.reference: the plan, gather -> per-branch function -> combine (with base, weights
and tied tensors) and timm's drop_path formula, for B from 0, N from 1 to 16, every floating
dtype, every gate kind and pattern, and contiguous, strided, sliced, transposed and
channels_last inputs. Derandomized: CI runs the same examples every time. The error bound is
explained in tests/fuzzing.py.
"""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import maskedbranch as mb
from fuzzing import (  # noqa: F401 - one_thread is an autouse fixture
    DROP_CASES, DTYPES, LAYOUTS, RAN, _factor, _grad, _mask, assert_within, batches, branch_counts, check_example_count,
    densities, fuzz, gate_dtypes, gate_patterns, make_gate, make_x, one_thread, row_numel, seeds, trailing_shapes,
)
from maskedbranch import reference as ref


# plan


@fuzz("plan")
@given(
    batch=batches,
    n=branch_counts,
    kind=st.sampled_from(["ids", "bool", "float"]),
    pattern=gate_patterns,
    density=densities,
    transposed=st.booleans(),
    data=st.data(),
    seed=seeds,
)
def test_plan(batch, n, kind, pattern, density, transposed, data, seed):
    RAN["plan"] += 1
    dtype = data.draw(gate_dtypes(kind), label="gate dtype")
    gate = make_gate(torch.Generator().manual_seed(seed), kind, pattern, density, batch, n, dtype, transposed)
    got = mb.make_plan(gate, n)
    offsets, rows, row_offsets, row_branch, row_pos = ref.plan(gate, n)
    assert got.counts == offsets.diff().tolist()
    for name, g, w in [("rows", got.rows, rows), ("row_offsets", got.row_offsets, row_offsets),
                       ("row_branch", got.row_branch, row_branch), ("row_pos", got.row_pos, row_pos)]:
        assert torch.equal(g, w), name
    assert got.num_rows == batch and got.num_entries == int(ref.live_mask(gate, n).sum())


# ----------------------------------------------------------------------------------------------
# gather -> per-branch function -> combine (the public functional ops), against the if/else
# reference with the same per-branch functions


def branch_fns(n: int):
    return [lambda t, i=i: t * (i + 1) for i in range(n)]


@fuzz("route")
@given(
    batch=batches,
    n=branch_counts,
    trailing=trailing_shapes,
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    kind=st.sampled_from(["ids", "bool", "float"]),
    pattern=gate_patterns,
    density=densities,
    with_base=st.booleans(),
    weights_dtype=st.sampled_from([None, torch.float32, torch.float64]),
    weights_grad=st.booleans(),
    materialize=st.booleans(),
    seed=seeds,
)
def test_route(batch, n, trailing, dtype, layout, kind, pattern, density, with_base, weights_dtype, weights_grad, materialize, seed):
    RAN["route"] += 1
    gen = torch.Generator().manual_seed(seed)
    gdtype = (weights_dtype or dtype) if kind == "float" else (torch.int64 if kind == "ids" else torch.bool)
    gate = make_gate(gen, kind, pattern, density, batch, n, gdtype, transposed=False)
    x = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    base = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True) if with_base else None
    weights = gate.clone().requires_grad_(weights_grad) if kind == "float" else None
    tied = torch.ones(3, dtype=dtype, requires_grad=True)  # e.g. a dead branch's parameter
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")

    plan = mb.make_plan(gate, n)
    ys = [f(xi) for f, xi in zip(branch_fns(n), mb.gather(x, plan))]
    out = mb.combine(ys, plan, weights=weights, base=base, tied=[tied], materialize_grads=materialize)
    # outputs take the layout of the first input (base, else ys[0]; an empty ys[0] has none)
    first_rows = batch if with_base else plan.counts[0]
    if layout == "channels_last" and x.dim() == 4 and first_rows > 0 and trailing[0] > 1 and trailing[1] * trailing[2] > 1:
        assert out.is_contiguous(memory_format=torch.channels_last)

    leaves = [x] + ([base] if base is not None else []) + ([weights] if weights is not None and weights_grad else [])
    r_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    a_leaves = [t.detach().double().abs().requires_grad_(True) for t in leaves]  # for the bounds

    def reference(ls, absolute=False):
        """base + if/else routing, on [B, D] views (index_add is very slow on small 4-D tensors)."""
        it = iter(ls)
        xx = next(it)
        bb = next(it) if base is not None else None
        ww = next(it) if weights is not None and weights_grad else None
        if ww is None and weights is not None:
            ww = weights.detach().double().abs() if absolute else weights.detach()
        g = gate if ww is None else ww
        flat = (batch, row_numel(trailing))
        y = ref.masked_branch_ifelse(branch_fns(n), xx.reshape(flat), g, n)
        y = torch.zeros(flat, dtype=xx.dtype) if y is None else y
        if bb is not None:
            y = bb.reshape(flat) + y
        return y.reshape(batch, *trailing)

    want = reference(r_leaves)
    absref = reference(a_leaves, absolute=True)
    terms = n + 1
    assert_within(out.detach(), want.detach(), absref.detach(), dtype, terms, "out")

    out.backward(grad_out)
    if want.requires_grad:
        want.backward(grad_out)
        absref.backward(grad_out.double().abs())
    numel_row = row_numel(trailing)
    for i, (g, r, a) in enumerate(zip(leaves, r_leaves, a_leaves)):
        is_weights = weights is not None and weights_grad and i == len(leaves) - 1
        k = numel_row if is_weights else terms
        assert_within(_grad(g, g), _grad(r, g), _grad(a, a), dtype, k, f"grad of leaf {i}")
        if is_weights:  # zero entries get a zero gradient (the branch never ran there)
            assert torch.count_nonzero(g.grad[gate == 0]) == 0
    assert (tied.grad is not None and torch.count_nonzero(tied.grad) == 0) if materialize else tied.grad is None


# ----------------------------------------------------------------------------------------------
# drop_path / DropPath against timm's formula with the mask drawn from the same generator


@fuzz("drop_path")
@given(**DROP_CASES)
def test_drop_path(batch, trailing, dtype, layout, p, mode, scale_by_keep, training, module, seed):
    RAN["drop_path"] += 1
    gen = torch.Generator().manual_seed(seed)
    x = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")
    g = torch.Generator().manual_seed(seed)
    if module:
        m = mb.DropPath(p, scale_by_keep=scale_by_keep, mode=mode, generator=g).train(training)
        out = m(x)
    else:
        out = mb.drop_path(x, p, training, scale_by_keep=scale_by_keep, mode=mode, generator=g)
    if not training or p == 0.0:
        assert out is x
        return
    mask = _mask(batch, p, mode, seed, dtype).double()
    # (where, not a product: a factor beyond the dtype's range is inf, and 0 * inf is nan)
    coef = torch.where(mask != 0, torch.tensor(_factor(p, scale_by_keep, dtype), dtype=torch.float64), 0.0).to(dtype)
    assert set(coef.unique().tolist()) <= {0.0, _factor(p, scale_by_keep, dtype)}
    x_r = x.detach().clone().requires_grad_(True)
    want = x_r * coef.reshape(-1, *([1] * len(trailing)))
    absref = x.detach().double().abs() * coef.double().abs().reshape(-1, *([1] * len(trailing)))
    assert_within(out.detach(), want.detach(), absref, dtype, 1, "out")
    out.backward(grad_out)
    want.backward(grad_out)
    assert_within(x.grad, x_r.grad, grad_out.double().abs() * coef.double().abs().reshape(-1, *([1] * len(trailing))), dtype, 1, "x.grad")
    if layout == "channels_last" and x.dim() == 4 and mode == "row" and batch > 1 and trailing[0] > 1:
        assert out.is_contiguous(memory_format=torch.channels_last)


def test_example_count():
    """Runs last: each property of this file ran its examples (when the whole file ran)."""
    check_example_count(["plan", "route", "drop_path"])
