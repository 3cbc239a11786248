"""gather's kernels (csrc/cuda/row_kernels.cuh: gather_kernel at each vector width, check_rows_kernel;
device_rows.cuh: write_table_kernel) on the host: every dtype, the vector path and the scalar one
(rows not a whole number of vectors, misaligned x), long rows over several block columns,
channels_last, one row, empty branches, more than 64 branches, grid-stride rounds, rows of zero
elements; equal to the CPU kernel bit for bit (outputs, layouts) and to the reference; hand-made
rows out of range stop the kernel with its assert."""
import pytest
import torch

from emu_support import (DTYPES, SCHEDULES, assert_equal_values, assert_same_bits, cpu, cpu_error,
                         emu, limits, misaligned, random_plan_gate, reference, run, schedule, vec_width)


def check_gather(x, rows, weights, counts):
    got = run("gather", x, rows, weights, counts)
    want = cpu.gather(x, rows, weights, counts)
    ref = reference.gather(x, rows, weights, counts)
    assert len(got) == len(want) == len(counts)
    for i, (g, w, r) in enumerate(zip(got, want, ref)):
        assert_same_bits(g, w, f"branch {i}: emulated CUDA vs CPU")
        assert_equal_values(g.contiguous(), r.contiguous(), f"branch {i}: emulated CUDA vs reference")
    return got


def routed(batch, n, gen, pattern="clustered"):
    """(plan, weights [B, N]) of a float gate: several branches per row, some branches empty."""
    gate = random_plan_gate("float", batch, n, gen, pattern)
    return cpu.plan(gate, n), gate


def counts_of(plan):
    return plan[0].diff().tolist()


def x_of(layout, batch, dtype, gen):
    vw = vec_width(dtype)
    if layout == "vector":
        return torch.randn(batch, 3 * 8, generator=gen).to(dtype)
    if layout == "tail":
        return torch.randn(batch, 13, generator=gen).to(dtype)
    if layout == "misaligned":
        return misaligned(torch.randn(batch, 3 * 8, generator=gen).to(dtype))
    if layout == "long":  # 1030 vectors a row: two block columns of 1024
        return torch.randn(batch, 2, vw * 515, generator=gen).to(dtype)
    if layout == "long_tail":  # 4121 elements a row, one at a time: five block columns
        return torch.randn(batch, 4121, generator=gen).to(dtype)
    if layout == "channels_last":
        return torch.randn(batch, 3, 2, 4, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    raise ValueError(layout)


@pytest.mark.parametrize("weighted", [False, True], ids=["copy", "weighted"])
@pytest.mark.parametrize("layout", ["vector", "tail", "misaligned", "long", "long_tail", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_equals_cpu_and_reference(dtype, layout, weighted):
    gen = torch.Generator().manual_seed(1)
    batch = 5 if layout.startswith("long") else 37
    plan, gate = routed(batch, 4, gen)
    x = x_of(layout, batch, dtype, gen)
    check_gather(x, plan[1], gate if weighted else None, counts_of(plan))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_one_row_and_no_rows(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 8, generator=gen).to(dtype)
    check_gather(x, torch.zeros(1, dtype=torch.long), None, [1])
    check_gather(x, torch.zeros(1, dtype=torch.long), torch.full((1, 1), 0.5), [1])
    check_gather(x, torch.zeros(0, dtype=torch.long), None, [0, 0])


@pytest.mark.parametrize("n", [65, 130], ids=["65 branches", "130 branches"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_over_a_device_branch_table(dtype, n):
    """More than 64 branches: the pointer table lives in device memory, written by
    write_table_kernel in chunks of 256 values (130 branches: two chunks)."""
    gen = torch.Generator().manual_seed(n)
    plan, gate = routed(40, n, gen, "random")
    check_gather(torch.randn(40, 8, generator=gen).to(dtype), plan[1], gate, counts_of(plan))


@pytest.mark.parametrize("row_numel", [1, 24], ids=["1 element", "24 elements"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gather_grid_stride_rounds(dtype, row_numel):
    gen = torch.Generator().manual_seed(3)
    plan, gate = routed(600, 3, gen, "random")
    x = torch.randn(600, row_numel, generator=gen).to(dtype)
    for grid_blocks in [1, 2]:
        with limits(grid_blocks):
            check_gather(x, plan[1], gate, counts_of(plan))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_rows_of_zero_elements_check_the_rows(dtype):
    gen = torch.Generator().manual_seed(4)
    plan, gate = routed(300, 3, gen, "random")
    for shape in [(300, 0), (300, 3, 0)]:
        check_gather(torch.zeros(shape, dtype=dtype), plan[1], gate, counts_of(plan))


ROWS_ASSERT = r"device-side assert triggered: rows: entry out of range \[0, x.size\(0\)\) \(hand-made plan\)"


@pytest.mark.parametrize("row_numel", [0, 7, 24], ids=["zero elements", "scalar path", "vector path"])
@pytest.mark.parametrize("bad", [-1, 9, 1 << 40])
def test_gather_hand_made_rows_out_of_range_assert(bad, row_numel):
    x = torch.randn(9, row_numel)
    rows = torch.tensor([0, 8, 3, 5, 1, 2])
    for where in [0, 3, 5]:
        r = rows.clone()
        r[where] = bad
        assert cpu_error(lambda: cpu.gather(x, r, None, [2, 4]))[0] is IndexError
        with pytest.raises(RuntimeError, match=ROWS_ASSERT):
            run("gather", x, r, None, [2, 4])


@pytest.mark.parametrize("weighted", [False, True], ids=["copy", "weighted"])
def test_gather_bits_do_not_depend_on_the_schedule(weighted):
    gen = torch.Generator().manual_seed(5)
    plan, gate = routed(200, 3, gen, "random")
    x = torch.randn(200, 40, generator=gen).half()
    results = []
    for name in SCHEDULES:
        with schedule(name, seed=9):
            results.append(emu.gather(x, plan[1], gate if weighted else None, counts_of(plan)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_same_bits(a, b, "schedules")
