"""Property-based fuzzing (hypothesis) of every op and module against maskedbranch.reference:
outputs and gradients, for B from 0, N from 1 to 16, every floating dtype, every gate kind and
pattern (none live, all live, one branch, random densities, non-contiguous gates), and
contiguous, strided, sliced, transposed and channels_last inputs.

The examples are derandomized (CI runs the same ones every time) and add up to more than 2000
(``test_example_count`` checks it when the whole file runs).

Tolerances. The fused kernels accumulate in float32 (float64 for float64) and round once; the
references round at every step in the tensor's dtype, as tests/test_ops.py compares them. A sum
of K terms rounded at every step is off by at most about K * eps * sum(|term|) (recursive
summation bound, eps = the dtype's machine epsilon), so the ops are checked element by element
against

    |got - want| <= (K + 4) * eps * sum(|term|) + tiny

where sum(|term|) comes from the float64 reference evaluated on absolute values (its outputs,
and its gradients for |grad_out|), K is the number of terms summed (branches per row, or
elements per row for a weight's gradient) and the 4 covers the extra roundings of products and
of casting weights to the activation dtype. For the modules, whose branches are nonlinear,
sum(|term|) comes from float64 "absolute" linearizations of the branches (see AbsMLP): their
vector-Jacobian products are |J|^T v, so they bound how a rounding error anywhere reaches an
output or a gradient; K then also counts the rows a parameter's gradient sums over.
"""
from __future__ import annotations

import collections
import copy
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import maskedbranch as mb  # noqa: E402
from maskedbranch import reference as ref  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ID_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
LAYOUTS = ["contiguous", "strided_rows", "sliced", "transposed", "channels_last"]

EXAMPLES = {
    "plan": 300,
    "route": 550,
    "drop_path_scale": 250,
    "masked_branch": 500,
    "drop_path": 200,
    "residual": 250,
}
# MASKEDBRANCH_FUZZ_SCALE=10 runs ten times as many examples (a longer local or nightly run)
SCALE = float(os.environ.get("MASKEDBRANCH_FUZZ_SCALE", "1"))
RAN: Dict[str, int] = collections.Counter()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency (large on a loaded machine);
    tests/test_determinism.py covers the multi-threaded kernels."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fuzz(name: str):
    return settings(
        max_examples=max(1, int(EXAMPLES[name] * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ----------------------------------------------------------------------------------------------
# Strategies: sizes and patterns come from hypothesis, values from a seeded torch generator.

batches = st.one_of(st.sampled_from([0, 1]), st.integers(0, 40))
branch_counts = st.one_of(st.sampled_from([1, 16]), st.integers(1, 16))
trailing_shapes = st.one_of(
    st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple),
    st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4)),  # [B, C, H, W]
)
seeds = st.integers(0, 2**31 - 1)
gate_patterns = st.sampled_from(["random", "random", "random", "none", "all", "one_branch", "first_row"])
densities = st.sampled_from([0.1, 0.5, 0.9])


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def tiny(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).smallest_normal


def make_x(gen: torch.Generator, batch: int, trailing: Tuple[int, ...], dtype: torch.dtype, layout: str) -> Tensor:
    """Values from gen, in the requested memory layout (falling back to contiguous where the
    layout does not apply to the rank)."""
    shape = (batch, *trailing)

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)

    if layout == "channels_last" and len(shape) == 4:
        return randn(*shape).contiguous(memory_format=torch.channels_last)
    if layout == "transposed" and len(shape) >= 3:
        return randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    if layout == "strided_rows":
        return randn(2 * batch, *trailing)[::2]
    if layout == "sliced" and len(shape) >= 2:
        return randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    return randn(*shape)


