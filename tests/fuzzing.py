"""Shared pieces of the property-based tests (tests/test_fuzz.py: the ops and drop_path;
tests/test_fuzz_modules.py: MaskedBranch and the residual forms): hypothesis settings and
strategies, input and gate makers, the error bound, and branches with their absolute
linearizations.

Tolerances. The fused kernels accumulate in float32 (float64 for float64) and round once; the
references round at every step in the tensor's dtype. A sum of K terms rounded at every step is
off by at most about K * eps * sum(|term|) (recursive summation bound, eps = the dtype's machine
epsilon), so results are checked element by element against

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
import os
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import harness  # noqa: E402
from maskedbranch import reference as ref  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ID_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
LAYOUTS = ["contiguous", "strided_rows", "sliced", "transposed", "channels_last"]

EXAMPLES = {
    "plan": 300,
    "route": 600,
    "masked_branch": 600,
    "drop_path": 200,
    "residual": 300,
}
# MASKEDBRANCH_FUZZ_SCALE=10 runs ten times as many examples (a longer local or nightly run)
SCALE = float(os.environ.get("MASKEDBRANCH_FUZZ_SCALE", "1"))
RAN: Dict[str, int] = collections.Counter()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency (large on a loaded machine);
    tests/test_determinism.py covers the multi-threaded kernels."""
    with harness.intra_op_threads(1):
        yield


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


def _grad(t: Tensor, like: Tensor) -> Tensor:
    """t's gradient, zeros where autograd left it undefined (a leaf that reached no live row)."""
    return torch.zeros_like(like) if t.grad is None else t.grad


# ----------------------------------------------------------------------------------------------
# Branches and their absolute linearizations


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


# ----------------------------------------------------------------------------------------------
# Drop-path cases and masks, drawn from the same seeded generator as the code under test:
# drop_path draws as timm does (Bernoulli(keep_prob) in x's dtype, one per row or one per call,
# divided by keep_prob in that dtype); the residual forms draw on the host (float32, one per row
# or per call) and scale by the same rounded factor.


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


def _mask(batch: int, p: float, mode: str, seed: int, dtype=torch.float32) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(batch if mode == "row" else 1, dtype=dtype).bernoulli_(1 - p, generator=g)
    return draws.expand(batch) if mode == "batch" else draws


def _factor(p: float, scale_by_keep: bool, dtype: torch.dtype) -> float:
    keep = 1 - p
    return torch.ones((), dtype=dtype).div_(keep).item() if scale_by_keep and keep > 0 else 1.0


def check_example_count(names) -> None:
    """Each of these properties ran its examples (skipped unless all of them ran in this session)."""
    if any(n not in RAN for n in names) or SCALE < 1:
        pytest.skip("not every property ran in this session")
    for name in names:
        assert RAN[name] >= EXAMPLES[name], dict(RAN)
