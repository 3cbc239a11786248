"""The emulation itself (cuda_emulation.h): barriers, shuffles, shared memory, asserts, launch limits
and schedules, shown with the small kernels of selftest_kernels.cpp; and the test library's op
schemas against the real library's."""
import os
import subprocess
import sys

import pytest
import torch

from emu_support import SCHEDULES, cpu, emu, library_path, schedule

POISON = int.from_bytes(b"\xa5" * 8, "little", signed=True)


def selftest(name, n=256, dtype=torch.int64):
    out = torch.zeros(n, dtype=dtype)
    emu.selftest(name, out)
    return out


@pytest.mark.parametrize("op", ["plan", "gather", "combine", "combine_weights_backward", "pick", "pick_backward", "put_"])
def test_schemas_equal_the_library_ones(op):
    real = str(getattr(cpu, op).default._schema)
    emulated = str(getattr(emu, op).default._schema)
    assert emulated.replace("maskedbranch_cuda_emu::", "maskedbranch::") == real


@pytest.mark.parametrize("name", SCHEDULES)
def test_barrier_and_shared_memory_per_block(name):
    with schedule(name):
        out = selftest("neighbour", 128)
    t = torch.arange(64)
    assert out.tolist() == torch.cat([(t + 1) % 64, 100 + (t + 1) % 64]).tolist()


@pytest.mark.parametrize("name", ["forward", "reverse", "shuffled"])
def test_a_missing_barrier_reads_poison(name):
    with schedule(name):
        out = selftest("missing_barrier", 128)
    assert (out == POISON).any(), "every read found its value although nothing ordered it after the write"


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("case, message", [
    ("skipped_barrier", r"__syncthreads|returned"),
    ("divergent_barriers", r"reached __syncthreads at tests/cuda_emu/selftest_kernels.cpp:\d+ while other threads"),
    ("partial_mask", r"mask other than 0xffffffff"),
    ("lane_returns", r"returned while lanes of its warp wait at a shuffle|after lanes of its warp returned"),
    ("shuffle_vs_barrier", r"deadlock: \d+ thread\(s\) wait at __syncthreads .* at a warp shuffle \(warp 0"),
    ("assert", r"assert_kernel, block \(1,0,0\), thread \(3,1,0\): device-side assert triggered: selftest: the assert"),
    ("too_much_shared", r"more than 48 KiB of static shared memory"),
    ("too_many_threads", r"invalid configuration argument \(grid \(1,1,1\), block \(1025,1,1\)\)"),
    ("grid_too_tall", r"invalid configuration argument"),
])
def test_wrong_device_code_is_reported(name, case, message):
    with schedule(name), pytest.raises(RuntimeError, match=message):
        selftest(case)
    # ...and the next launch runs normally.
    with schedule(name):
        assert selftest("neighbour", 128)[:3].tolist() == [1, 2, 3]


def test_a_skipped_barrier_names_the_waiting_threads():
    expected = r"thread \(5,0,0\): returned while 5 thread\(s\) wait at __syncthreads"
    with schedule("forward"), pytest.raises(RuntimeError, match=expected):
        selftest("skipped_barrier")


def expected_shuffles():
    out = []
    for t in range(64):
        lane, v = t % 32, [10 * u for u in range(64)]
        down = v[t + 3] if lane + 3 < 32 else v[t]
        up = v[t - 2] if lane >= 2 else v[t]
        xor = v[t - lane + (lane ^ 5)]
        idx = v[t - lane + 7]
        down8 = v[t + 3] if lane % 8 + 3 < 8 else v[t]
        out += [down, up, xor, idx, down8]
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_shuffles_follow_cuda_rules(name):
    with schedule(name):
        assert selftest("shuffles", 320).tolist() == expected_shuffles()
        assert selftest("warp_sum", 2, torch.float64).tolist() == [sum(range(1, 33)), sum(range(33, 65))]


def test_blocks_of_1024_threads():
    assert selftest("big_block", 1024).tolist() == list(range(1023, -1, -1))


def test_schedules_set_the_order_threads_run_in():
    def order(name, seed=0):
        with schedule(name, seed):
            out = selftest("order", 128)
        return out[:64].tolist(), out[64:].tolist()
    assert order("forward") == (list(range(64)), list(range(64)))
    assert order("reverse") == (list(range(63, -1, -1)), list(range(63, -1, -1)))
    first, second = order("shuffled", 1)
    assert sorted(first) == list(range(64)) and sorted(second) == list(range(64)) and first != second
    assert order("shuffled", 1) == (first, second), "a seed gives one interleaving"
    assert order("shuffled", 2) != (first, second)


@pytest.mark.skipif(os.environ.get("MASKEDBRANCH_CUDA_EMU_SANITIZED") != "1", reason="needs the sanitized build")
@pytest.mark.parametrize("case, report", [("shared_overflow", "heap-buffer-overflow"),
                                          ("global_overflow", "heap-buffer-overflow")])
def test_out_of_bounds_accesses_in_kernels_are_caught_by_asan(case, report):
    code = (f"import torch; torch.ops.load_library({library_path()!r}); "
            f"torch.ops.maskedbranch_cuda_emu.selftest({case!r}, torch.zeros(64, dtype=torch.long))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "AddressSanitizer" in done.stderr and report in done.stderr, done.stderr[-2000:]