def make_gate(gen: torch.Generator, kind: str, pattern: str, density: float, batch: int, n: int, dtype, transposed: bool):
    """An id gate [B] (-1 = no branch) or a bool/floating gate [B, N]."""
    u = torch.rand(batch, n, generator=gen)
    if pattern == "none":
        live = torch.zeros(batch, n, dtype=torch.bool)
    elif pattern == "all":
        live = torch.ones(batch, n, dtype=torch.bool)
    elif pattern == "one_branch":
        live = torch.zeros(batch, n, dtype=torch.bool)
        live[:, int(torch.randint(n, (1,), generator=gen))] = True
    elif pattern == "first_row":
        live = torch.zeros(batch, n, dtype=torch.bool)
        live[:1] = u[:1] < density
    else:
        live = u < density
    if kind == "ids":
        ids = torch.where(live.any(1), (u * live).argmax(1), torch.full((batch,), -1))
        if pattern == "all":
            ids = torch.randint(n, (batch,), generator=gen)
        if dtype == torch.uint8:  # unsigned: no -1
            ids = ids.clamp(min=0)
        return ids.to(dtype)
    if kind == "bool":
        g = live
    else:
        g = torch.where(live, 0.25 + 2 * torch.rand(batch, n, generator=gen, dtype=torch.float64), 0.0).to(dtype)
    if transposed:  # the same values, non-contiguous
        g = g.t().contiguous().t()
    return g


def gate_dtypes(kind: str):
    if kind == "ids":
        return st.sampled_from(ID_DTYPES)
    if kind == "bool":
        return st.just(torch.bool)
    return st.sampled_from(DTYPES)


def assert_within(got: Optional[Tensor], want: Optional[Tensor], absref: Tensor, dtype: torch.dtype, terms: int, what: str):
    """|got - want| <= (terms + 4) * eps * absref + tiny, element by element."""
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    g, w = got.double(), want.double()
    assert torch.isfinite(g).all() == torch.isfinite(w).all(), f"{what}: non-finite values differ"
    bound = (terms + 4) * eps(dtype) * absref.double().abs() + tiny(dtype)
    err = (g - w).abs()
    bad = err > bound
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements outside the bound; at {i}: got "
            f"{g[tuple(i)].item()!r}, want {w[tuple(i)].item()!r}, bound {bound[tuple(i)].item():.3g}"
        )


def row_numel(trailing: Tuple[int, ...]) -> int:
    out = 1
    for s in trailing:
        out *= s
    return out


def flat_ifelse(branches, x, gate, n, trailing):
    """masked_branch_ifelse on [B, D] views (index_add is very slow on small 4-D tensors), with
    each branch still seeing rows of the trailing shape; None when no row reached any branch."""
    batch = x.shape[0]
    wrapped = [lambda t, b=b: b(t.reshape(t.shape[0], *trailing)).reshape(t.shape[0], row_numel(trailing)) for b in branches]
    out = ref.masked_branch_ifelse(wrapped, x.reshape(batch, row_numel(trailing)), gate, n)
    return None if out is None else out.reshape(batch, *trailing)


def _grad(t: Tensor) -> Optional[Tensor]:
    return None if t.grad is None else t.grad


# ----------------------------------------------------------------------------------------------
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
# gather -> per-branch function -> combine, against the reference, with gradients


