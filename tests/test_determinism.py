"""Determinism: every op and module, forward and backward, gives bitwise-identical outputs and
gradients when run twice; the routing kernels give the same bits for any number of threads
(each output row is written by one task in a fixed order: CSR plans, no atomics); and under
torch.use_deterministic_algorithms(True) no op raises and every result equals the normal run's
bit for bit (that mode also fills uninitialized memory with NaN, so an output element a kernel
forgot to write would show). CUDA variants skip without a GPU.

Sizes are chosen so that the CPU kernels split their rows over several parallel tasks
(row_grain = 32768 / values per row).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Callable, Dict, List

import pytest
import torch
from torch import Tensor, nn

import maskedbranch as mb

from harness import DEVICES
from harness import intra_op_threads as threads

B, D, N = 1536, 64, 6  # 512 rows per CPU task: 3 tasks


class Affine(nn.Module):
    """An elementwise branch (no matmul, so no cuBLAS workspace setting is needed in
    deterministic mode on a GPU)."""

    def __init__(self, d: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(1 + 0.5 * torch.randn(d, generator=g))
        self.b = nn.Parameter(0.5 * torch.randn(d, generator=g))

    def forward(self, x):
        return torch.tanh(x * self.w + self.b)


def branches(device, linear: bool) -> List[nn.Module]:
    torch.manual_seed(0)
    if linear:
        return [nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D)).to(device) for _ in range(N)]
    return [Affine(D, i).to(device) for i in range(N)]


def inputs(device, seed=1) -> Dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(B, N, generator=g)
    weights = torch.where(weights < 0.5, torch.zeros_like(weights), weights)
    return {
        "x": torch.randn(B, D, generator=g).to(device),
        "x4": torch.randn(B // 8, 8, 4, 4, generator=g).to(device).contiguous(memory_format=torch.channels_last),
        "base": torch.randn(B, D, generator=g).to(device),
        "ids": torch.randint(-1, N, (B,), generator=g),
        "mask": torch.rand(B, N, generator=g) < 0.3,
        "weights": weights,
        "scale": torch.where(torch.rand(B, generator=g) < 0.3, 0.0, 1.5).to(device),
        "grad": torch.randn(B, D, generator=g).to(device),
    }


def _leaf(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(True)


def _collect(out: Tensor, grad: Tensor, leaves: Dict[str, Tensor], modules: List[nn.Module]) -> List[Tensor]:
    out.backward(grad.reshape(out.shape) if grad.numel() == out.numel() else torch.ones_like(out))
    result = [out.detach()]
    result += [t.grad for t in leaves.values()]
    for m in modules:
        result += [p.grad for p in m.parameters()]
    return result


# Each scenario: (device) -> every output and gradient, computed from scratch.


def s_route(device, kind):
    t = inputs(device)
    x, base = _leaf(t["x"]), _leaf(t["base"])
    weights = _leaf(t["weights"].to(device)) if kind == "weights" else None
    gate = {"ids": t["ids"], "mask": t["mask"], "weights": t["weights"]}[kind]
    plan = mb.make_plan(gate, N, device=device)
    ys = [torch.sin(y) * (i + 1) for i, y in enumerate(mb.gather(x, plan))]
    out = mb.combine(ys, plan, weights=weights, base=base)
    leaves = {"x": x, "base": base} | ({"weights": weights} if weights is not None else {})
    return [plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos] + _collect(out, t["grad"], leaves, [])


def s_route_channels_last(device):
    t = inputs(device)
    x = _leaf(t["x4"])
    gate = t["ids"][: x.shape[0]]
    plan = mb.make_plan(gate, N, device=device)
    ys = [y * (i + 1) for i, y in enumerate(mb.gather(x, plan))]
    out = mb.combine(ys, plan, base=x)
    return _collect(out, torch.ones(()), {"x": x}, [])


def s_route_scale(device):
    """The residual forms' combine: base plus one branch scaled per row (weights [B, 1])."""
    t = inputs(device)
    x, scale = _leaf(t["x"]), _leaf(t["scale"][:, None])
    plan = mb.make_plan(t["ids"].clamp(max=0), 1, device=device)  # -1 dropped, 0 kept
    (y,) = mb.gather(x, plan)
    out = mb.combine([torch.tanh(y)], plan, weights=scale, base=x)
    return _collect(out, t["grad"], {"x": x, "scale": scale}, [])


def s_tie(device):
    t = inputs(device)
    x = _leaf(t["x"])
    ms = branches(device, linear=False)
    out = mb.tie(x * 2, [p for m in ms for p in m.parameters()], materialize=True)  # zeros for them
    return _collect(out, t["grad"], {"x": x}, ms)


def s_masked_branch(device, kind, linear):
    t = inputs(device)
    x = _leaf(t["x"])
    ms = branches(device, linear)
    m = mb.MaskedBranch(ms)
    gate = {"int": 2, "ids": t["ids"], "mask": t["mask"], "weights": _leaf(t["weights"])}[kind]
    out = m(x, gate)
    leaves = {"x": x} | ({"gate": gate} if kind == "weights" else {})
    return _collect(out, t["grad"], leaves, ms)


def s_masked_branch_functional(device):
    t = inputs(device)
    x = _leaf(t["x"])
    ms = branches(device, linear=False)
    return _collect(mb.masked_branch(ms, x, t["ids"].to(device)), t["grad"], {"x": x}, ms)


