"""The compiled ops against maskedbranch.reference, on every device (harness.DEVICES: CUDA cases
skip without a GPU and a CUDA build): plan, gather, combine and combine_weights_backward in every
dtype and layout, float64 gradcheck of the differentiable functions, opcheck of every op,
determinism. Errors, hand-made plans, device handling and CUDA graphs: tests/test_ops_checks.py."""
import pytest
import torch

import maskedbranch as mb
from harness import GATE_KINDS, TOL, intra_op_threads, random_gate
from maskedbranch import _draws
from maskedbranch import functional as F
from maskedbranch import reference as ref

ops = torch.ops.maskedbranch
PLAN_FIELDS = ["offsets", "rows", "row_offsets", "row_branch", "row_pos"]
GATES = ["ids", "bool", "float32", "float64", "float16", "bfloat16"]


def make_gate(kind, batch, n, gen, device):
    if kind.startswith("float") or kind == "bfloat16":
        return random_gate("float", batch, n, gen, dtype=getattr(torch, kind)).to(device)
    return random_gate(kind, batch, n, gen).to(device)


def randn(*shape, gen, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def unaligned(t):
    """A copy of ``t`` one element past an aligned address (the kernels' scalar paths)."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return out.copy_(t)


def counts_of(offsets):
    return offsets.diff().tolist()


def row_plan(plan):
    return plan[2], plan[3], plan[4]


# ---------------------------------------------------------------------------------------------
# plan


@pytest.mark.parametrize("kind", GATES)
@pytest.mark.parametrize("batch,n", [(0, 3), (1, 1), (9, 1), (33, 4), (50, 16), (257, 100), (2000, 3), (5000, 1)])
def test_plan_matches_reference(device, kind, batch, n):
    """Sizes cover several tiles of the CUDA plan kernels in both directions (>64 branches)."""
    gate = make_gate(kind, batch, n, torch.Generator().manual_seed(batch * 31 + n), device)
    got, want = ops.plan(gate, n), ref.plan(gate, n)
    assert got[0].device.type == "cpu", "offsets live on the host"
    for name, g, w in zip(PLAN_FIELDS, got, want):
        assert g.dtype == torch.int64 and (name == "offsets" or g.device == gate.device), name
        assert torch.equal(g.cpu(), w.cpu()), name


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_plan_integer_ids(device, dtype):
    ids = torch.tensor([2, 0, 1, 0, -1, 2], dtype=torch.int64).clamp(min=0 if dtype == torch.uint8 else -1)
    ids = ids.to(dtype).to(device)
    plan = mb.make_plan(ids, 3)
    want = ref.plan(ids, 3)
    assert plan.counts == counts_of(want[0])
    for g, w in zip(plan[1:], want[1:]):
        assert torch.equal(g.cpu(), w.cpu())


def test_plan_stable_order_and_non_contiguous_gates(device, gen):
    gate = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]], dtype=torch.bool, device=device)
    plan = mb.make_plan(gate, 3)
    assert plan.counts == [2, 2, 2]
    assert plan.rows.tolist() == [0, 2, 2, 3, 0, 2]
    assert plan.row_offsets.tolist() == [0, 2, 2, 5, 6]
    assert plan.row_branch.tolist() == [0, 2, 0, 1, 2, 1]
    assert plan.row_pos.tolist() == [0, 4, 1, 2, 5, 3]
    weights = random_gate("float", 40, 6, gen).t().contiguous().t().to(device)  # column-major
    ids = torch.randint(-1, 5, (80,), generator=gen).to(device)[::2]
    for g, n in [(weights, 6), (ids, 5)]:
        assert not g.is_contiguous()
        for got, want in zip(ops.plan(g, n), ref.plan(g.contiguous(), n)):
            assert torch.equal(got.cpu(), want.cpu())


# ---------------------------------------------------------------------------------------------
# gather, combine, combine_weights_backward against the reference

TRAILING = [(), (1,), (3,), (8,), (4, 16), (2, 3, 7), (0,), (4099,)]


@pytest.mark.parametrize("trailing", TRAILING, ids=str)
@pytest.mark.parametrize("weighted", [False, True])
def test_gather_matches_reference(device, dtype, gen, trailing, weighted):
    n, batch = 5, 37
    gate = make_gate("bool", batch, n, gen, device)
    offsets, rows, *_ = ops.plan(gate, n)
    x = randn(batch, *trailing, gen=gen, dtype=dtype, device=device)
    w = randn(batch, n, gen=gen, device=device) if weighted else None
    got = ops.gather(x, rows, w, counts_of(offsets))
    want = ref.gather(x, rows, w, counts_of(offsets))
    assert len(got) == n
    for g, r in zip(got, want):
        assert g.dtype == dtype and g.device == x.device
        assert torch.equal(g, r)  # one rounding of w * x in opmath, as the reference does
    if weighted and x.numel():  # the scalar path (unaligned input) gives the same bits
        for g, r in zip(ops.gather(unaligned(x), rows, w.double(), counts_of(offsets)), want):
            assert torch.equal(g, r)


@pytest.mark.parametrize("layout", ["random", "clustered", "descending"])
@pytest.mark.parametrize("threads", [1, 3])
def test_gather_by_source_blocks(gen, layout, threads):
    """The CPU gather sweeps x by blocks of source rows, split between tasks by entries, when each
    branch's rows ascend (plans from `plan`), and copies in packed order otherwise: both paths,
    with several tasks and blocks, entries crowded into a few rows, and hand-made descending rows."""
    batch, d, n = 3000, 96, 4  # 341 rows per task, 682 rows per block
    ids = torch.randint(0, n, (batch,), generator=gen)
    if layout == "clustered":  # every entry in the first third of the rows: 3 tasks split those
        ids[batch // 3:] = -1
    offsets, rows, *_ = ops.plan(ids, n)
    counts = counts_of(offsets)
    if layout == "descending":
        rows = torch.cat([r.flip(0) for r in rows.split(counts)])
    x = randn(batch, d, gen=gen)
    w = randn(batch, n, gen=gen)
    with intra_op_threads(threads):
        for weights in (None, w):
            got = ops.gather(x, rows, weights, counts)
            for g, r in zip(got, ref.gather(x, rows, weights, counts)):
                assert torch.equal(g, r)


@pytest.mark.parametrize("kind", GATE_KINDS)
@pytest.mark.parametrize("n", [1, 3, 70])
def test_combine_matches_reference(device, dtype, gen, kind, n):
    """n = 70 sends the branch pointers (combine's inputs, gather's outputs) through the device table."""
    batch, trailing = 41, (3, 8)
    gate = make_gate(kind if kind != "float" else "float32", batch, n, gen, device)
    offsets, rows, ro, rb, rp = ops.plan(gate, n)
    ys = [randn(c, *trailing, gen=gen, dtype=dtype, device=device) for c in counts_of(offsets)]
    base = randn(batch, *trailing, gen=gen, dtype=dtype, device=device)
    weights = gate if kind == "float" else None
    for b, w in [(base, weights), (None, weights), (base, None), (None, None)]:
        got = ops.combine(b, ys, w, ro, rb, rp)
        assert got.dtype == dtype and got.shape == (batch, *trailing)
        torch.testing.assert_close(got, ref.combine(b, ys, w, ro, rb, rp), **TOL[dtype])
    for got, want in zip(ops.gather(base, rows, weights, counts_of(offsets)),
                         ref.gather(base, rows, weights, counts_of(offsets))):
        assert torch.equal(got, want)
    # gather is combine's adjoint: <combine(ys), g> == sum_i <ys[i], gather(g)[i]>
    g = randn(batch, *trailing, gen=gen, dtype=torch.float64, device=device)
    ys64 = [y.double() for y in ys]
    lhs = (ops.combine(None, ys64, weights, ro, rb, rp) * g).sum()
    rhs = sum((y * gy).sum() for y, gy in zip(ys64, ops.gather(g, rows, weights, counts_of(offsets))))
    torch.testing.assert_close(lhs, rhs, **TOL[torch.float64])


def _dot_bound(grad, ys, plan):
    """|error| bound of dot products summed in any order in opmath: 16 eps sum |g * y|."""
    absolute = ref.combine_weights_backward(grad.double().abs(), [y.double().abs() for y in ys], *row_plan(plan))
    eps = torch.finfo(ref.opmath_dtype(grad.dtype)).eps
    return 16 * eps * absolute.cpu() + 1e-30


@pytest.mark.parametrize("batch,d", [(300, 8), (50, 3000), (3, 40000), (2, 2**18 + 4)])
def test_combine_weights_backward_matches_reference(device, dtype, gen, batch, d):
    """Short rows (a warp each on CUDA), long rows (a block each), few long rows (split)."""
    n = 3
    gate = make_gate("float32", batch, n, gen, device)
    gate[0] = torch.tensor([0.5, 0.0, 0.25])
    plan = ops.plan(gate, n)
    ys = [randn(c, d, gen=gen, dtype=dtype, device=device) for c in counts_of(plan[0])]
    grad = randn(batch, d, gen=gen, dtype=dtype, device=device)
    got = ops.combine_weights_backward(grad, ys, *row_plan(plan))
    assert got.dtype == ref.opmath_dtype(dtype) and got.shape == (batch, n)
    want = ref.combine_weights_backward(grad.double(), [y.double() for y in ys], *row_plan(plan))
    assert ((got.double() - want).abs().cpu() <= _dot_bound(grad, ys, plan)).all()
    assert (got[gate == 0] == 0).all()
    assert torch.equal(got, ops.combine_weights_backward(grad, ys, *row_plan(plan)))


def test_empty_batch_empty_rows_and_one_branch(device, dtype):
    for batch, trailing, n in [(0, (4,), 3), (6, (0,), 2), (0, (), 1), (5, (3,), 1)]:
        gate = torch.zeros(batch, dtype=torch.long, device=device)  # every row to branch 0
        offsets, rows, ro, rb, rp = ops.plan(gate, n)
        x = torch.ones(batch, *trailing, dtype=dtype, device=device)
        parts = ops.gather(x, rows, None, counts_of(offsets))
        assert [p.shape for p in parts] == [(c, *trailing) for c in counts_of(offsets)]
        assert torch.equal(parts[0], x)
        out = ops.combine(x, parts, None, ro, rb, rp)
        assert torch.equal(out, 2 * x)
        dw = ops.combine_weights_backward(x, parts, ro, rb, rp)
        assert dw.shape == (batch, n) and torch.equal(dw[:, 0], x.reshape(batch, -1 if batch else 0).double().pow(2).sum(1).to(dw.dtype))


# ---------------------------------------------------------------------------------------------
# layouts


@pytest.mark.parametrize("fmt,shape", [(torch.channels_last, (10, 6, 5, 4)), (torch.channels_last_3d, (10, 4, 2, 3, 5))])
def test_channels_last_is_preserved(device, dtype, gen, fmt, shape):
    gate = make_gate("float32", 10, 3, gen, device)
    offsets, rows, ro, rb, rp = ops.plan(gate, 3)
    x = randn(*shape, gen=gen, dtype=dtype, device=device).to(memory_format=fmt)
    parts = ops.gather(x, rows, gate, counts_of(offsets))
    assert all(p.is_contiguous(memory_format=fmt) for p in parts)
    for p, r in zip(parts, ref.gather(x, rows, gate, counts_of(offsets))):
        assert torch.equal(p, r)
    ys = [p.contiguous() for p in parts]  # brought to the layout of base
    out = ops.combine(x, ys, gate, ro, rb, rp)
    assert out.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(out, ref.combine(x, ys, gate, ro, rb, rp), **TOL[dtype])


def test_non_contiguous_and_unaligned_inputs(device, dtype, gen):
    gate = make_gate("float32", 12, 2, gen, device)
    offsets, rows, ro, rb, rp = ops.plan(gate, 2)
    x = randn(12, 8, 6, gen=gen, dtype=dtype, device=device)[:, ::2, 1:]  # a strided view
    base = randn(12, 5, 4, gen=gen, dtype=dtype, device=device).transpose(1, 2)  # another layout
    parts = ops.gather(x, rows, None, counts_of(offsets))
    for p, r in zip(parts, ref.gather(x, rows, None, counts_of(offsets))):
        assert torch.equal(p, r)
    ys = [unaligned(p) if p.numel() else p for p in parts]
    for b in [base, unaligned(base.contiguous())]:
        torch.testing.assert_close(ops.combine(b, ys, gate, ro, rb, rp), ref.combine(b, ys, gate, ro, rb, rp), **TOL[dtype])
    grad = unaligned(randn(12, 4, 5, gen=gen, dtype=dtype, device=device))
    want = ref.combine_weights_backward(grad.double(), [y.double() for y in ys], ro, rb, rp)
    assert ((ops.combine_weights_backward(grad, ys, ro, rb, rp).double() - want).abs().cpu()
            <= _dot_bound(grad, ys, (None, None, ro, rb, rp))).all()


# ---------------------------------------------------------------------------------------------
# determinism


def test_bitwise_deterministic(device, gen):
    batch, n, d = 300, 100, 96
    gate = make_gate("float32", batch, n, gen, device)
    x = randn(batch, d, gen=gen, device=device)
    long_gate = torch.tensor([[1.0, 0.5], [0.0, 1.0], [1.0, 1.0], [0.25, 0.0]], device=device)
    long_grad = randn(4, 2**17, gen=gen, device=device)

    def run():
        offsets, rows, ro, rb, rp = plan = ops.plan(gate, n)
        parts = ops.gather(x, rows, gate, counts_of(offsets))
        lplan = ops.plan(long_gate, 2)
        lys = ops.gather(long_grad, lplan[1], None, counts_of(lplan[0]))
        return [*plan, *parts, ops.combine(x, parts, gate, ro, rb, rp),
                ops.combine_weights_backward(x, parts, ro, rb, rp),
                ops.combine_weights_backward(long_grad, lys, *row_plan(lplan))]

    first = run()
    with intra_op_threads(1 if torch.get_num_threads() > 1 else 2):  # CPU results must not depend on it
        second = run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------------
# autograd: the differentiable functions, float64 gradcheck, and the route against if/else


@pytest.mark.parametrize("kind", GATE_KINDS)
def test_gradcheck(device, gen, kind):
    n, batch = 3, 11
    gate = make_gate(kind if kind != "float" else "float64", batch, n, gen, device)
    plan = mb.make_plan(gate, n)
    x = randn(batch, 4, gen=gen, dtype=torch.float64, device=device).requires_grad_()
    base = randn(batch, 4, gen=gen, dtype=torch.float64, device=device).requires_grad_()
    ys = [randn(c, 4, gen=gen, dtype=torch.float64, device=device).requires_grad_() for c in plan.counts]
    w = gate.clone().requires_grad_() if kind == "float" else randn(batch, n, gen=gen, dtype=torch.float64, device=device).requires_grad_()
    p = torch.nn.Parameter(randn(3, gen=gen, dtype=torch.float64, device=device))

    assert torch.autograd.gradcheck(lambda x: tuple(F.gather(x, plan)), (x,))
    # The weights' gradient at live entries; a dead entry is never read (its gradient is 0).
    assert torch.autograd.gradcheck(lambda w, b, *ys: F.combine(ys, plan, weights=w, base=b), (w, base, *ys))
    assert torch.autograd.gradcheck(lambda *ys: F.combine(ys, plan), tuple(ys))
    for materialize in (False, True):
        assert torch.autograd.gradcheck(lambda x, p: F.tie(x * 2, [p], materialize), (x, p))

    def route(x, w):  # gather -> branches -> combine, as MaskedBranch runs it
        return F.combine([torch.sin(y) * (i + 2) for i, y in enumerate(F.gather(x, plan))], plan, weights=w)

    assert torch.autograd.gradcheck(route, (x, w))


def test_route_matches_ifelse_reference(device, dtype, gen):
    """gather -> branch -> combine with gradients, against the if/else reference."""
    n, batch = 4, 37
    gate = make_gate("float32", batch, n, gen, device)
    branches = [lambda y, i=i: torch.tanh(y) * (i + 1) for i in range(n)]
    x = randn(batch, 5, 3, gen=gen, dtype=dtype, device=device)
    inputs = [x.clone().requires_grad_(), gate.clone().requires_grad_()]
    plan = mb.make_plan(gate, n)
    out = F.combine([br(y) for br, y in zip(branches, F.gather(inputs[0], plan))], plan, weights=inputs[1])
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    want = ref.masked_branch_ifelse(branches, ref_inputs[0], ref_inputs[1])
    torch.testing.assert_close(out, want, **TOL[dtype])
    grad = randn(*out.shape, gen=gen, dtype=dtype, device=device)
    got_grads = torch.autograd.grad(out, inputs, grad)
    want_grads = torch.autograd.grad(want, ref_inputs, grad)
    assert got_grads[1].dtype == torch.float32
    torch.testing.assert_close(got_grads[0], want_grads[0], **TOL[dtype])
    torch.testing.assert_close(got_grads[1], want_grads[1] * (gate != 0), **TOL[dtype])


def test_raw_ops_are_not_differentiable(device):
    x = torch.ones(3, 2, device=device, requires_grad=True)
    offsets, rows, *_ = ops.plan(torch.tensor([0, 1, 0], device=device), 2)
    parts = ops.gather(x, rows, None, counts_of(offsets))
    with pytest.raises(RuntimeError, match="not implemented|does not require grad"):
        sum(p.sum() for p in parts).backward()


# ---------------------------------------------------------------------------------------------
# opcheck: schema, fake kernels (shapes, dtypes, layouts), autograd registration, dynamic shapes


@pytest.mark.parametrize("kind", GATE_KINDS)
@pytest.mark.parametrize("n", [3, 70])
def test_opcheck(device, gen, kind, n):
    batch = 12
    gate = make_gate(kind if kind != "float" else "float32", batch, n, gen, device)
    torch.library.opcheck(ops.plan, (gate, n), test_utils=("test_schema", "test_faketensor"))
    offsets, rows, ro, rb, rp = ops.plan(gate, n)
    counts = counts_of(offsets)
    weights = gate if kind == "float" else None
    xs = [randn(batch, 4, 3, gen=gen, device=device),
          randn(batch, 4, 3, 2, gen=gen, device=device).to(memory_format=torch.channels_last)]
    for x in xs[: 2 if n <= 3 else 1]:  # (opcheck of 70 outputs is slow: one layout)
        torch.library.opcheck(ops.gather, (x, rows, weights, counts))
        ys = [y.contiguous() for y in ops.gather(x, rows, None, counts)]
        torch.library.opcheck(ops.combine, (x, ys, weights, ro, rb, rp))
        torch.library.opcheck(ops.combine, (None, ys, None, ro, rb, rp))
        torch.library.opcheck(ops.combine_weights_backward, (x, ys, ro, rb, rp))


# ---------------------------------------------------------------------------------------------
# keep_draw: the compiled drop paths' draw (maskedbranch/_draws.py), eager's draw from the same
# generator; the rate is a float64 tensor (a float argument would be specialized when compiled).


def _rate(p):
    return torch.tensor(p, dtype=torch.float64)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_keep_draw_equals_the_eager_draw(p):
    order = torch.zeros(1, dtype=torch.int64)
    torch.manual_seed(5)
    got = torch.ops.maskedbranch.keep_draw(order, 37, _rate(p))
    want = _draws.draw(37, p, torch.Generator().manual_seed(5))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert int(order) == 1  # every draw advances the token


def test_keep_draw_refuses_bad_rates():
    order = torch.zeros(1, dtype=torch.int64)
    for bad in (torch.tensor(0.5), torch.tensor([0.5, 0.5], dtype=torch.float64), _rate(1.5)):
        with pytest.raises(ValueError, match="keep_prob"):
            torch.ops.maskedbranch.keep_draw(order, 3, bad)
    with pytest.raises((TypeError, RuntimeError)):
        torch.ops.maskedbranch.keep_draw(order, 3, 0.5)  # a float: the old schema


def test_keep_draw_opcheck():
    torch.library.opcheck(torch.ops.maskedbranch.keep_draw, (torch.zeros(1, dtype=torch.int64), 6, _rate(0.5)),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