def _route(x, gate, n, base, weights, gather, split, combine):
    packed = gather(x)
    ys = [y * (i + 1) for i, y in enumerate(split(packed))]
    return combine(ys, base, weights)


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
    seed=seeds,
)
def test_route(batch, n, trailing, dtype, layout, kind, pattern, density, with_base, weights_dtype, weights_grad, seed):
    RAN["route"] += 1
    gen = torch.Generator().manual_seed(seed)
    gdtype = (weights_dtype or dtype) if kind == "float" else (torch.int64 if kind == "ids" else torch.bool)
    gate = make_gate(gen, kind, pattern, density, batch, n, gdtype, transposed=False)
    x = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    base = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True) if with_base else None
    weights = gate.clone().requires_grad_(weights_grad) if kind == "float" else None
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")

    plan = mb.make_plan(gate, n)
    out = _route(x, gate, n, base, weights, lambda t: mb.gather(t, plan), lambda p: mb.split_packed(p, plan),
                 lambda ys, b, w: mb.combine(ys, plan, weights=w, base=b))
    # outputs take the layout of the first input (base, else ys[0]; an empty ys[0] has none)
    first_rows = batch if with_base else plan.counts[0]
    if layout == "channels_last" and x.dim() == 4 and first_rows > 0 and trailing[0] > 1 and trailing[1] * trailing[2] > 1:
        assert out.is_contiguous(memory_format=torch.channels_last)

    offsets, rows, *_ = ref.plan(gate, n)
    counts = offsets.diff().tolist()

    def reference(x, base, weights):
        # on [B, D] views: the same row-wise math, and index_add is very slow on small 4-D tensors
        flat = (batch, row_numel(trailing))
        b2 = None if base is None else base.reshape(flat)
        y = _route(x.reshape(flat), gate, n, b2, weights, lambda t: ref.gather(t, rows), lambda p: p.split(counts),
                   lambda ys, b, w: ref.combine(b, ys, w, rows, batch))
        return y.reshape(batch, *trailing)

    leaves = [x] + ([base] if base is not None else []) + ([weights] if weights is not None and weights_grad else [])
    r_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    a_leaves = [t.detach().double().abs().requires_grad_(True) for t in leaves]  # for the bounds

    def unpack(ls):
        it = iter(ls)
        xx = next(it)
        bb = next(it) if base is not None else None
        ww = next(it) if weights is not None and weights_grad else (weights.detach() if weights is not None else None)
        return xx, bb, ww

    want = reference(*unpack(r_leaves))
    xa, ba, wa = unpack(a_leaves)
    absref = reference(xa, ba, wa.abs().double() if wa is not None and not wa.requires_grad else wa)
    terms = n + 1
    assert_within(out.detach(), want.detach(), absref.detach(), dtype, terms, "out")

    out.backward(grad_out)
    want.backward(grad_out)
    absref.backward(grad_out.double().abs())
    numel_row = row_numel(trailing)
    for i, (g, r, a) in enumerate(zip(leaves, r_leaves, a_leaves)):
        is_weights = weights is not None and weights_grad and i == len(leaves) - 1
        k = numel_row if is_weights else terms
        assert_within(_grad(g), _grad(r), a.grad, dtype, k, f"grad of leaf {i}")
        if is_weights:  # zero entries get a zero gradient (the branch never ran there)
            assert torch.count_nonzero(g.grad[gate == 0]) == 0


# ----------------------------------------------------------------------------------------------
# drop_path_scale


@fuzz("drop_path_scale")
@given(
    batch=batches,
    trailing=trailing_shapes,
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    scale_dtype=st.sampled_from([None, torch.float32, torch.float64]),
    scale_grad=st.booleans(),
    with_base=st.booleans(),
    zeros=st.sampled_from([0.0, 0.5, 1.0]),
    seed=seeds,
)
def test_drop_path_scale(batch, trailing, dtype, layout, scale_dtype, scale_grad, with_base, zeros, seed):
    RAN["drop_path_scale"] += 1
    gen = torch.Generator().manual_seed(seed)
    y = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    base = make_x(gen, batch, trailing, dtype, "contiguous").requires_grad_(True) if with_base else None
    keep = torch.rand(batch, generator=gen) >= zeros
    scale = torch.where(keep, 1 + torch.rand(batch, generator=gen), 0.0).to(scale_dtype or dtype).requires_grad_(scale_grad)
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")

    out = mb.drop_path_scale(y, scale, base=base)
    leaves = [t for t in (y, base, scale) if t is not None and t.requires_grad]
    r = [t.detach().clone().requires_grad_(True) for t in leaves]
    a = [t.detach().double().abs().requires_grad_(True) for t in leaves]

    def pick(ls):
        it = iter(ls)
        yy = next(it)
        bb = next(it) if base is not None else None
        ss = next(it) if scale_grad else None
        return yy, bb, ss

    ry, rb, rs = pick(r)
    ay, ab, as_ = pick(a)
    want = ref.drop_path_scale(rb, ry, rs if rs is not None else scale)
    absref = ref.drop_path_scale(ab, ay, as_ if as_ is not None else scale.double().abs())
    assert_within(out.detach(), want.detach(), absref.detach(), dtype, 1, "out")
    out.backward(grad_out)
    want.backward(grad_out)
    absref.backward(grad_out.double().abs())
    numel_row = row_numel(trailing)
    for i, (g, rr, aa) in enumerate(zip(leaves, r, a)):
        k = numel_row if g is scale else 1
        assert_within(g.grad, rr.grad, aa.grad, dtype, k, f"grad of leaf {i}")


# ----------------------------------------------------------------------------------------------
# MaskedBranch / masked_branch against the if/else and dense references


