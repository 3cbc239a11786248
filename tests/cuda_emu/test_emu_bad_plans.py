"""Hand-made plans (csrc/cuda/plan_asserts.cuh) on the host: every kernel that reads a row plan
(segment_sum_kernel, dot_rows_kernel at both row sizes, check_row_plan_kernel) stops with the
assert that names the bad argument, before it reads out of bounds (AddressSanitizer watches), and
a plan passes the device checks exactly when it passes the CPU's (random corruptions)."""
import pytest
import torch

from emu_support import cpu, cpu_error, limits, random_plan_gate, run, ys_for

GOOD = cpu.plan(torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), 3)


def corrupted(which):
    offsets, rows, row_offsets, row_branch, row_pos = (t.clone() for t in GOOD)
    if which == "offsets_start":
        row_offsets[0] = 1
    elif which == "offsets_descend":
        row_offsets[2] = row_offsets[3] + 1  # [0, 2, 5, 4, 6]
    elif which == "offsets_end":
        row_offsets[-1] -= 1
    elif which == "offsets_past_end":
        row_offsets[-1] += 1
    elif which == "branch_negative":
        row_branch[1] = -1
    elif which == "branch_too_big":
        row_branch[4] = 3
    elif which == "pos_other_branch":
        row_pos[0] = row_pos[-1]
    elif which == "pos_out_of_range":
        row_pos[2] = 1 << 40
    return offsets, rows, row_offsets, row_branch, row_pos


MESSAGES = {
    "offsets_start": r"row_offsets: (expected to start at 0|not ascending)",
    "offsets_descend": r"row_offsets: not ascending",
    "offsets_end": r"row_offsets: expected to end at the number of entries",
    "offsets_past_end": r"row_offsets: (not ascending|expected to end)",
    "branch_negative": r"row_branch: entry out of range",
    "branch_too_big": r"row_branch: entry out of range",
    "pos_other_branch": r"row_pos: entry outside its branch's rows",
    "pos_out_of_range": r"row_pos: entry outside its branch's rows",
}


class _Emulated:
    """The emulated ops under the names of torch.ops.maskedbranch."""

    def __getattr__(self, op):
        return lambda *args: run(op, *args)


def calls(plan, row_numel, op):
    """The op's call on the plan with branch outputs of row_numel elements."""
    gen = torch.Generator().manual_seed(0)
    ys = ys_for(GOOD, (row_numel,), torch.float32, gen)
    base = torch.randn(4, row_numel, generator=gen)
    if op == "combine":
        return lambda f: f.combine(base, ys, None, plan[2], plan[3], plan[4])
    return lambda f: f.combine_weights_backward(base, ys, plan[2], plan[3], plan[4])


@pytest.mark.parametrize("which", list(MESSAGES))
@pytest.mark.parametrize("op, row_numel", [("combine", 8), ("combine", 7), ("combine", 0),
                                           ("combine_weights_backward", 8),
                                           ("combine_weights_backward", 4 * 600),
                                           ("combine_weights_backward", 0)],
                         ids=["segment sum vector", "segment sum scalar", "check kernel",
                              "dot warp per row", "dot block per row", "dot check kernel"])
def test_bad_plans_assert_on_the_device_and_raise_on_the_cpu(which, op, row_numel):
    call = calls(corrupted(which), row_numel, op)
    assert cpu_error(lambda: call(torch.ops.maskedbranch))[0] in (ValueError, IndexError)
    with pytest.raises(RuntimeError, match="device-side assert triggered: " + MESSAGES[which]):
        call(_Emulated())


def random_corruption(plan, gen):
    """A plan with one value changed at random (often still valid)."""
    t = [p.clone() for p in plan]
    k = int(torch.randint(2, 5, (1,), generator=gen))
    if t[k].numel() == 0:
        return t
    i = int(torch.randint(0, t[k].numel(), (1,), generator=gen))
    t[k][i] += int(torch.randint(-3, 4, (1,), generator=gen))
    return t


@pytest.mark.parametrize("op, row_numel", [("combine", 4), ("combine", 0), ("combine_weights_backward", 4)])
def test_device_checks_accept_exactly_the_plans_the_cpu_accepts(op, row_numel):
    gen = torch.Generator().manual_seed(7)
    rejected = accepted = 0
    for trial in range(60):
        gate = random_plan_gate("float", int(torch.randint(1, 12, (1,), generator=gen)), 3, gen, "random")
        plan = random_corruption(cpu.plan(gate, 3), gen)
        ys = ys_for(plan, (row_numel,), torch.float32, gen)
        args = (plan[2], plan[3], plan[4])
        base = torch.randn(gate.shape[0], row_numel, generator=gen)
        if op == "combine":
            on_cpu = cpu_error(lambda: cpu.combine(base, ys, gate, *args))
            emulated = cpu_error(lambda: run("combine", base, ys, gate, *args))
        else:
            on_cpu = cpu_error(lambda: cpu.combine_weights_backward(base, ys, *args))
            emulated = cpu_error(lambda: run("combine_weights_backward", base, ys, *args))
        assert (on_cpu is None) == (emulated is None), f"trial {trial}: CPU {on_cpu}, emulated CUDA {emulated}"
        if emulated is not None:
            assert "device-side assert triggered" in emulated[1], emulated
            rejected += 1
        else:
            accepted += 1
    assert rejected > 10 and accepted > 10


@pytest.mark.parametrize("op", ["combine", "combine_weights_backward"])
def test_a_plan_for_no_rows_must_route_nothing(op):
    """B = 0 rows but one entry: one thread checks row_offsets[0] == 0 == number of entries."""
    ys = [torch.randn(1, 4), torch.empty(0, 4)]
    row_plan = (torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    base = torch.empty(0, 4)
    extra = (None,) if op == "combine" else ()
    assert cpu_error(lambda: getattr(cpu, op)(base, ys, *extra, *row_plan))[0] is ValueError
    expected = r"device-side assert triggered: row_offsets: expected to run from 0 to the number of entries"
    with pytest.raises(RuntimeError, match=expected):
        run(op, base, ys, *extra, *row_plan)


@pytest.mark.parametrize("row", [0, 256, 513, 599])
@pytest.mark.parametrize("row_numel", [0, 4], ids=["check kernel", "main kernel"])
@pytest.mark.parametrize("op", ["gather", "combine", "combine_weights_backward"])
def test_every_row_is_checked_in_grid_stride_rounds(op, row_numel, row):
    """600 rows, one entry each, and one block of 256 threads: rows past the first round (256 on)
    are checked by later rounds of the grid-stride loops; a bad entry there must assert too."""
    plan = [t.clone() for t in cpu.plan(torch.arange(600) % 3, 3)]
    x = torch.zeros(600, row_numel)
    ys = ys_for(plan, (row_numel,), torch.float32, torch.Generator().manual_seed(0))
    if op == "gather":
        plan[1][row] = 600
        call = lambda f: f.gather(x, plan[1], None, plan[0].diff().tolist())  # noqa: E731
    else:
        plan[3][row] = 7
        extra = (None,) if op == "combine" else ()
        call = lambda f: getattr(f, op)(x, ys, *extra, plan[2], plan[3], plan[4])  # noqa: E731
    assert cpu_error(lambda: call(cpu))[0] is IndexError
    with limits(grid_blocks=1), pytest.raises(RuntimeError, match="device-side assert triggered"):
        call(_Emulated())
