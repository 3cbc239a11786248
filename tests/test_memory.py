"""Memory: thousands of calls (forward and backward) of every module and functional form leave
no growth: neither resident memory (CPU) nor live Python objects or tensors, and the internal
caches stay bounded when shapes and drop probabilities vary. No call leaves reference cycles
(everything it made is freed by reference counting, with or without a backward: no autograd ctx
holds its own output or its module). On a GPU, the CUDA caching allocator's allocated bytes return
to the same value (skips without a GPU).

Thresholds. After a warm-up of 1,000 calls (allocator pools, autograd and dispatcher caches,
first-call checks) the 2,000 measured calls may grow the resident set by at most 512 KiB, and
the last 1,000 by at most 192 KiB, that is about 200 bytes per call: below anything that keeps
a tensor, a graph or a plan alive per call (a few hundred bytes of tensor metadata each, plus
their data). The resident set settles within the first few thousand calls (allocator arenas and
pools filling up; glibc returns freed pages lazily, so malloc_trim is called before each
reading where available) and is flat after. Live Python objects may grow by at most 100 and
live tensors by at most 10: one leaked object per call would be 2,000.
MASKEDBRANCH_MEMORY_CALLS=10000 runs longer.
"""
from __future__ import annotations

import ctypes
import gc
import os
from typing import Callable

import pytest
import torch
from torch import nn

import harness
import maskedbranch as mb

CALLS = int(os.environ.get("MASKEDBRANCH_MEMORY_CALLS", 2000))
WARMUP = 1_000
RSS_LIMIT = 512 << 10  # bytes over CALLS calls
RSS_LATE_LIMIT = 192 << 10  # bytes over the last CALLS / 2 calls
OBJECT_LIMIT = 100
TENSOR_LIMIT = 10
B, D, N = 8, 4, 3

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")

try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _libc = None


def rss() -> int:
    """Resident memory once freed objects and pages are returned."""
    gc.collect()
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)
    return harness.rss()


def objects() -> tuple:
    """(live Python objects, live tensors) the cycle collector tracks."""
    gc.collect()
    alive = gc.get_objects()
    return len(alive), sum(1 for o in alive if issubclass(type(o), torch.Tensor))  # type(): no attribute lookups


def measure(step: Callable[[int], None], calls: int = CALLS):
    """(resident growth over the calls, over their second half, live-object growth, live-tensor
    growth)."""
    for i in range(WARMUP):
        step(i)
    r0, (o0, t0) = rss(), objects()
    for i in range(calls // 2):
        step(i)
    r_half = rss()
    for i in range(calls // 2, calls):
        step(i)
    r1, (o1, t1) = rss(), objects()
    return r1 - r0, r1 - r_half, o1 - o0, t1 - t0


def check(what: str, grew: int, grew_late: int, new_objects: int, new_tensors: int) -> None:
    assert grew < RSS_LIMIT, f"{what}: resident memory grew by {grew / 1024:.0f} KiB over {CALLS} calls"
    assert grew_late < RSS_LATE_LIMIT, (
        f"{what}: resident memory still grew by {grew_late / 1024:.0f} KiB over the last {CALLS // 2} calls"
    )
    assert new_objects < OBJECT_LIMIT, f"{what}: {new_objects} more live Python objects after {CALLS} calls"
    assert new_tensors < TENSOR_LIMIT, f"{what}: {new_tensors} more live tensors after {CALLS} calls"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with harness.intra_op_threads(1):  # tiny tensors: no intra-op threads (and no per-thread arenas)
        yield


def branches():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, D)) for _ in range(N)]


