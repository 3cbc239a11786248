"""combine_weights_backward's kernels (csrc/cuda/combine_cuda.cu: dot_rows_kernel with a warp or a
block per row, at each vector width; sum_partials_kernel; check_row_plan_kernel) on the host:
every dtype; short rows (a warp each), long rows (a block each), rows split into chunks whose
partial sums a second kernel adds; misaligned inputs; more than 64 branches; grid-stride rounds;
nothing to sum. Small integers make every summation order exact, so those results equal the CPU
kernel and the reference bit for bit; normal values agree within rounding, and the bits never
depend on the schedule."""
import pytest
import torch

from emu_support import (DTYPES, SCHEDULES, assert_same_bits, cpu, emu, limits, misaligned,
                         random_plan_gate, reference, run, schedule, vec_width, ys_for)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def case(batch, n, row_numel, dtype, gen, integers, pattern="clustered"):
    plan = cpu.plan(random_plan_gate("float", batch, n, gen, pattern), n)
    ys = ys_for(plan, (row_numel,), dtype, gen, integers)
    grad = (torch.randint(-4, 5, (batch, row_numel), generator=gen) if integers
            else torch.randn(batch, row_numel, generator=gen)).to(dtype)
    return grad, ys, plan


def check(grad, ys, plan, exact):
    args = (grad, ys, plan[2], plan[3], plan[4])
    got = run("combine_weights_backward", *args)
    want, ref = cpu.combine_weights_backward(*args), reference.combine_weights_backward(*args)
    if exact:
        assert_same_bits(got, want, "emulated CUDA vs CPU")
        assert_same_bits(got, ref, "emulated CUDA vs reference")
    else:
        tol = TOL[grad.dtype] * max(1.0, grad.shape[1] ** 0.5)
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return got


# Row lengths in vectors: up to 512 a warp per row; above, a block per row; from 4096 (with
# fewer than 1024 rows) split into chunks of at least 2048 vectors.
PATHS = {"warp": (37, 40), "block": (6, 600), "chunks": (3, 4100)}


@pytest.mark.parametrize("integers", [True, False], ids=["integers", "normal"])
@pytest.mark.parametrize("vector", [True, False], ids=["vector", "scalar"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_backward(dtype, path, vector, integers):
    gen = torch.Generator().manual_seed(1)
    batch, vecs = PATHS[path]
    row_numel = vecs * vec_width(dtype) if vector else vecs + 1 - (vecs % 2)  # odd: one element a vector
    if not vector and path == "warp":
        row_numel = 41
    grad, ys, plan = case(batch, 3, row_numel, dtype, gen, integers, pattern="all")
    check(grad, ys, plan, exact=integers)


@pytest.mark.parametrize("which", ["grad", "y"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_weights_backward_misaligned(dtype, which):
    gen = torch.Generator().manual_seed(2)
    grad, ys, plan = case(20, 3, 8 * 70, dtype, gen, integers=True)
    if which == "grad":
        grad = misaligned(grad)
    else:
        ys[0] = misaligned(ys[0])
    check(grad, ys, plan, exact=True)


@pytest.mark.parametrize("n", [65, 130], ids=["65 branches", "130 branches"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_backward_over_a_device_branch_table(dtype, n):
    gen = torch.Generator().manual_seed(n)
    check(*case(6, n, 16, dtype, gen, integers=True, pattern="random"), exact=True)


@pytest.mark.parametrize("path", ["warp", "block"])
def test_weights_backward_grid_stride_rounds(path):
    gen = torch.Generator().manual_seed(3)
    batch = 70 if path == "warp" else 5
    row_numel = 40 if path == "warp" else 4 * 600
    grad, ys, plan = case(batch, 3, row_numel, torch.float32, gen, integers=True, pattern="random")
    for grid_blocks in [1, 2]:
        with limits(grid_blocks):
            check(grad, ys, plan, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_backward_with_nothing_to_sum_checks_the_plan(dtype):
    gen = torch.Generator().manual_seed(4)
    plan = cpu.plan(torch.zeros(0, dtype=torch.long), 2)
    check(torch.empty(0, 3, dtype=dtype), [torch.empty(0, 3, dtype=dtype)] * 2, plan, exact=True)
    grad, ys, plan = case(300, 3, 0, dtype, gen, integers=True, pattern="random")
    check(grad, ys, plan, exact=True)
    plan = cpu.plan(torch.full((5,), -1), 2)
    check(torch.randn(5, 8, generator=gen).to(dtype), [torch.empty(0, 8, dtype=dtype)] * 2, plan, exact=True)


@pytest.mark.parametrize("path", list(PATHS))
def test_weights_backward_bits_do_not_depend_on_the_schedule(path):
    gen = torch.Generator().manual_seed(5)
    batch, vecs = PATHS[path]
    grad, ys, plan = case(batch, 3, vecs * 4, torch.float32, gen, integers=False, pattern="all")
    results = []
    for name in SCHEDULES:
        with schedule(name, seed=7):
            results.append(emu.combine_weights_backward(grad, ys, plan[2], plan[3], plan[4]))
    for other in results[1:]:
        assert_same_bits(results[0], other, "schedules")