def s_drop_path(device, mode, module):
    t = inputs(device)
    x = _leaf(t["x"])
    g = torch.Generator().manual_seed(7)
    out = mb.DropPath(0.3, mode=mode, generator=g)(x) if module else mb.drop_path(x, 0.3, True, mode=mode, generator=g)
    return _collect(out, t["grad"], {"x": x}, [])


def s_residual(device, mode, module):
    t = inputs(device)
    x = _leaf(t["x"])
    (branch,) = branches(device, linear=False)[:1]
    g = torch.Generator().manual_seed(8)
    if module:
        out = mb.ResidualDropPath(branch, 0.3, mode=mode, generator=g)(x)
    else:
        out = mb.drop_add_residual(x, branch, 0.3, True, mode=mode, generator=g)
    return _collect(out, t["grad"], {"x": x}, [branch])


SCENARIOS: Dict[str, Callable] = {
    **{f"route[{k}]": (lambda d, k=k: s_route(d, k)) for k in ("ids", "mask", "weights")},
    "route[channels_last]": s_route_channels_last,
    "route[scale]": s_route_scale,
    "tie": s_tie,
    **{f"MaskedBranch[{k}]": (lambda d, k=k: s_masked_branch(d, k, False)) for k in ("int", "ids", "mask", "weights")},
    **{f"MaskedBranch[{k},linear]": (lambda d, k=k: s_masked_branch(d, k, True)) for k in ("ids", "weights")},
    "masked_branch": s_masked_branch_functional,
    **{f"drop_path[{m},{'module' if mod else 'function'}]": (lambda d, m=m, mod=mod: s_drop_path(d, m, mod))
       for m in ("row", "batch") for mod in (False, True)},
    **{f"residual[{m},{'module' if mod else 'function'}]": (lambda d, m=m, mod=mod: s_residual(d, m, mod))
       for m in ("row", "batch") for mod in (False, True)},
}
# Only the routing kernels promise the same bits for any thread count (a GEMM does not).
THREAD_INDEPENDENT = [k for k in SCENARIOS if "linear" not in k]


def assert_bitwise(a: List, b: List, what: str) -> None:
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b)):
        assert (u is None) == (v is None), f"{what}: result {i} defined in one run only"
        if u is None:
            continue
        assert u.dtype == v.dtype and u.shape == v.shape, f"{what}: result {i}"
        # bitwise: compare the bytes, so that -0.0 vs 0.0 and NaN payloads count too
        same = torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)) if u.numel() else True
        assert same, f"{what}: result {i} differs in {int((u != v).sum())} elements"


@contextlib.contextmanager
def deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_runs_bitwise_identical(name, device):
    first = SCENARIOS[name](device)
    second = SCENARIOS[name](device)
    _sync(device)
    assert_bitwise(first, second, name)
    assert any(r is not None and r.numel() for r in first[1:]), "nothing was differentiated"


def test_cpu_kernels_run_on_every_thread():
    """The comparison below means something only if the kernels really fork: ATen's parallel_for
    forks only in code compiled with OpenMP under torch's OpenMP backend (setup.py's
    openmp_flags); a build without it runs every kernel on one thread and still passes the rest."""
    for n in (1, 2, 4):
        with threads(n):
            used = torch.ops.maskedbranch.cpu_kernel_threads()
            assert used == n, f"the CPU kernels ran on {used} of {n} threads"


def kernel_results() -> List[Tensor]:
    """The routing ops' outputs in every float dtype (weighted and plain gathers, combines with
    and without a base), from a fixed seed."""
    ops, gen = torch.ops.maskedbranch, torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.randn(B, D, generator=gen).to(dtype)
        w = torch.rand(B, N, generator=gen)
        w = w.double() if dtype == torch.float64 else w
        gate = torch.rand(B, N, generator=gen) < 0.4
        p = mb.make_plan(gate, N)
        for weights in (None, w):
            ys = ops.gather(x, p.rows, weights, p.counts)
            out += ys
            for base in (None, x):
                out.append(ops.combine(base, ys, weights, p.row_offsets, p.row_branch, p.row_pos))
    return out


def test_same_bits_from_baseline_cpu_code(tmp_path):
    """On x86-64 the row loops run compiled for AVX2 where the CPU has it; without FMA they round
    as the baseline code does. MASKEDBRANCH_CPU_BASELINE=1 (read at the first call) selects the
    baseline code in a fresh process."""
    script = (f"import sys, torch; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
              f"import test_determinism as t; torch.save(t.kernel_results(), {str(tmp_path / 'base.pt')!r})")
    env = {**os.environ, "MASKEDBRANCH_CPU_BASELINE": "1"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    assert_bitwise(kernel_results(), torch.load(tmp_path / "base.pt"), "AVX2 vs baseline row loops")


@pytest.mark.parametrize("name", THREAD_INDEPENDENT)
def test_same_bits_for_any_thread_count(name):
    with threads(1):
        one = SCENARIOS[name]("cpu")
    with threads(4):
        four = SCENARIOS[name]("cpu")
    assert_bitwise(one, four, f"{name}: 1 vs 4 threads")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_deterministic_algorithms_mode(name, device):
    normal = SCENARIOS[name](device)
    with deterministic_algorithms():
        strict = SCENARIOS[name](device)  # raises if any op has no deterministic implementation
        _sync(device)
    assert_bitwise(normal, strict, f"{name}: use_deterministic_algorithms(True)")