def make_steps(backward: bool = True):
    """name -> step(i): one call (forward, and backward unless told not to) with tiny tensors."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, D, generator=g)
    gates = [
        1,
        -1,
        torch.randint(-1, N, (B,), generator=g),
        torch.rand(B, N, generator=g) < 0.5,
        torch.rand(B, N, generator=g) * (torch.rand(B, N, generator=g) < 0.5),
        "soft",  # dense weights that require grad, made anew on every call
    ]
    soft = torch.rand(B, N, generator=g)

    def gate(i):
        k = gates[i % len(gates)]
        return soft.clone().requires_grad_(True) if isinstance(k, str) else k
    modules = [mb.MaskedBranch(branches(), materialize_grads=m) for m in (None, True, False)]  # no tie, zeros, undefined
    module = modules[0]
    funcs = branches()
    residual = mb.ResidualDropPath(branches()[0], 0.5, generator=torch.Generator().manual_seed(1))
    drop = mb.DropPath(0.5, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    res_branch = branches()[0]

    def run(out):
        if backward and out.requires_grad:  # not when nothing ran and nothing is tied
            out.sum().backward()

    def masked(i):
        run(modules[(i // len(gates)) % 3](x0.clone().requires_grad_(True), gate(i)))

    def functional(i):
        run(mb.masked_branch(funcs, x0.clone().requires_grad_(True), gate(i)))

    def drop_path_module(i):
        run(drop(x0.clone().requires_grad_(True)))
        drop.mode = "batch" if i % 2 else "row"

    def drop_path_function(i):
        run(mb.drop_path(x0.clone().requires_grad_(True), 0.5, True, mode="row" if i % 2 else "batch", generator=gen))

    def residual_module(i):
        run(residual(x0.clone().requires_grad_(True)))
        residual.mode = "batch" if i % 2 else "row"

    def residual_function(i):
        x = x0.clone().requires_grad_(True)
        run(mb.drop_add_residual(x, res_branch, 0.5, True, mode="row" if i % 2 else "batch", generator=gen))

    def ops(i):
        x = x0.clone().requires_grad_(True)
        plan = mb.make_plan(gates[2 + i % 3], N)
        ys = [y * 2 for y in mb.gather(x, plan)]
        w = soft.clone().requires_grad_(True)
        out = mb.combine(ys, plan, weights=w, base=x, tied=list(funcs[0].parameters()), materialize_grads=bool(i % 2))
        run(mb.tie(out, list(module.parameters()), materialize=bool(i % 3)))

    return {
        "MaskedBranch": masked,
        "masked_branch": functional,
        "DropPath": drop_path_module,
        "drop_path": drop_path_function,
        "ResidualDropPath": residual_module,
        "drop_add_residual": residual_function,
        "ops": ops,
    }


STEP_NAMES = list(make_steps())


@pytest.mark.slow
@pytest.mark.parametrize("name", STEP_NAMES)
def test_no_growth_over_many_calls(name):
    check(name, *measure(make_steps()[name]))


def _ours(o) -> bool:
    """Tensors, autograd ctx objects and anything of maskedbranch's."""
    if isinstance(o, (torch.Tensor, torch.autograd.function.FunctionCtx)):
        return True
    return (getattr(o, "__module__", None) or type(o).__module__ or "").startswith("maskedbranch")


@pytest.mark.slow
@pytest.mark.parametrize("backward", [True, False], ids=["backward", "forward_only"])
def test_no_reference_cycles(backward):
    """Every call frees its tensors, autograd ctx objects and routing objects by reference
    counting alone: after 60 calls of each form the cycle collector finds none of them (a ctx
    that kept its own output or its module alive through the graph would be a cycle). torch's
    own pytree flattening leaves small cycles of plain functions (torch.func.functional_call,
    which the output-shape probe of an all-dead call uses): not counted."""
    steps = make_steps(backward)
    for step in steps.values():  # first calls fill caches (signatures, structure, dispatcher)
        for i in range(12):
            step(i)
    gc.collect()
    gc.disable()
    before = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what it finds, to look at it
    try:
        for name, step in steps.items():
            for i in range(60):
                step(i)
            gc.collect()
            found = [o for o in gc.garbage if _ours(o)]
            gc.garbage.clear()
            kinds = sorted({type(o).__name__ for o in found})
            assert not found, f"{name}: {len(found)} objects in reference cycles ({', '.join(kinds[:12])})"
    finally:
        gc.set_debug(before)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.slow
def test_caches_stay_bounded_when_shapes_and_probabilities_vary():
    """Output-signature cache (one entry per input signature) and the keep-scale cache (one per
    drop probability and dtype) are bounded: 10,000 calls with ever new shapes and drop
    probabilities leave no growth either."""
    module = mb.MaskedBranch([nn.Identity(), nn.Tanh()])
    gen = torch.Generator().manual_seed(4)

    def step(i):
        x = torch.randn(2, 1 + i % 500, requires_grad=True)  # 500 distinct trailing shapes
        out = module(x, torch.tensor([0, 1]))
        p = 0.05 + 0.9 * (i / (WARMUP + CALLS))  # a new drop probability on every call
        out = mb.drop_path(out, p, True, generator=gen) + mb.drop_add_residual(x, torch.tanh, p, True, generator=gen)
        out.sum().backward()

    check("varying shapes and drop probabilities", *measure(step))
    assert len(module._unit.signatures.table) <= module._unit.signatures.size


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and mb.WITH_CUDA), reason="needs a GPU and a CUDA build")
def test_cuda_allocated_bytes_return_to_baseline():
    steps = {}
    module = mb.MaskedBranch(branches()).cuda()
    residual = mb.ResidualDropPath(branches()[0].cuda(), 0.5, generator=torch.Generator().manual_seed(1))
    x0 = torch.randn(B, D, device="cuda")
    gates = [1, -1, torch.randint(-1, N, (B,)), torch.rand(B, N) < 0.5, (torch.rand(B, N) * 0.5).cuda()]

    def masked(i):
        module(x0.clone().requires_grad_(True), gates[i % len(gates)]).sum().backward()

    def res(i):
        residual.mode = "batch" if i % 2 else "row"
        residual(x0.clone().requires_grad_(True)).sum().backward()

    def drop(i):
        mb.drop_path(x0.clone().requires_grad_(True), 0.5, True, mode="batch" if i % 2 else "row").sum().backward()

    steps = {"MaskedBranch": masked, "ResidualDropPath": res, "drop_path": drop}
    for name, step in steps.items():
        for i in range(WARMUP):
            step(i)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for i in range(CALLS):
            step(i)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        assert after == before, f"{name}: {after - before} bytes still allocated after {CALLS} calls"
