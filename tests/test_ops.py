"""Every op against the pure-PyTorch reference: outputs, gradients, opcheck, edge cases and bad
inputs. Runs on the CPU; tests/test_cuda_ops.py repeats the kernels on a GPU."""
import pytest
import torch

import maskedbranch as mb
from maskedbranch import reference as ref

ops = torch.ops.maskedbranch
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Fused kernels accumulate in float32 and round once; the reference rounds at each step.
TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def random_gate(kind, batch, n, gen, dtype=torch.float32):
    if kind == "ids":
        return torch.randint(-1, n, (batch,), generator=gen)
    if kind == "bool":
        return torch.rand(batch, n, generator=gen) < 0.5
    g = torch.rand(batch, n, generator=gen)
    return torch.where(g < 0.4, torch.zeros_like(g), g).to(dtype)


def run_route(x, gate, n, base=None, weights=None, fn=lambda i, y: y * (i + 1)):
    """gather -> per-branch function -> combine, through the public wrappers."""
    plan = mb.make_plan(gate, n)
    ys = [fn(i, y) for i, y in enumerate(mb.split_packed(mb.gather(x, plan), plan))]
    return mb.combine(ys, plan, weights=weights, base=base)


def run_reference(x, gate, n, base=None, weights=None, fn=lambda i, y: y * (i + 1)):
    offsets, rows, *_ = ref.plan(gate, n)
    packed = ref.gather(x, rows)
    ys = [fn(i, y) for i, y in enumerate(packed.split(offsets.diff().tolist()))]
    return ref.combine(base, ys, weights, rows, x.shape[0])


# ---------------------------------------------------------------------------------------------
# plan


@pytest.mark.parametrize("kind", ["ids", "bool", "float"])
@pytest.mark.parametrize("batch,n", [(0, 3), (1, 1), (9, 1), (33, 4), (50, 16)])
def test_plan_matches_reference(kind, batch, n):
    gate = random_gate(kind, batch, n, torch.Generator().manual_seed(batch * 31 + n))
    got = ops.plan(gate, n)
    want = ref.plan(gate, n)
    for g, w, name in zip(got, want, ["offsets", "rows", "row_offsets", "row_branch", "row_pos"]):
        assert torch.equal(g, w), name
    assert got[0].device.type == "cpu"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_plan_accepts_integer_ids(dtype):
    ids = torch.tensor([2, 0, 1, 0], dtype=dtype)
    plan = mb.make_plan(ids, 3)
    assert plan.counts == [2, 1, 1]
    assert plan.rows.tolist() == [1, 3, 2, 0]


def test_plan_is_stable_and_consistent():
    gate = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]], dtype=torch.bool)
    plan = mb.make_plan(gate, 3)
    assert plan.counts == [2, 2, 2]
    assert plan.rows.tolist() == [0, 2, 2, 3, 0, 2]
    assert plan.row_offsets.tolist() == [0, 2, 2, 5, 6]
    assert plan.row_branch.tolist() == [0, 2, 0, 1, 2, 1]
    assert plan.row_pos.tolist() == [0, 4, 1, 2, 5, 3]