class Affine(nn.Module):
    """A row-wise branch for any trailing shape and layout: tanh(x * w + b) * c."""

    def __init__(self, trailing: Tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
        super().__init__()
        shape = trailing[-1:] if trailing else ()
        self.w = nn.Parameter((1 + 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype))
        self.b = nn.Parameter((0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype))
        self.c = nn.Parameter(torch.tensor(1.5, dtype=dtype))

    def forward(self, x):
        return torch.tanh(x * self.w + self.b) * self.c


def make_branches(n: int, trailing, dtype, gen, linear: bool) -> List[nn.Module]:
    if linear:  # 2-D x: Linear -> Tanh -> Linear
        d = trailing[0]
        out = []
        for _ in range(n):
            m = nn.Sequential(nn.Linear(d, 5), nn.Tanh(), nn.Linear(5, d)).to(torch.float64)
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
            out.append(m.to(dtype))
        return out
    return [Affine(trailing, dtype, gen) for _ in range(n)]


# Error bounds for the modules. A rounding error e in an intermediate (the gate product, the
# branch output's gradient) reaches a gradient through the branch's Jacobian J as J^T e, so it
# is bounded by |J|^T |e| <= eps * |J|^T |grad|. The "absolute" branches below are float64
# linearizations of the branches whose vector-Jacobian products are exactly |J|^T v (for x and
# for every parameter) and whose value bounds the terms of branch(x) (the sum of the absolute
# values of every product the branch adds up, first layer included). Run through the same if/else reference
# with |gate| and backpropagated with |grad_out|, they give element by element the sum of the
# absolute values of the terms of every output and gradient.


def _with_value(lin: Tensor, value: Tensor) -> Tensor:
    return lin - lin.detach() + value  # the gradients of lin, the value of value


class AbsAffine(nn.Module):
    def __init__(self, src: Affine):
        super().__init__()
        self.w, self.b, self.c = (nn.Parameter(p.detach().double().clone()) for p in (src.w, src.b, src.c))

    def forward(self, t):
        w0, b0, c0, td = self.w.detach(), self.b.detach(), self.c.detach(), t.detach()
        th = torch.tanh(td * w0 + b0)
        a = (c0 * (1 - th * th)).abs()  # |dy/du|
        lin = a * (td.abs() * self.w + self.b) + th.abs() * self.c + a * w0.abs() * t
        return _with_value(lin, th.abs() * c0.abs() + a * (td.abs() * w0.abs() + b0.abs()))


class AbsMLP(nn.Module):
    def __init__(self, src: nn.Sequential):
        super().__init__()
        l1, _, l2 = src
        self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(p.detach().double().clone()) for p in (l1.weight, l1.bias, l2.weight, l2.bias))

    def forward(self, t):
        F = nn.functional
        w1, b1, w2, b2, td = self.w1.detach(), self.b1.detach(), self.w2.detach(), self.b2.detach(), t.detach()
        h = torch.tanh(F.linear(td, w1, b1))
        s = 1 - h * h
        lin = (
            F.linear(h.abs(), self.w2, self.b2)
            + F.linear(s * F.linear(td.abs(), self.w1, self.b1), w2.abs())
            + F.linear(s * F.linear(t, w1.abs()), w2.abs())
        )
        value = F.linear(h.abs(), w2.abs(), b2.abs()) + F.linear(s * F.linear(td.abs(), w1.abs(), b1.abs()), w2.abs())
        return _with_value(lin, value)


def abs_branch(b: nn.Module) -> nn.Module:
    return AbsAffine(b) if isinstance(b, Affine) else AbsMLP(b)


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
    materialize=st.booleans(),
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
    out = mb.masked_branch(list(module.branches), x, gate) if functional else module(x, gate)
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
    out.backward(grad_out)
    if want.requires_grad:
        want.backward(grad_out)
    if bound.requires_grad:
        bound.backward(grad_out.double().abs())

    def grad_or_zeros(t, like):
        return t.grad if t.grad is not None else torch.zeros_like(like)

    if x.grad is None:  # allowed only when no row reached any branch (x anchored, undefined gradient)
        assert x_i.grad is None or torch.count_nonzero(x_i.grad) == 0, "x.grad"
    else:
        assert_within(x.grad, grad_or_zeros(x_i, x), grad_or_zeros(x_a, x_a), dtype, n + 16, "x.grad")
    g = ref_gate()
    live = torch.arange(n) == g if isinstance(g, int) else ref.live_mask(g, n).any(0)
    for i in range(n):
        for (name, p), pi, pa in zip(module.branches[i].named_parameters(), br_i[i].parameters(), br_a[i].parameters()):
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
        assert_within(gate.grad, grad_or_zeros(gate_i, gate), grad_or_zeros(gate_a, gate_a), low, numel_row + 16, "gate.grad")
        assert torch.count_nonzero(gate.grad[gate.detach() == 0]) == 0


