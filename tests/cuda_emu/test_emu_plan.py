"""The plan kernels (csrc/cuda/plan_cuda.cu: init_status, live, fetch_bad_value, fill) on the host:
every gate dtype, int32 and int64 counting, tiles crossed in both directions, grid-stride rounds,
random / clustered / empty / full gates; equal to the CPU kernel and the reference, bit for bit,
and the same errors for bad gates."""
import pytest
import torch

from emu_support import (SCHEDULES, cpu, cpu_error, emu, limits, random_plan_gate, reference, run,
                         schedule)

MASK_DTYPES = [torch.bool, torch.float32, torch.float64, torch.float16, torch.bfloat16]


def gate_of(kind, dtype, batch, n, gen, pattern):
    if kind == "ids":
        ids = random_plan_gate("ids", batch, n, gen, pattern)
        return (ids.clamp(min=0) if dtype == torch.uint8 else ids).to(dtype)  # uint8 has no -1
    g = random_plan_gate("bool" if dtype == torch.bool else "float", batch, n, gen, pattern)
    return g.to(dtype)


def check_plan(gate, n):
    got = run("plan", gate, n)
    want = cpu.plan(gate, n)
    ref = reference.plan(gate, n)
    for name, g, w, r in zip(["offsets", "rows", "row_offsets", "row_branch", "row_pos"], got, want, ref):
        assert g.dtype == torch.int64 and g.device.type == "cpu", name
        assert torch.equal(g, w), f"{name}: emulated CUDA {g.tolist()[:20]} vs CPU {w.tolist()[:20]}"
        assert torch.equal(g, r), f"{name}: emulated CUDA vs reference"


# (batch, branches): one tile; rows across tiles (2048 rows per tile at 1 branch, 682 at 3);
# branches across tiles (64 per tile, a partial second one); one row.
SHAPES = [(1, 1), (7, 3), (2100, 1), (1500, 3), (70, 70), (33, 130)]


@pytest.mark.parametrize("batch, n", SHAPES)
@pytest.mark.parametrize("kind, dtype", [("ids", torch.int64), ("ids", torch.int32), ("ids", torch.uint8)]
                         + [("mask", d) for d in MASK_DTYPES])
def test_plan_equals_cpu_and_reference(kind, dtype, batch, n):
    gen = torch.Generator().manual_seed(batch * 1000 + n)
    check_plan(gate_of(kind, dtype, batch, n, gen, "random"), n)


@pytest.mark.parametrize("pattern", ["clustered", "none", "all"])
@pytest.mark.parametrize("kind, dtype", [("ids", torch.int64), ("mask", torch.bool), ("mask", torch.float16)])
def test_plan_patterns(kind, dtype, pattern):
    gen = torch.Generator().manual_seed(3)
    for batch, n in [(1, 1), (300, 5), (90, 66)]:
        check_plan(gate_of(kind, dtype, batch, n, gen, pattern), n)


@pytest.mark.parametrize("kind, dtype", [("ids", torch.int64)] + [("mask", d) for d in MASK_DTYPES])
@pytest.mark.parametrize("grid_blocks, int32_entries", [(1, -1), (2, 0), (-1, 0)])
def test_plan_grid_stride_rounds_and_int64_counts(kind, dtype, grid_blocks, int32_entries):
    """A grid of 1 or 2 row blocks strides over 3 (1500 rows, 682 per tile); int32_entries=0
    counts in int64, as gates of more than 2^31 entries do."""
    gen = torch.Generator().manual_seed(11)
    with limits(grid_blocks, int32_entries):
        for batch, n in [(1500, 3), (130, 65)]:
            check_plan(gate_of(kind, dtype, batch, n, gen, "random"), n)


def test_plan_of_no_rows_launches_nothing():
    for gate in [torch.zeros(0, dtype=torch.long), torch.zeros(0, 4)]:
        got, want = run("plan", gate, 4), cpu.plan(gate, 4)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def bad_gates():
    ids = torch.randint(-1, 3, (2000,), generator=torch.Generator().manual_seed(5))
    ids[[777, 1500, 1999]] = torch.tensor([9, -5, 3])
    yield "ids", ids, 3
    yield "ids_int32", ids.int(), 3
    for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
        w = torch.rand(700, 7, generator=torch.Generator().manual_seed(6))
        w[234, 5], w[400, 0], w[699, 6] = float("inf"), float("nan"), float("-inf")
        yield str(dtype), w.to(dtype), 7
        w = torch.zeros(50, 70)
        w[49, 69] = float("nan")
        yield f"{dtype} last", w.to(dtype), 70


@pytest.mark.parametrize("name, gate, n", list(bad_gates()), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_gates_raise_what_the_cpu_raises(name, gate, n):
    want = cpu_error(lambda: cpu.plan(gate, n))
    assert want is not None
    for grid_blocks in [-1, 1]:
        with limits(grid_blocks):
            assert cpu_error(lambda: run("plan", gate, n)) == want


@pytest.mark.parametrize("kind, dtype", [("ids", torch.int64), ("mask", torch.float32)])
def test_plan_bits_do_not_depend_on_the_schedule(kind, dtype):
    gen = torch.Generator().manual_seed(8)
    gate = gate_of(kind, dtype, 700, 9, gen, "random")
    results = []
    for name in SCHEDULES:
        with schedule(name, seed=4):
            results.append(emu.plan(gate, 9))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
