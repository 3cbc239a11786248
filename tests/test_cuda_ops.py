"""The CUDA kernels against the CPU kernels: every op, outputs and gradients, dtypes, layouts,
alignment, empty inputs, the pointer-table fallback beyond 64 branches, determinism, the plan's
single readback and error messages, no synchronization elsewhere, and opcheck with CUDA inputs.

Skips without a GPU (or with a build that has no CUDA kernels). The test logic itself can be
dry-run on a machine without a GPU with MASKEDBRANCH_TEST_DEVICE=cpu (CPU against CPU; the
CUDA-only checks skip)."""
import os
import warnings

import pytest
import torch

import maskedbranch as mb

ops = torch.ops.maskedbranch
DEVICE = os.environ.get("MASKEDBRANCH_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"

pytestmark = [
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(ON_CUDA and not mb.WITH_CUDA, reason="this maskedbranch build has no CUDA kernels"),
]
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="checks CUDA behaviour")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# The kernels round like the CPU kernels (same operations, same order, no FMA), so values
# agree to the last bit on x86 hosts; allow an ulp or two in case a host compiler contracts.
CLOSE = {
    torch.float64: dict(atol=1e-14, rtol=1e-14),
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=8e-3, rtol=8e-3),
}
# Dot products (weights' gradients) sum in another order than the CPU.
DOT = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}
PLAN_NAMES = ["offsets", "rows", "row_offsets", "row_branch", "row_pos"]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def dev(t):
    """A copy of a CPU tensor (or None) on the device under test, keeping its layout."""
    if t is None:
        return None
    return t.to(DEVICE)