# ---------------------------------------------------------------------------------------------
# gather / combine / drop_path_scale against the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["ids", "bool", "float"])
def test_route_matches_reference(dtype, kind):
    gen = torch.Generator().manual_seed(3)
    n, batch = 4, 37
    x = torch.randn(batch, 5, 3, generator=gen).to(dtype)
    base = torch.randn(batch, 5, 3, generator=gen).to(dtype)
    gate = random_gate(kind, batch, n, gen)
    weights = gate if kind == "float" else None
    inputs = [t.clone().requires_grad_() for t in (x, base)] + ([gate.clone().requires_grad_()] if weights is not None else [])
    # The reference runs in the same dtype, so both see the same rounding inside the branches;
    # what differs is the fused kernels' float32 accumulation (one rounding per output).
    ref_inputs = [t.clone().requires_grad_() for t in inputs]

    def route(fn_inputs, runner, d):
        xx, bb, *ww = fn_inputs
        return runner(xx, gate, n, base=bb, weights=ww[0] if ww else None, fn=lambda i, y: torch.tanh(y) * (i + 1))

    out = route(inputs, run_route, dtype)
    want = route(ref_inputs, run_reference, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, want, **TOL[dtype])
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    got_grads = torch.autograd.grad(out, inputs, grad)
    # The reference differentiates zero gate entries too; the op gives zero there by design.
    want_grads = list(torch.autograd.grad(want, ref_inputs, grad))
    if weights is not None:
        want_grads[2] = want_grads[2] * (gate != 0)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == dtype or g.dtype == gate.dtype
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("kind", ["ids", "bool", "float"])
def test_gradcheck_float64(kind):
    gen = torch.Generator().manual_seed(5)
    n, batch = 3, 11
    gate = random_gate(kind, batch, n, gen, dtype=torch.float64)
    x = torch.randn(batch, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    base = torch.randn(batch, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    args = [x, base]
    if kind == "float":
        args.append(gate.clone().requires_grad_())

    def fn(x, base, *w):
        return run_route(x, gate, n, base=base, weights=w[0] if w else None, fn=lambda i, y: torch.sin(y) * (i + 2))

    # Perturbing a zero weight would change the plan: check the live entries only.
    assert torch.autograd.gradcheck(fn, args, nondet_tol=0.0)


def test_gradcheck_drop_path_scale():
    gen = torch.Generator().manual_seed(6)
    y = torch.randn(6, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    base = torch.randn(6, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    scale = torch.tensor([0.0, 2.0, 2.0, 0.0, 2.0, 2.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, b, s: mb.drop_path_scale(y, s, base=b), (y, base, scale))
    assert torch.autograd.gradcheck(lambda y: mb.drop_path_scale(y, scale.detach()), (y,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_drop_path_scale_matches_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    y = torch.randn(9, 4, 5, generator=gen).to(dtype)
    base = torch.randn(9, 4, 5, generator=gen).to(dtype)
    scale = (torch.rand(9, generator=gen) < 0.5).float() * 2.0
    want = ref.drop_path_scale(base.double(), y.double(), scale.double())
    torch.testing.assert_close(mb.drop_path_scale(y, scale, base=base).double(), want, **TOL[dtype])
    torch.testing.assert_close(
        mb.drop_path_scale(y, scale).double(), ref.drop_path_scale(None, y.double(), scale.double()), **TOL[dtype]
    )


# ---------------------------------------------------------------------------------------------
# edge cases


def test_empty_batch():
    n = 3
    x = torch.randn(0, 4, requires_grad=True)
    for gate in (torch.zeros(0, dtype=torch.long), torch.zeros(0, n), torch.zeros(0, n, dtype=torch.bool)):
        plan = mb.make_plan(gate, n)
        assert plan.counts == [0, 0, 0]
        packed = mb.gather(x, plan)
        assert packed.shape == (0, 4)
        out = mb.combine(mb.split_packed(packed, plan), plan, base=x)
        assert out.shape == (0, 4)
        out.sum().backward()
        assert x.grad.shape == (0, 4)


def test_all_rows_on_one_branch_and_empty_branches():
    x = torch.randn(8, 6, dtype=torch.float64)
    gate = torch.full((8,), 2)
    out = run_route(x, gate, 4)
    torch.testing.assert_close(out, x * 3)
    assert mb.make_plan(gate, 4).counts == [0, 0, 8, 0]


def test_every_gate_zero_gives_base_or_zeros():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    base = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    gate = torch.zeros(5, 2, dtype=torch.float64, requires_grad=True)
    out = run_route(x, gate.detach(), 2, base=base, weights=gate)
    torch.testing.assert_close(out, base)
    out.sum().backward()
    assert torch.equal(gate.grad, torch.zeros_like(gate))
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert torch.equal(base.grad, torch.ones_like(base))
    assert torch.equal(run_route(x.detach(), torch.full((5,), -1), 2), torch.zeros(5, 3, dtype=torch.float64))


@pytest.mark.parametrize("n", [1, 16])
def test_branch_counts(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(40, 7, dtype=torch.float64, generator=gen)
    for kind in ("ids", "bool", "float"):
        gate = random_gate(kind, 40, n, gen, torch.float64)
        w = gate if kind == "float" else None
        torch.testing.assert_close(run_route(x, gate, n, weights=w), run_reference(x, gate, n, weights=w))


@pytest.mark.parametrize("shape", [(13,), (13, 1), (13, 3), (13, 5, 7), (13, 3, 5, 7)])
def test_trailing_shapes_not_multiple_of_vector_width(shape):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, dtype=torch.float32, generator=gen)
    gate = random_gate("float", 13, 3, gen)
    torch.testing.assert_close(run_route(x, gate, 3, weights=gate, base=x), run_reference(x, gate, 3, weights=gate, base=x))


def test_channels_last_is_preserved_and_correct():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(10, 6, 5, 4, generator=gen).to(memory_format=torch.channels_last)
    gate = random_gate("bool", 10, 3, gen)
    plan = mb.make_plan(gate, 3)
    packed = mb.gather(x, plan)
    assert packed.is_contiguous(memory_format=torch.channels_last)
    out = mb.combine(mb.split_packed(packed, plan), plan, base=x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, run_reference(x, gate, 3, base=x, fn=lambda i, y: y))
    scaled = mb.drop_path_scale(x, torch.ones(10), base=x)
    assert scaled.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(scaled, 2 * x)


def test_mixed_layouts_and_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(12, 8, 6, generator=gen)[:, ::2, 1:]  # non-contiguous view
    base = torch.randn(12, 5, 4, generator=gen).transpose(1, 2)  # non-contiguous, other layout
    gate = random_gate("float", 12, 2, gen)
    out = run_route(x, gate, 2, base=base, weights=gate)
    torch.testing.assert_close(out, run_reference(x, gate, 2, base=base, weights=gate))


def test_weights_in_another_dtype():
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(9, 4, generator=gen).to(torch.bfloat16)
    gate = random_gate("float", 9, 3, gen, dtype=torch.float32).requires_grad_()
    out = run_route(x, gate.detach(), 3, weights=gate)
    out.float().sum().backward()
    assert gate.grad.dtype == torch.float32
    torch.testing.assert_close(out.double(), run_reference(x.double(), gate.detach(), 3, weights=gate.detach().double()), **TOL[torch.bfloat16])


def test_deterministic_bitwise():
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(300, 64, generator=gen)
    gate = random_gate("float", 300, 5, gen)

    def once():
        xx = x.clone().requires_grad_()
        w = gate.clone().requires_grad_()
        out = run_route(xx, gate, 5, base=xx, weights=w, fn=lambda i, y: y * y)
        out.backward(torch.ones_like(out))
        return out, xx.grad, w.grad

    for a, b in zip(once(), once()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# gather_split: gather, then each branch's slice as a tensor of its own


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["ids", "bool", "float"])
def test_gather_split_matches_reference(dtype, kind):
    gen = torch.Generator().manual_seed(41)
    n, batch = 4, 21
    gate = random_gate(kind, batch, n, gen)
    if gate.dim() == 2:
        gate[:, 2] = 0  # an empty branch
    else:
        gate[gate == 2] = -1
    x = torch.randn(batch, 3, 5, generator=gen).to(dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    plan = mb.make_plan(gate, n)
    parts = mb.gather_split(x, plan)
    want = ref.gather_split(x_ref, ref.plan(gate, n)[1], plan.counts)
    assert [p.shape[0] for p in parts] == plan.counts
    for p, w in zip(parts, want):
        assert p.dtype == dtype and torch.equal(p, w)
    # Gradients of some parts only (the others' are undefined: zeros); several rows per entry.
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in parts]
    used = [i for i in range(n) if i != 1]
    torch.autograd.backward([parts[i] for i in used], [grads[i] for i in used])
    torch.autograd.backward([want[i] for i in used], [grads[i] for i in used])
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[dtype])


def test_gather_split_parts_are_separate_tensors():
    x = torch.randn(6, 4, requires_grad=True)
    plan = mb.make_plan(torch.tensor([0, 1, 0, 1, 1, 0]), 2)
    a, b = mb.gather_split(x, plan)
    assert a._base is None and b._base is None  # not views
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one packed buffer
    version = b._version
    a.relu()  # out of place: fine either way
    c = a.clone()
    c.mul_(2)
    assert b._version == version
    (a.sum() + 2 * b.sum()).backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2, 1, 2, 2, 1])[:, None].expand(6, 4))


def test_gradcheck_gather_split():
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(9, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    plan = mb.make_plan(torch.rand(9, 3, generator=gen) < 0.5, 3)

    def fn(x):
        return tuple(p * (i + 1) for i, p in enumerate(mb.gather_split(x, plan)))

    assert torch.autograd.gradcheck(fn, (x,))


def test_opcheck_gather_split():
    gen = torch.Generator().manual_seed(43)
    x = torch.randn(10, 4, generator=gen, requires_grad=True)
    gate = random_gate("bool", 10, 3, gen)
    plan = mb.make_plan(gate, 3)
    torch.library.opcheck(
        ops.gather_split, (x, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos, plan.counts),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_gather_split_bad_counts():
    x = torch.randn(4, 2)
    plan = mb.make_plan(torch.tensor([0, 1, 0, -1]), 2)
    args = (x, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos)
    with pytest.raises(ValueError, match="counts: they add up to 4 rows but rows holds 3"):
        ops.gather_split(*args, [2, 2])
    with pytest.raises(ValueError, match=r"counts: expected non-negative row counts, got \[-1, 4\]"):
        ops.gather_split(*args, [-1, 4])
    assert [p.shape[0] for p in ops.gather_split(*args, plan.counts)] == [2, 1]


def test_anchor_gives_undefined_or_zero_grads():
    x = torch.randn(3, 2, requires_grad=True)
    p = torch.nn.Parameter(torch.randn(4))
    q = torch.nn.Parameter(torch.randn(2, 2))
    out = mb.anchor(x * 2, [p, q])
    out.sum().backward()
    assert p.grad is None and q.grad is None
    assert torch.equal(x.grad, torch.full((3, 2), 2.0))
    hooks = []
    for t in (p, q):
        t.register_post_accumulate_grad_hook(lambda t: hooks.append(t))
    mb.anchor(x * 2, [p, q]).sum().backward()
    assert len(hooks) == 2  # the accumulators run even for undefined gradients
    mb.anchor(x * 2, [p, q], materialize=True).sum().backward()
    assert torch.equal(p.grad, torch.zeros(4)) and torch.equal(q.grad, torch.zeros(2, 2))
    with torch.no_grad():
        assert mb.anchor(x, [p]) is x


# ---------------------------------------------------------------------------------------------
# opcheck: schema, fake kernels, autograd registration, dynamic shapes


def _opcheck(op, args, **kw):
    torch.library.opcheck(op, args, **kw)


@pytest.mark.parametrize("kind", ["ids", "bool", "float"])
def test_opcheck_routing_ops(kind):
    gen = torch.Generator().manual_seed(21)
    n, batch = 3, 10
    gate = random_gate(kind, batch, n, gen)
    x = torch.randn(batch, 4, 3, generator=gen, requires_grad=True)
    base = torch.randn(batch, 4, 3, generator=gen, requires_grad=True)
    _opcheck(ops.plan, (gate, n), test_utils=("test_schema", "test_faketensor"))
    _, rows, row_offsets, row_branch, row_pos = ops.plan(gate, n)
    counts = mb.make_plan(gate, n).counts
    _opcheck(ops.gather, (x, rows, row_offsets, row_pos))
    packed = ops.gather(x, rows, row_offsets, row_pos).detach()
    _opcheck(ops.gather_backward, (packed, row_offsets, row_pos))
    ys = [y.clone().requires_grad_() for y in packed.split(counts)]
    weights = gate.clone().requires_grad_() if kind == "float" else None
    _opcheck(ops.combine, (base, ys, weights, rows, row_offsets, row_branch, row_pos))
    _opcheck(ops.combine, (None, ys, None, rows, row_offsets, row_branch, row_pos))
    grad = torch.randn(batch, 4, 3, generator=gen)
    _opcheck(ops.combine_backward_ys, (grad, None if weights is None else weights.detach(), rows, counts))
    _opcheck(ops.combine_backward_weights, (grad, [y.detach() for y in ys], row_offsets, row_branch, row_pos, torch.float32))


def test_opcheck_drop_path_scale_and_anchor():
    gen = torch.Generator().manual_seed(22)
    y = torch.randn(6, 5, generator=gen, requires_grad=True)
    base = torch.randn(6, 5, generator=gen, requires_grad=True)
    scale = torch.tensor([0.0, 1.5, 1.5, 0.0, 1.5, 1.5])
    _opcheck(ops.drop_path_scale, (base, y, scale))
    _opcheck(ops.drop_path_scale, (None, y, scale))
    p = torch.nn.Parameter(torch.randn(3))
    _opcheck(ops.anchor, (y, [p], False), test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    _opcheck(ops.zeros_like_all, ([p.detach(), y.detach()],))


def test_channels_last_opcheck():
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(6, 4, 3, 2, generator=gen).to(memory_format=torch.channels_last).requires_grad_()
    gate = random_gate("ids", 6, 2, gen)
    _, rows, row_offsets, row_branch, row_pos = ops.plan(gate, 2)
    _opcheck(ops.gather, (x, rows, row_offsets, row_pos))


# ---------------------------------------------------------------------------------------------
# bad inputs: a Python exception that names the argument, and the next good call works


def _good_call():
    gate = torch.tensor([0, 1, -1])
    return run_route(torch.ones(3, 2), gate, 2)


BAD_GATES = [
    (torch.zeros(3, 2, 2), 2, ValueError, "gate: expected branch ids"),  # wrong rank
    (torch.zeros(3, 3), 2, ValueError, r"gate: expected shape \[B, 2\]"),  # wrong N
    (torch.tensor([0.0, 1.0]), 2, TypeError, "gate: a 1-D gate holds one integer"),  # float ids
    (torch.tensor([True, False]), 2, TypeError, "gate: a 1-D gate holds one integer"),
    (torch.tensor([0, 2]), 2, IndexError, "gate: branch id 2 at row 1 is out of range"),
    (torch.tensor([0, -2]), 2, IndexError, "gate: branch id -2 at row 1 is out of range"),
    (torch.tensor([[0.5, float("nan")]]), 2, ValueError, "gate: weight nan at row 0, branch 1 is not finite"),
    (torch.tensor([[float("inf"), 1.0]]), 2, ValueError, "gate: weight inf at row 0, branch 0 is not finite"),
    (torch.zeros(2, 2, dtype=torch.int32), 2, TypeError, "gate: a 2-D gate must be bool or floating"),
    (torch.zeros(2, dtype=torch.long), 0, ValueError, "num_branches: expected at least 1"),
]


@pytest.mark.parametrize("gate,n,exc,msg", BAD_GATES)
def test_bad_gates(gate, n, exc, msg):
    with pytest.raises(exc, match=msg):
        mb.make_plan(gate, n)
    torch.testing.assert_close(_good_call(), torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]))


def test_bad_op_arguments():
    gate = torch.tensor([0, 1, 1])
    plan = mb.make_plan(gate, 2)
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="row_offsets: the plan is for 3 rows but x has 4"):
        mb.gather(torch.randn(4, 4), plan)
    with pytest.raises(TypeError, match="x: expected float64, float32"):
        mb.gather(torch.ones(3, 4, dtype=torch.long), plan)
    ys = mb.split_packed(mb.gather(x, plan), plan)
    with pytest.raises(ValueError, match="ys\\[1\\]: branch 1 was given 2 rows but returned 3"):
        mb.combine([ys[0], torch.randn(3, 4)], plan)
    with pytest.raises(TypeError, match="ys\\[1\\]: expected dtype Float like ys\\[0\\], got Double"):
        mb.combine([ys[0], ys[1].double()], plan)
    with pytest.raises(ValueError, match="ys\\[1\\]: expected trailing shape \\[4\\]"):
        mb.combine([ys[0], torch.randn(2, 5)], plan)
    with pytest.raises(TypeError, match="ys\\[0\\]: expected dtype Double like base"):
        mb.combine(ys, plan, base=torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weights: expected shape \[3, 2\]"):
        mb.combine(ys, plan, weights=torch.ones(3, 3))
    with pytest.raises(TypeError, match="weights: expected float64"):
        mb.combine(ys, plan, weights=torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="ys: expected one output per branch"):
        ops.combine(None, [], None, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos)
    with pytest.raises(ValueError, match=r"scale: expected shape \[3\]"):
        mb.drop_path_scale(x, torch.ones(4))
    with pytest.raises(ValueError, match="base: expected 3 rows, got 2"):
        mb.drop_path_scale(x, torch.ones(3), base=torch.randn(2, 4))
    with pytest.raises(ValueError, match="base: expected a tensor on meta like y"):
        mb.drop_path_scale(x.to("meta"), torch.ones(3, device="meta"), base=x)
    # hand-made plans are checked too
    with pytest.raises(IndexError, match="rows: entry 0 = 7 is out of range"):
        ops.gather(x, torch.tensor([7, 0, 1]), plan.row_offsets, plan.row_pos)
    with pytest.raises(IndexError, match="row_pos: entry 0 = 2 is outside branch 0"):
        ops.combine(None, ys, None, plan.rows, plan.row_offsets, plan.row_branch, torch.tensor([2, 1, 0]))
    torch.testing.assert_close(_good_call(), torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]))


def test_cuda_tensor_in_cpu_only_build_is_a_clear_error():
    if mb.WITH_CUDA:
        pytest.skip("this build has CUDA kernels")
    if not torch.cuda.is_available():
        # No CUDA tensor can be made here; the registered CUDA stub is what answers them.
        from torch._C import _dispatch_has_kernel_for_dispatch_key as has_kernel

        assert has_kernel("maskedbranch::gather", "CUDA")
        return
    with pytest.raises(RuntimeError, match="built without"):
        mb.gather(torch.ones(2, 2, device="cuda"), mb.make_plan(torch.tensor([0, 0]), 1))


# ---------------------------------------------------------------------------------------------
# autocast: combine and drop_path_scale promote to the widest floating dtype


def test_autocast_promotes_mixed_dtypes():
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(6, 4, generator=gen, requires_grad=True)
    lin = torch.nn.Linear(4, 4)
    gate = torch.tensor([0, 1, -1, 0, 1, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = mb.make_plan(gate, 2)
        ys = [lin(y) for y in mb.split_packed(mb.gather(x, plan), plan)]
        assert all(y.dtype == torch.bfloat16 for y in ys)
        out = mb.combine(ys, plan, base=x)
        scaled = mb.drop_path_scale(lin(x), torch.full((6,), 2.0), base=x)
    assert out.dtype == torch.float32 and scaled.dtype == torch.float32
    want = ref.combine(x.detach(), [y.detach().float() for y in ys], None, plan.rows, 6)
    torch.testing.assert_close(out.detach(), want)
    (out.sum() + scaled.sum()).backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    # Outside autocast, mixed dtypes are an error that names the argument.
    with pytest.raises(TypeError, match="ys\\[0\\]: expected dtype Float like base"):
        mb.combine([y.detach() for y in ys], plan, base=x)
