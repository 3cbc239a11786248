"""combine's kernels (csrc/cuda/row_kernels.cuh: segment_sum_kernel at each vector width;
plan_asserts.cuh: check_row_plan_kernel; write_table_kernel) on the host: every dtype, with and
without base and weights, the vector path and the scalar one (rows not a whole number of vectors,
misaligned base or branch output), long rows, channels_last, one row, rows with no entry,
empty branches, more than 64 branches, grid-stride rounds, no rows, rows of zero elements;
equal to the CPU kernel bit for bit and to the reference.

The CPU kernel copies a row's first term where there is no base, the CUDA kernel adds it to 0:
a sum of -0.0 terms is -0.0 on the CPU, +0.0 on CUDA (and in the reference). Comparisons with the
CPU therefore take -0.0 and +0.0 as one (test_signed_zero_of_a_sum_without_base pins it down)."""
import pytest
import torch

from emu_support import (DTYPES, SCHEDULES, assert_equal_values, assert_same_bits, cpu, emu, limits,
                         misaligned, random_plan_gate, reference, run, schedule, vec_width, ys_for)

TRAILING = {"vector": (24,), "tail": (13,), "misaligned_base": (24,), "misaligned_y": (24,),
            "channels_last": (3, 2, 4)}


def check_combine(base, ys, weights, plan):
    args = (base, ys, weights, plan[2], plan[3], plan[4])
    got = run("combine", *args)
    assert_same_bits(got, cpu.combine(*args), "emulated CUDA vs CPU", signed_zeros=False)
    assert_equal_values(got.contiguous(), reference.combine(*args).contiguous(), "emulated CUDA vs reference")
    return got


def routed(batch, n, gen, pattern="clustered"):
    gate = random_plan_gate("float", batch, n, gen, pattern)
    return cpu.plan(gate, n), gate


def inputs(layout, batch, n, dtype, gen, with_base):
    plan, gate = routed(batch, n, gen)
    if layout.startswith("long"):
        trailing = (2, vec_width(dtype) * 515) if layout == "long" else (4121,)
    else:
        trailing = TRAILING[layout]
    ys = ys_for(plan, trailing, dtype, gen)
    base = torch.randn(batch, *trailing, generator=gen).to(dtype) if with_base else None
    if layout == "channels_last":
        ys = [y.contiguous(memory_format=torch.channels_last) for y in ys]
        base = None if base is None else base.contiguous(memory_format=torch.channels_last)
    if layout == "misaligned_base" and base is not None:
        base = misaligned(base)
    if layout == "misaligned_y":
        k = max(range(n), key=lambda i: ys[i].shape[0])
        ys[k] = misaligned(ys[k])
    return base, ys, gate, plan


@pytest.mark.parametrize("weighted", [False, True], ids=["sum", "weighted"])
@pytest.mark.parametrize("with_base", [False, True], ids=["no base", "base"])
@pytest.mark.parametrize("layout", list(TRAILING) + ["long", "long_tail"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_equals_cpu_and_reference(dtype, layout, with_base, weighted):
    gen = torch.Generator().manual_seed(1)
    batch = 4 if layout.startswith("long") else 37
    base, ys, gate, plan = inputs(layout, batch, 4, dtype, gen, with_base)
    check_combine(base, ys, gate if weighted else None, plan)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_one_row_and_rows_without_entries(dtype):
    gen = torch.Generator().manual_seed(2)
    plan = cpu.plan(torch.tensor([0]), 1)
    check_combine(None, [torch.randn(1, 8, generator=gen).to(dtype)], None, plan)
    plan = cpu.plan(torch.tensor([-1, -1, -1]), 2)  # no row reaches a branch
    empty = [torch.empty(0, 8, dtype=dtype)] * 2
    check_combine(torch.randn(3, 8, generator=gen).to(dtype), empty, None, plan)
    check_combine(None, empty, torch.rand(3, 2, generator=gen), plan)


@pytest.mark.parametrize("n", [65, 130], ids=["65 branches", "130 branches"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_over_a_device_branch_table(dtype, n):
    gen = torch.Generator().manual_seed(n)
    plan, gate = routed(40, n, gen, "random")
    check_combine(torch.randn(40, 8, generator=gen).to(dtype), ys_for(plan, (8,), dtype, gen), gate, plan)


@pytest.mark.parametrize("row_numel", [1, 24], ids=["1 element", "24 elements"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_combine_grid_stride_rounds(dtype, row_numel):
    gen = torch.Generator().manual_seed(3)
    plan, gate = routed(600, 3, gen, "random")
    base = torch.randn(600, row_numel, generator=gen).to(dtype)
    ys = ys_for(plan, (row_numel,), dtype, gen)
    for grid_blocks in [1, 2]:
        with limits(grid_blocks):
            check_combine(base, ys, gate, plan)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_with_nothing_to_sum_checks_the_plan(dtype):
    """No rows, or rows of zero elements: check_row_plan_kernel alone (over a grid-stride loop)."""
    gen = torch.Generator().manual_seed(4)
    plan = cpu.plan(torch.zeros(0, dtype=torch.long), 3)
    check_combine(None, [torch.empty(0, 5, dtype=dtype)] * 3, None, plan)
    plan, gate = routed(700, 3, gen, "random")
    for grid_blocks in [-1, 1]:
        with limits(grid_blocks):
            check_combine(torch.zeros(700, 0, dtype=dtype), ys_for(plan, (0,), dtype, gen), gate, plan)
            check_combine(None, ys_for(plan, (4, 0), dtype, gen), None, plan)


def test_signed_zero_of_a_sum_without_base():
    plan = cpu.plan(torch.tensor([0, 1]), 2)
    ys = [torch.tensor([[-0.0, 1.0]]), torch.tensor([[-0.0, -0.0]])]
    args = (None, ys, None, plan[2], plan[3], plan[4])
    got, ref, on_cpu = run("combine", *args), reference.combine(*args), cpu.combine(*args)
    assert torch.signbit(got).tolist() == torch.signbit(ref).tolist() == [[False, False], [False, False]]
    assert torch.signbit(on_cpu).tolist() == [[True, False], [True, True]]


@pytest.mark.parametrize("weighted", [False, True], ids=["sum", "weighted"])
def test_combine_bits_do_not_depend_on_the_schedule(weighted):
    gen = torch.Generator().manual_seed(5)
    plan, gate = routed(200, 3, gen, "random")
    ys = ys_for(plan, (40,), torch.float16, gen)
    base = torch.randn(200, 40, generator=gen).half()
    results = []
    for name in SCHEDULES:
        with schedule(name, seed=9):
            results.append(emu.combine(base, ys, gate if weighted else None, plan[2], plan[3], plan[4]))
    for other in results[1:]:
        assert_same_bits(results[0], other, "schedules")