def random_gate(kind, batch, n, g, dtype=torch.float32):
    if kind == "ids":
        return torch.randint(-1, n, (batch,), generator=g)
    if kind == "bool":
        return torch.rand(batch, n, generator=g) < 0.5
    w = torch.rand(batch, n, generator=g)
    return torch.where(w < 0.4, torch.zeros_like(w), w).to(dtype)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def unaligned(t):
    """A copy of `t` whose data pointer is one element past an aligned one."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    assert out.storage_offset() == 1
    return out


def assert_plans_equal(cpu_plan, dev_plan):
    assert dev_plan[0].device.type == "cpu", "offsets must live on the host"
    for name, c, d in zip(PLAN_NAMES, cpu_plan, dev_plan):
        if name != "offsets":
            assert d.device.type == DEVICE, name
        assert d.dtype == torch.int64, name
        assert torch.equal(c, d.cpu()), name


def assert_same_layout(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    for fmt in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        if a.dim() in (4, 5) or fmt == torch.contiguous_format:
            try:
                assert a.is_contiguous(memory_format=fmt) == b.is_contiguous(memory_format=fmt), fmt
            except RuntimeError:  # channels_last of the wrong rank
                pass


def assert_close(got, want, tol):
    assert got.device.type == DEVICE
    assert_same_layout(got, want)
    torch.testing.assert_close(got.cpu(), want, **tol)


def plan_both(gate, n):
    """The raw plan on the CPU and on the device under test (from a device gate)."""
    return ops.plan(gate, n), ops.plan(dev(gate), n)


# ---------------------------------------------------------------------------------------------
# plan


SIZES = [(0, 3), (1, 1), (7, 1), (1, 16), (33, 4), (100, 16), (257, 100), (2000, 3)]


@pytest.mark.parametrize("kind", ["ids", "bool", "float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("batch,n", SIZES)
def test_plan_matches_cpu(kind, batch, n):
    g = gen(batch * 131 + n)
    gate = random_gate("float" if kind.startswith("float") or kind == "bfloat16" else kind, batch, n, g,
                       dtype=getattr(torch, kind, torch.float32))
    cpu_plan, dev_plan = plan_both(gate, n)
    assert_plans_equal(cpu_plan, dev_plan)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_plan_integer_id_dtypes(dtype):
    ids = torch.tensor([2, 0, 1, 0, 2, 2], dtype=dtype)
    assert_plans_equal(*plan_both(ids, 3))


def test_plan_all_dead_all_live_and_one_branch():
    for gate, n in [
        (torch.full((50,), -1), 4),
        (torch.zeros(50, 4, dtype=torch.bool), 4),
        (torch.ones(50, 4, dtype=torch.bool), 4),
        (torch.zeros(50, dtype=torch.long), 1),
        (torch.full((50,), 3), 4),
        (torch.tensor([[0.0, -0.0, 1.0]]), 3),
    ]:
        assert_plans_equal(*plan_both(gate, n))


def test_plan_non_contiguous_gate():
    g = gen(3)
    gate = random_gate("float", 40, 6, g).t().contiguous().t()  # [40, 6], column-major
    assert not gate.is_contiguous()
    assert_plans_equal(*plan_both(gate, 6))
    ids = torch.randint(-1, 5, (80,), generator=g)[::2]
    assert_plans_equal(*plan_both(ids, 5))


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e), str(e).split("\nException raised from")[0]
    return None


def _bad_gates():
    many = torch.randint(-1, 3, (100_000,), generator=gen(5))
    many[[777, 50_000, 99_999]] = torch.tensor([9, -5, 3])
    weights = torch.rand(3000, 7, generator=gen(6))
    weights[1234, 5] = float("inf")
    weights[2000, 0] = float("nan")
    weights[2999, 6] = float("-inf")
    cases = [
        (torch.tensor([0, 2]), 2),
        (torch.tensor([0, -2, 5, 7]), 2),
        (torch.tensor([4, 1], dtype=torch.int8), 3),
        (torch.tensor([255, 0], dtype=torch.uint8), 3),
        (many, 3),
        (torch.tensor([[0.5, float("nan")]]), 2),
        (torch.tensor([[float("inf"), 1.0]]), 2),
        (torch.tensor([[0.0, 1.0], [float("-inf"), float("nan")]], dtype=torch.float64), 2),
        (weights, 7),
        (weights.half(), 7),
        (weights.bfloat16(), 7),
        (torch.zeros(3, 2, 2), 2),
        (torch.zeros(3, 3), 2),
        (torch.tensor([0.0, 1.0]), 2),
        (torch.tensor([True, False]), 2),
        (torch.zeros(2, 2, dtype=torch.int32), 2),
        (torch.zeros(2, dtype=torch.long), 0),
    ]
    return cases


@pytest.mark.parametrize("case", range(len(_bad_gates())))
def test_plan_bad_gates_raise_like_cpu(case):
    gate, n = _bad_gates()[case]
    want = _error(lambda: ops.plan(gate, n))
    assert want is not None
    got = _error(lambda: ops.plan(dev(gate), n))
    assert got == want
    # the device is still usable
    assert_plans_equal(*plan_both(torch.tensor([0, 1, -1, 1]), 2))


@cuda_only
@pytest.mark.parametrize("kind", ["ids", "bool", "float32"])
@pytest.mark.parametrize("batch", [0, 1, 1000])
def test_plan_reads_back_once(kind, batch):
    gate = dev(random_gate("float" if kind == "float32" else kind, batch, 5, gen(7)))
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ops.plan(gate, 5)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == (1 if batch > 0 else 0), [str(w.message) for w in syncs]


# ---------------------------------------------------------------------------------------------
# gather / gather_backward


TRAILING = [(), (1,), (3,), (8,), (16,), (3, 5), (4, 16), (2, 3, 7), (0,), (1000,), (4099,)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trailing", TRAILING)
def test_gather_and_backward_match_cpu(dtype, trailing):
    g = gen(11)
    batch, n = 37, 3
    gate = random_gate("bool", batch, n, g)
    cpu_plan, dev_plan = plan_both(gate, n)
    _, rows, row_offsets, _, row_pos = cpu_plan
    _, drows, drow_offsets, _, drow_pos = dev_plan
    x = randn(batch, *trailing, g=g, dtype=dtype)
    want = ops.gather(x, rows, row_offsets, row_pos)
    got = ops.gather(dev(x), drows, drow_offsets, drow_pos)
    assert_close(got, want, dict(atol=0, rtol=0))  # a copy: bit-exact
    grad = randn(rows.numel(), *trailing, g=g, dtype=dtype)
    want = ops.gather_backward(grad, row_offsets, row_pos)
    got = ops.gather_backward(dev(grad), drow_offsets, drow_pos)
    assert_close(got, want, CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_unaligned_and_channels_last(dtype):
    g = gen(12)
    batch, n = 20, 2
    gate = random_gate("ids", batch, n, g)
    (_, rows, ro, _, rp), (_, drows, dro, _, drp) = plan_both(gate, n)
    for x in [randn(batch, 8, g=g, dtype=dtype), randn(batch, 5, 3, g=g, dtype=dtype)]:
        want = ops.gather(x, rows, ro, rp)
        assert_close(ops.gather(unaligned(dev(x)), drows, dro, drp), want, dict(atol=0, rtol=0))
        grad = randn(rows.numel(), *x.shape[1:], g=g, dtype=dtype)
        want = ops.gather_backward(grad, ro, rp)
        assert_close(ops.gather_backward(unaligned(dev(grad)), dro, drp), want, CLOSE[dtype])
    x = randn(batch, 6, 3, 5, g=g, dtype=dtype).to(memory_format=torch.channels_last)
    want = ops.gather(x, rows, ro, rp)
    got = ops.gather(dev(x), drows, dro, drp)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert_close(got, want, dict(atol=0, rtol=0))
    grad = randn(rows.numel(), 6, 3, 5, g=g, dtype=dtype).to(memory_format=torch.channels_last)
    got = ops.gather_backward(dev(grad), dro, drp)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert_close(got, ops.gather_backward(grad, ro, rp), CLOSE[dtype])
    x3 = randn(batch, 4, 2, 3, 5, g=g, dtype=dtype).to(memory_format=torch.channels_last_3d)
    assert_close(ops.gather(dev(x3), drows, dro, drp), ops.gather(x3, rows, ro, rp), dict(atol=0, rtol=0))
    # a non-contiguous input is brought to row blocks first
    xt = randn(batch, 7, 9, g=g, dtype=dtype).transpose(1, 2)
    assert_close(ops.gather(dev(xt), drows, dro, drp), ops.gather(xt, rows, ro, rp), dict(atol=0, rtol=0))


def test_gather_empty_inputs():
    for batch, n, trailing in [(0, 2, (4,)), (5, 2, (0,)), (0, 1, ())]:
        gate = torch.full((batch,), -1) if batch else torch.zeros(0, dtype=torch.long)
        (_, rows, ro, _, rp), (_, drows, dro, _, drp) = plan_both(gate, n)
        x = torch.randn(batch, *trailing)
        assert_close(ops.gather(dev(x), drows, dro, drp), ops.gather(x, rows, ro, rp), dict(atol=0, rtol=0))
        grad = torch.randn(0, *trailing)
        assert_close(ops.gather_backward(dev(grad), dro, drp), ops.gather_backward(grad, ro, rp), dict(atol=0, rtol=0))
    # rows that no branch serves get a zero gradient
    (_, rows, ro, _, rp), (_, drows, dro, _, drp) = plan_both(torch.tensor([-1, -1, -1]), 2)
    got = ops.gather_backward(dev(torch.randn(0, 5)), dro, drp)
    assert torch.equal(got.cpu(), torch.zeros(3, 5))


# ---------------------------------------------------------------------------------------------
# combine and its backwards


def _combine_case(batch, n, trailing, dtype, kind, g, weights_dtype=None):
    gate = random_gate(kind, batch, n, g)
    cpu_plan = ops.plan(gate, n)
    counts = cpu_plan[0].diff().tolist()
    ys = [randn(c, *trailing, g=g, dtype=dtype) for c in counts]
    base = randn(batch, *trailing, g=g, dtype=dtype)
    weights = gate.to(weights_dtype or dtype) if kind == "float" else None
    return gate, cpu_plan, counts, ys, base, weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 16, 64, 65, 100])
@pytest.mark.parametrize("kind", ["ids", "bool", "float"])
def test_combine_and_backwards_match_cpu(dtype, n, kind):
    g = gen(n * 7 + DTYPES.index(dtype))
    batch, trailing = 70, (3, 8)
    gate, cpu_plan, counts, ys, base, weights = _combine_case(batch, n, trailing, dtype, kind, g)
    _, rows, ro, rb, rp = cpu_plan
    dev_plan = ops.plan(dev(gate), n)
    assert_plans_equal(cpu_plan, dev_plan)
    _, drows, dro, drb, drp = dev_plan
    dys = [dev(y) for y in ys]
    for b, w in [(base, weights), (None, weights), (base, None), (None, None)]:
        want = ops.combine(b, ys, w, rows, ro, rb, rp)
        got = ops.combine(dev(b), dys, dev(w), drows, dro, drb, drp)
        assert_close(got, want, CLOSE[dtype])
    grad = randn(batch, *trailing, g=g, dtype=dtype)
    for w in [weights, None]:
        want = ops.combine_backward_ys(grad, w, rows, counts)
        got = ops.combine_backward_ys(dev(grad), dev(w), drows, counts)
        assert_close(got, want, CLOSE[dtype] if w is not None else dict(atol=0, rtol=0))
    for out_dtype in [dtype, torch.float32]:
        want = ops.combine_backward_weights(grad, ys, ro, rb, rp, out_dtype)
        got = ops.combine_backward_weights(dev(grad), dys, dro, drb, drp, out_dtype)
        assert got.dtype == out_dtype
        assert_close(got, want, DOT[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_empty_branches_unaligned_and_channels_last(dtype):
    g = gen(21)
    batch, n = 24, 5
    gate = torch.tensor([0, 3] * 12)  # branches 1, 2 and 4 are empty
    (_, rows, ro, rb, rp), (_, drows, dro, drb, drp) = plan_both(gate, n)
    counts = [12, 0, 0, 12, 0]
    weights = torch.rand(batch, n, generator=g).to(dtype)
    for trailing, make in [((8,), unaligned), ((5, 3), unaligned), ((4, 3, 5), None)]:
        ys = [randn(c, *trailing, g=g, dtype=dtype) for c in counts]
        base = randn(batch, *trailing, g=g, dtype=dtype)
        grad = randn(batch, *trailing, g=g, dtype=dtype)
        if make is None:  # channels_last activations stay channels_last
            ys = [y.to(memory_format=torch.channels_last) for y in ys]
            base = base.to(memory_format=torch.channels_last)
            grad = grad.to(memory_format=torch.channels_last)
            make = dev
        dys = [make(dev(y)) if y.numel() else dev(y) for y in ys]
        want = ops.combine(base, ys, weights, rows, ro, rb, rp)
        got = ops.combine(make(dev(base)), dys, dev(weights), drows, dro, drb, drp)
        assert_close(got, want, CLOSE[dtype])
        want = ops.combine_backward_ys(grad, weights, rows, counts)
        got = ops.combine_backward_ys(make(dev(grad)), dev(weights), drows, counts)
        assert_close(got, want, CLOSE[dtype])
        want = ops.combine_backward_weights(grad, ys, ro, rb, rp, dtype)
        got = ops.combine_backward_weights(make(dev(grad)), dys, dro, drb, drp, dtype)
        assert_close(got, want, DOT[dtype])


def test_combine_mixed_layouts_and_weight_dtypes():
    g = gen(22)
    batch, n = 16, 3
    gate = random_gate("float", batch, n, g)
    cpu_plan = ops.plan(gate, n)
    counts = cpu_plan[0].diff().tolist()
    (_, rows, ro, rb, rp), (_, drows, dro, drb, drp) = cpu_plan, ops.plan(dev(gate), n)
    base = randn(batch, 4, 3, 2, g=g).to(memory_format=torch.channels_last)
    ys = [randn(c, 4, 3, 2, g=g) for c in counts]  # contiguous, brought to channels_last
    for w in [gate.double(), gate.half(), gate.bfloat16()]:
        want = ops.combine(base, ys, w, rows, ro, rb, rp)
        got = ops.combine(dev(base), [dev(y) for y in ys], dev(w), drows, dro, drb, drp)
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert_close(got, want, CLOSE[torch.float32])


def test_combine_empty_inputs():
    for batch, trailing in [(0, (4,)), (6, (0,)), (0, ())]:
        gate = torch.zeros(batch, 2, dtype=torch.bool)
        (_, rows, ro, rb, rp), (_, drows, dro, drb, drp) = plan_both(gate, 2)
        ys = [torch.randn(0, *trailing), torch.randn(0, *trailing)]
        base = torch.randn(batch, *trailing)
        for b in [base, None]:
            want = ops.combine(b, ys, None, rows, ro, rb, rp)
            got = ops.combine(dev(b), [dev(y) for y in ys], None, drows, dro, drb, drp)
            assert_close(got, want, dict(atol=0, rtol=0))
        grad = torch.randn(batch, *trailing)
        assert_close(ops.combine_backward_ys(dev(grad), None, drows, [0, 0]),
                     ops.combine_backward_ys(grad, None, rows, [0, 0]), dict(atol=0, rtol=0))
        assert_close(ops.combine_backward_weights(dev(grad), [dev(y) for y in ys], dro, drb, drp, torch.float32),
                     ops.combine_backward_weights(grad, ys, ro, rb, rp, torch.float32), dict(atol=0, rtol=0))


def _dot_bound(grad, ys, plan, dtype):
    """|error| bound of a dot product summed in any order: c * eps * sum |g * y|."""
    _, _, ro, rb, rp = plan
    starts = [0]
    for y in ys:
        starts.append(starts[-1] + y.shape[0])
    bound = torch.zeros(grad.shape[0], len(ys), dtype=torch.float64)
    g = grad.double().flatten(1).abs()
    for b in range(grad.shape[0]):
        for e in range(ro[b], ro[b + 1]):
            i = int(rb[e])
            y = ys[i][int(rp[e]) - starts[i]].double().flatten().abs()
            bound[b, i] = (g[b] * y).sum()
    eps = 1e-14 if dtype == torch.float64 else 1e-6
    return bound * eps * 16 + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,d", [(300, 8), (50, 3000), (3, 40000), (2, 2 ** 18 + 4), (5, 2 ** 17 + 3)])
def test_combine_backward_weights_paths(dtype, batch, d):
    """Warp per row, block per row, and rows split into chunks (few long rows)."""
    g = gen(batch + d)
    n = 3
    gate = random_gate("float", batch, n, g)
    gate[0] = torch.tensor([0.5, 0.0, 0.25])
    cpu_plan = ops.plan(gate, n)
    counts = cpu_plan[0].diff().tolist()
    ys = [randn(c, d, g=g, dtype=dtype) for c in counts]
    grad = randn(batch, d, g=g, dtype=dtype)
    _, _, ro, rb, rp = cpu_plan
    _, _, dro, drb, drp = ops.plan(dev(gate), n)
    want = ops.combine_backward_weights(grad.double(), [y.double() for y in ys], ro, rb, rp, torch.float64)
    dys = [dev(y) for y in ys]
    got = ops.combine_backward_weights(dev(grad), dys, dro, drb, drp, torch.float64).cpu()
    err = (got - want).abs()
    bound = _dot_bound(grad, ys, cpu_plan, dtype)
    assert (err <= bound).all(), (err - bound).max()
    assert (got[gate == 0] == 0).all()
    again = ops.combine_backward_weights(dev(grad), dys, dro, drb, drp, torch.float64).cpu()
    assert torch.equal(got, again)


# ---------------------------------------------------------------------------------------------
# drop_path_scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trailing", [(), (1,), (3,), (8,), (3, 5), (4, 16), (1000,), (0,)])
def test_drop_path_scale_matches_cpu(dtype, trailing):
    g = gen(31)
    batch = 33
    y = randn(batch, *trailing, g=g, dtype=dtype)
    base = randn(batch, *trailing, g=g, dtype=dtype)
    scale = (torch.rand(batch, generator=g) < 0.7).float() / 0.7
    for b in [base, None]:
        for s in [scale, scale.double(), scale.to(dtype)]:
            want = ops.drop_path_scale(b, y, s)
            assert_close(ops.drop_path_scale(dev(b), dev(y), dev(s)), want, CLOSE[dtype])
            if y.numel():
                got = ops.drop_path_scale(None if b is None else unaligned(dev(b)), unaligned(dev(y)), dev(s))
                assert_close(got, want, CLOSE[dtype])


def test_drop_path_scale_layouts_and_empty():
    g = gen(32)
    y = randn(6, 4, 3, 5, g=g).to(memory_format=torch.channels_last)
    base = randn(6, 4, 3, 5, g=g)  # brought to y's layout
    scale = torch.tensor([0.0, 2.0, 2.0, 0.0, 2.0, 2.0])
    got = ops.drop_path_scale(dev(base), dev(y), dev(scale))
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert_close(got, ops.drop_path_scale(base, y, scale), CLOSE[torch.float32])
    for shape in [(0, 4), (3, 0)]:
        y = torch.randn(*shape)
        s = torch.ones(shape[0])
        assert_close(ops.drop_path_scale(None, dev(y), dev(s)), ops.drop_path_scale(None, y, s), dict(atol=0, rtol=0))


# ---------------------------------------------------------------------------------------------
# autograd through the Python layer, CPU against the device


def _route(x, gate, n, base, weights, device):
    plan = mb.make_plan(gate.to(device), n)
    packed = mb.gather(x, plan)
    ys = [y * (i + 1) + 0.5 for i, y in enumerate(mb.split_packed(packed, plan))]
    return mb.combine(ys, plan, weights=weights, base=base)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,n", [("ids", 3), ("bool", 4), ("float", 5), ("float", 100)])
def test_route_gradients_match_cpu(dtype, kind, n):
    g = gen(41 + n)
    batch = 29
    gate = random_gate(kind, batch, n, g)
    x = randn(batch, 3, 8, g=g, dtype=dtype)
    base = randn(batch, 3, 8, g=g, dtype=dtype)
    weights = gate.to(dtype) if kind == "float" else None
    grad = randn(batch, 3, 8, g=g, dtype=dtype)
    results = []
    for device in ["cpu", DEVICE]:
        leaves = [t.to(device).requires_grad_() for t in (x, base)]
        w = None if weights is None else weights.to(device).requires_grad_()
        out = _route(leaves[0], gate, n, leaves[1], w, device)
        out.backward(grad.to(device))
        results.append([out.detach().cpu(), *(t.grad.cpu() for t in leaves), None if w is None else w.grad.cpu()])
    for name, want, got in zip(["out", "x", "base", "weights"], *results):
        if want is not None:
            torch.testing.assert_close(got, want, **(DOT[dtype] if name == "weights" else CLOSE[dtype]), msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_drop_path_gradients_match_cpu(dtype):
    g = gen(42)
    y = randn(12, 7, g=g, dtype=dtype)
    base = randn(12, 7, g=g, dtype=dtype)
    scale = (torch.rand(12, generator=g) < 0.5).float() * 2
    grad = randn(12, 7, g=g, dtype=dtype)
    results = []
    for device in ["cpu", DEVICE]:
        yy, bb = y.to(device).requires_grad_(), base.to(device).requires_grad_()
        out = mb.drop_path_scale(yy, scale.to(device), base=bb)
        out.backward(grad.to(device))
        results.append([out.detach().cpu(), yy.grad.cpu(), bb.grad.cpu()])
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, **CLOSE[dtype])


# ---------------------------------------------------------------------------------------------
# determinism, streams, no synchronization


def test_bitwise_deterministic():
    g = gen(51)
    batch, n, d = 300, 100, 96
    gate = random_gate("float", batch, n, g)
    plan = ops.plan(dev(gate), n)
    _, rows, ro, rb, rp = plan
    counts = plan[0].diff().tolist()
    x = dev(randn(batch, d, g=g))
    ys = [dev(randn(c, d, g=g)) for c in counts]
    w = dev(gate)
    grad = dev(randn(batch, d, g=g))
    long_grad = dev(randn(4, 2 ** 17, g=g))
    long_gate = torch.tensor([[1.0, 0.5], [0.0, 1.0], [1.0, 1.0], [0.25, 0.0]])
    lplan = ops.plan(dev(long_gate), 2)
    lcounts = lplan[0].diff().tolist()
    long_ys = [dev(randn(c, 2 ** 17, g=g)) for c in lcounts]

    def run():
        packed = ops.gather(x, rows, ro, rp)
        return [
            ops.plan(dev(gate), n),
            packed,
            ops.gather_backward(packed, ro, rp),
            ops.combine(x, ys, w, rows, ro, rb, rp),
            ops.combine_backward_ys(grad, w, rows, counts),
            ops.combine_backward_weights(grad, ys, ro, rb, rp, torch.float32),
            ops.combine_backward_weights(long_grad, long_ys, lplan[2], lplan[3], lplan[4], torch.float32),
        ]

    first, second = run(), run()
    for a, b in zip(first, second):
        for s, t in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
            assert torch.equal(s, t)


@cuda_only
def test_side_stream():
    g = gen(52)
    gate = random_gate("bool", 64, 4, g)
    x = randn(64, 40, g=g)
    (_, rows, ro, rb, rp) = ops.plan(gate, 4)
    want = ops.gather(x, rows, ro, rp)
    dx = dev(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dplan = ops.plan(dev(gate), 4)
        got = ops.gather(dx, dplan[1], dplan[2], dplan[4])
        back = ops.gather_backward(got, dplan[2], dplan[4])
    stream.synchronize()
    assert torch.equal(got.cpu(), want)
    torch.testing.assert_close(back.cpu(), ops.gather_backward(want, ro, rp))


@cuda_only
@pytest.mark.parametrize("n", [3, 100])
def test_no_synchronization_outside_plan(n):
    g = gen(53)
    batch, d = 64, 24
    gate = random_gate("float", batch, n, g)
    plan = mb.make_plan(dev(gate), n)  # the device plan reads back once, before the checks
    host_plan = mb.make_plan(gate, n, device=DEVICE)  # host plan shipped without a sync
    x = dev(randn(batch, d, g=g)).requires_grad_()
    base = dev(randn(batch, d, g=g)).requires_grad_()
    weights = dev(gate).requires_grad_()
    grad = dev(randn(batch, d, g=g))
    scale = dev((torch.rand(batch, generator=g) < 0.5).float() * 2)
    params = [torch.nn.Parameter(dev(torch.randn(3, 3))) for _ in range(3)]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for p in (plan, host_plan):
            parts = mb.gather_split(x, p)
            sum(part.sum() for part in parts).backward(retain_graph=False)
            packed = mb.gather(x, p)
            ys = [y * 2 for y in mb.split_packed(packed, p)]
            out = mb.combine(ys, p, weights=weights, base=base)
            out = mb.drop_path_scale(out, scale, base=base)
            out = mb.anchor(out, params, materialize=True)
            out = mb.anchor(out, params, materialize=False)
            out.backward(grad)
            ops.combine_backward_ys(grad, weights.detach(), p.rows, p.counts)
            ops.combine_backward_weights(grad, [y.detach() for y in ys], p.row_offsets, p.row_branch, p.row_pos,
                                         torch.float32)
            ops.gather_backward(packed.detach(), p.row_offsets, p.row_pos)
            ops.drop_path_scale(None, grad, scale)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert x.grad is not None and weights.grad is not None
    assert all(p.grad is not None for p in params)


# ---------------------------------------------------------------------------------------------
# opcheck with device inputs


@pytest.mark.parametrize("kind", ["ids", "bool", "float"])
@pytest.mark.parametrize("n", [3, 70])
def test_opcheck_routing_ops(kind, n):
    g = gen(61)
    batch = 12
    gate = random_gate(kind, batch, n, g)
    x = dev(randn(batch, 4, 3, g=g)).requires_grad_()
    base = dev(randn(batch, 4, 3, g=g)).requires_grad_()
    torch.library.opcheck(ops.plan, (dev(gate), n), test_utils=("test_schema", "test_faketensor"))
    offsets, rows, row_offsets, row_branch, row_pos = ops.plan(dev(gate), n)
    counts = offsets.diff().tolist()
    torch.library.opcheck(ops.gather, (x, rows, row_offsets, row_pos))
    packed = ops.gather(x, rows, row_offsets, row_pos).detach()
    torch.library.opcheck(ops.gather_backward, (packed, row_offsets, row_pos))
    ys = [y.clone().requires_grad_() for y in packed.split(counts)]
    weights = dev(gate).requires_grad_() if kind == "float" else None
    torch.library.opcheck(ops.combine, (base, ys, weights, rows, row_offsets, row_branch, row_pos))
    torch.library.opcheck(ops.combine, (None, ys, None, rows, row_offsets, row_branch, row_pos))
    grad = dev(randn(batch, 4, 3, g=g))
    torch.library.opcheck(ops.combine_backward_ys, (grad, None if weights is None else weights.detach(), rows, counts))
    torch.library.opcheck(ops.combine_backward_weights,
                          (grad, [y.detach() for y in ys], row_offsets, row_branch, row_pos, torch.float32))


def test_opcheck_drop_path_scale_anchor_and_channels_last():
    g = gen(62)
    y = dev(randn(6, 5, g=g)).requires_grad_()
    base = dev(randn(6, 5, g=g)).requires_grad_()
    scale = dev(torch.tensor([0.0, 1.5, 1.5, 0.0, 1.5, 1.5]))
    torch.library.opcheck(ops.drop_path_scale, (base, y, scale))
    torch.library.opcheck(ops.drop_path_scale, (None, y, scale))
    p = torch.nn.Parameter(dev(torch.randn(3)))
    torch.library.opcheck(ops.anchor, (y, [p], False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(ops.zeros_like_all, ([p.detach(), y.detach()],))
    x = dev(randn(6, 4, 3, 2, g=g)).to(memory_format=torch.channels_last).requires_grad_()
    offsets, rows, row_offsets, row_branch, row_pos = ops.plan(dev(torch.tensor([0, 1, 1, -1, 0, 1])), 2)
    torch.library.opcheck(ops.gather, (x, rows, row_offsets, row_pos))
    torch.library.opcheck(ops.gather_split, (x, rows, row_offsets, row_branch, row_pos, offsets.diff().tolist()),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_split_matches_cpu(dtype):
    g = gen(63)
    batch, n = 29, 4
    gate = random_gate("bool", batch, n, g)
    x = randn(batch, 3, 5, g=g, dtype=dtype).requires_grad_()
    xd = dev(x.detach()).requires_grad_()
    parts = mb.gather_split(x, mb.make_plan(gate, n))
    dparts = mb.gather_split(xd, mb.make_plan(gate, n, device=xd.device))
    grads = [randn(*p.shape, g=g, dtype=dtype) for p in parts]
    for p, q in zip(parts, dparts):
        assert_close(q, p, dict(atol=0, rtol=0))  # a copy: bit-exact
    torch.autograd.backward(parts[1:], grads[1:])  # branch 0's gradient undefined: zeros
    torch.autograd.backward(dparts[1:], [dev(t) for t in grads[1:]])
    assert_close(xd.grad, x.grad, CLOSE[dtype])


# ---------------------------------------------------------------------------------------------
# bad arguments detectable on the host raise like the CPU kernels


def test_bad_arguments_raise_like_cpu():
    gate = torch.tensor([0, 1, 1])
    cpu_plan = ops.plan(gate, 2)
    _, rows, ro, rb, rp = cpu_plan
    d = [dev(t) for t in cpu_plan]
    x = torch.randn(3, 4)
    ys = list(ops.gather(x, rows, ro, rp).split([1, 2]))
    calls = [
        lambda t, P: ops.gather(t(torch.randn(4, 4)), P[1], P[2], P[4]),
        lambda t, P: ops.gather(t(torch.ones(3, 4, dtype=torch.long)), P[1], P[2], P[4]),
        lambda t, P: ops.gather(t(x), P[1][:2], P[2], P[4]),
        lambda t, P: ops.gather(t(x), P[1].int(), P[2], P[4]),
        lambda t, P: ops.combine(None, [t(ys[0]), t(ys[1].double())], None, P[1], P[2], P[3], P[4]),
        lambda t, P: ops.combine(None, [t(ys[0]), t(torch.randn(2, 5))], None, P[1], P[2], P[3], P[4]),
        lambda t, P: ops.combine(None, [t(ys[0]), t(torch.randn(3, 4))], None, P[1], P[2], P[3], P[4]),
        lambda t, P: ops.combine(t(torch.randn(3, 4).double()), [t(y) for y in ys], None, P[1], P[2], P[3], P[4]),
        lambda t, P: ops.combine(None, [t(y) for y in ys], t(torch.ones(3, 3)), P[1], P[2], P[3], P[4]),
        lambda t, P: ops.combine(None, [t(y) for y in ys], t(torch.ones(3, 2, dtype=torch.long)), P[1], P[2], P[3], P[4]),
        lambda t, P: ops.combine(None, [], None, P[1], P[2], P[3], P[4]),
        lambda t, P: ops.combine_backward_ys(t(x), None, P[1], [1, 1]),
        lambda t, P: ops.combine_backward_ys(t(x), t(torch.ones(3, 3)), P[1], [1, 2]),
        lambda t, P: ops.combine_backward_weights(t(x), [t(ys[0])], P[2], P[3], P[4], torch.float32),
        lambda t, P: ops.gather_backward(t(torch.randn(2, 4)), P[2], P[4]),
        lambda t, P: ops.drop_path_scale(None, t(x), t(torch.ones(4))),
        lambda t, P: ops.drop_path_scale(t(torch.randn(2, 4)), t(x), t(torch.ones(3))),
        lambda t, P: ops.drop_path_scale(None, t(x), t(torch.ones(3, dtype=torch.long))),
    ]
    for k, call in enumerate(calls):
        want = _error(lambda: call(lambda t: t, cpu_plan))
        assert want is not None, k
        got = _error(lambda: call(dev, d))
        assert got == want, k
    if ON_CUDA:  # mixed devices name the argument
        got = _error(lambda: ops.gather(dev(x), rows, d[2], d[4]))
        assert got[0] is ValueError and "rows: expected a tensor on cuda" in got[1]


# ---------------------------------------------------------------------------------------------
# int64 indexing: more than 2^31 elements


@cuda_only
@pytest.mark.parametrize("d", [2 ** 31 // 3 + 5, (2 ** 31 // 24 + 1) * 8])  # scalar and vector paths
def test_large_rows_int64_indexing(d):
    # 3 rows hold more than 2^31 elements
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2 ** 30:
        pytest.skip("needs about 24 GiB of free device memory")
    x = torch.randn(3, d, dtype=torch.float16, device=DEVICE)
    plan = mb.make_plan(torch.tensor([2, 0, 1], device=DEVICE), 3)
    packed = mb.gather(x, plan)
    assert torch.equal(packed, x.index_select(0, plan.rows))
    back = ops.gather_backward(packed, plan.row_offsets, plan.row_pos)
    assert torch.equal(back, x)
    del back
    scale = torch.tensor([2.0, 0.0, 0.5], device=DEVICE)
    out = mb.drop_path_scale(x, scale)
    for b in range(3):
        assert torch.equal(out[b], (x[b].float() * scale[b]).half())