# ----------------------------------------------------------------------------------------------
# drop_path / DropPath and drop_add_residual / ResidualDropPath against the dense formula, with
# masks drawn from the same seeded generator (the documented stream: Bernoulli(keep_prob) on the
# host, float32, one per row or one per call)


drop_probs = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0, allow_nan=False))
# The inputs both drop-path properties draw (the functional forms and the modules).
DROP_CASES = dict(
    batch=batches,
    trailing=trailing_shapes,
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    p=drop_probs,
    mode=st.sampled_from(["row", "batch"]),
    scale_by_keep=st.booleans(),
    training=st.sampled_from([True, True, True, False]),
    module=st.booleans(),
    seed=seeds,
)


def _mask(batch: int, p: float, mode: str, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(batch if mode == "row" else 1).bernoulli_(1 - p, generator=g)
    return draws.expand(batch) if mode == "batch" else draws


def _factor(p: float, scale_by_keep: bool, dtype: torch.dtype) -> float:
    keep = 1 - p
    return torch.ones((), dtype=dtype).div_(keep).item() if scale_by_keep and keep > 0 else 1.0


@fuzz("drop_path")
@given(**DROP_CASES)
def test_drop_path(batch, trailing, dtype, layout, p, mode, scale_by_keep, training, module, seed):
    RAN["drop_path"] += 1
    gen = torch.Generator().manual_seed(seed)
    x = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")
    g = torch.Generator().manual_seed(seed)
    if module:
        m = mb.DropPath(p, scale_by_keep, mode, generator=g).train(training)
        out = m(x)
    else:
        out = mb.drop_path(x, p, training, scale_by_keep, mode, generator=g)
    if not training or p == 0.0:
        assert out is x
        return
    coef = (_mask(batch, p, mode, seed).double() * _factor(p, scale_by_keep, dtype)).to(dtype)
    x_r = x.detach().clone().requires_grad_(True)
    want = x_r * coef.reshape(-1, *([1] * len(trailing)))
    absref = x.detach().double().abs() * coef.double().abs().reshape(-1, *([1] * len(trailing)))
    assert_within(out.detach(), want.detach(), absref, dtype, 1, "out")
    out.backward(grad_out)
    want.backward(grad_out)
    assert_within(x.grad, x_r.grad, grad_out.double().abs() * coef.double().abs().reshape(-1, *([1] * len(trailing))), dtype, 1, "x.grad")
    if layout == "channels_last" and x.dim() == 4 and mode == "row" and batch > 1 and trailing[0] > 1:
        assert out.is_contiguous(memory_format=torch.channels_last)


@fuzz("residual")
@given(**DROP_CASES)
def test_residual(batch, trailing, dtype, layout, p, mode, scale_by_keep, training, module, seed):
    RAN["residual"] += 1
    gen = torch.Generator().manual_seed(seed)
    linear = len(trailing) == 1
    (branch,) = make_branches(1, trailing, dtype, gen, linear)
    x = make_x(gen, batch, trailing, dtype, layout).requires_grad_(True)
    grad_out = make_x(gen, batch, trailing, dtype, "contiguous")
    g = torch.Generator().manual_seed(seed)
    b_m = copy.deepcopy(branch)
    if module:
        out = mb.ResidualDropPath(b_m, p, mode, scale_by_keep, generator=g).train(training)(x)
    else:
        out = mb.drop_add_residual(x, b_m, p, training, mode, scale_by_keep, g)
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
        else:  # the branch never ran: an undefined gradient
            assert pm.grad is None, name


def test_example_count(request):
    """Runs last: the properties above together ran at least 2000 examples (only checked when
    the whole file ran)."""
    if set(RAN) != set(EXAMPLES) or SCALE < 1:
        pytest.skip("not every property ran in this session")
    assert sum(EXAMPLES.values()) >= 2000
    assert sum(RAN.values()) >= 2000, dict(RAN)
