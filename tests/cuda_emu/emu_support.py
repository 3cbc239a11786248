"""Shared code of the tests that run the CUDA kernels on the host (tests/cuda_emu/test_emu_*.py).

* ``emu``: the CUDA ops of csrc/cuda, run by the emulation on CPU tensors (the test library built by
  tests/cuda_emu/build.py); ``cpu``: the library's CPU kernels; ``reference``: the pure-PyTorch ops.
* ``run``: an emulated op with uninitialized memory filled (NaN, the largest integer), so that an
  output element no thread wrote shows.
* ``schedule`` / ``limits``: the emulation's thread schedule (tests/emu_hooks.py runs every kernel test
  under each of SUITE_SCHEDULES), and lowered grid and int32 limits that reach, with small inputs,
  the paths big inputs take.
* ``same_bits`` / ``assert_same_bits``, ``misaligned``, ``random_plan_gate``, ``ys_for``.

Importing this module skips the importing test module when the library is not built, unless
MASKEDBRANCH_CUDA_EMU_REQUIRED=1 (scripts/sanitize.sh sets it), where that is an error.
"""
import contextlib
import glob
import os

import pytest
import torch

import maskedbranch  # noqa: F401 - registers the CPU kernels (torch.ops.maskedbranch)
from maskedbranch import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SCHEDULES = ["parallel", "forward", "reverse", "shuffled"]
# Random interleavings, and the two orders that run one end of the block (or one warp) as far as it
# goes first: a missing barrier that only a long run of one group exposes shows in one of them.
SUITE_SCHEDULES = os.environ.get("MASKEDBRANCH_CUDA_EMU_SCHEDULES", "shuffled,forward,reverse").split(",")
_current = ["shuffled"]


def library_path():
    """MASKEDBRANCH_CUDA_EMU_LIB, else build.py's default folder for this torch (or None)."""
    path = os.environ.get("MASKEDBRANCH_CUDA_EMU_LIB")
    if path:
        return path
    folder = os.path.join(ROOT, "build", "cuda_emu", f"torch-{torch.__version__}")
    found = sorted(glob.glob(os.path.join(folder, "maskedbranch_cuda_emu*.so")))
    return found[0] if found else None


def _load():
    path = library_path()
    if path is None or not os.path.exists(path):
        why = (f"the CUDA emulation library is not built ({path or 'for torch ' + torch.__version__}): "
               "python tests/cuda_emu/build.py, or set MASKEDBRANCH_CUDA_EMU_LIB")
        if os.environ.get("MASKEDBRANCH_CUDA_EMU_REQUIRED") == "1":
            raise RuntimeError(why)
        pytest.skip(why, allow_module_level=True)
    torch.ops.load_library(path)
    return torch.ops.maskedbranch_cuda_emu


emu = _load()
cpu = torch.ops.maskedbranch


def vec_width(dtype):
    """Elements per 16-byte vector (device_rows.cuh)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def use_schedule(name):
    """The schedule a test runs under (seed 0: a test's interleavings repeat when it runs alone)."""
    _current[0] = name
    emu.set_schedule(name, 0)


@contextlib.contextmanager
def schedule(name, seed=0):
    """Another schedule inside a test."""
    emu.set_schedule(name, seed)
    try:
        yield
    finally:
        emu.set_schedule(_current[0], 0)


@contextlib.contextmanager
def limits(grid_blocks=-1, int32_plan_entries=-1):
    emu.set_limits(grid_blocks, int32_plan_entries)
    try:
        yield
    finally:
        emu.set_limits(-1, -1)


def run(op, *args):
    """emu.<op>(*args), with every tensor the op allocates filled with NaN / the largest integer."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return getattr(emu, op)(*args)
    finally:
        torch.use_deterministic_algorithms(before)


def _bits(t):
    t = t.contiguous()
    if t.dtype.is_floating_point:
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def same_bits(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(_bits(a), _bits(b)))


def assert_same_bits(got, want, what, signed_zeros=True):
    """Same dtype, shape, strides and bits; with signed_zeros=False, -0 and +0 count as one."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    assert got.stride() == want.stride(), f"{what}: strides {got.stride()} vs {want.stride()}"
    if not signed_zeros and got.dtype.is_floating_point:
        got, want = got + 0, want + 0  # -0 + 0 = +0; every other value, NaN included, is kept
    if not torch.equal(_bits(got), _bits(want)):
        bad = (_bits(got) != _bits(want)).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: bits differ at {bad}: {got[tuple(zip(*bad))] if bad else ''} vs "
                             f"{want[tuple(zip(*bad))] if bad else ''}")


def assert_equal_values(got, want, what):
    """Equal values (-0 == +0), NaN where the other has NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(want, nan=7.0)):
        diff = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: values differ at {diff}")


def misaligned(t):
    """A copy of t, same shape and (contiguous) strides, whose data starts one element past a
    16-byte boundary: still element-aligned, but not for the 16-byte vector path."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype)
    start = 1 if flat.data_ptr() % 16 == 0 else 0
    while (flat.data_ptr() + start * t.element_size()) % 16 == 0:
        start += 1
    out = flat[start:start + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


def random_plan_gate(kind, batch, n, gen, pattern="random"):
    """A gate of `kind` (ids, bool, float) whose live entries follow `pattern`: random; clustered
    (runs of rows to one branch, branches left empty); none; all."""
    if pattern == "none":
        if kind == "ids":
            return torch.full((batch,), -1)
        return torch.zeros(batch, n, dtype=torch.bool if kind == "bool" else torch.float32)
    if kind == "ids":
        if pattern == "all":
            return torch.randint(0, n, (batch,), generator=gen)
        if pattern == "clustered":
            runs = torch.randint(1, 9, (batch,), generator=gen).cumsum(0)
            ids = torch.bucketize(torch.arange(batch), runs) % max(1, (n + 1) // 2) * 2 % n
            return ids.masked_fill(torch.rand(batch, generator=gen) < 0.1, -1)
        return torch.randint(-1, n, (batch,), generator=gen)
    live = torch.rand(batch, n, generator=gen) < 0.5
    if pattern == "all":
        live[:] = True
    elif pattern == "clustered":
        live &= (torch.arange(n) % 3 == 0)[None, :]
        live[batch // 3: batch // 2] = False
    if kind == "bool":
        return live
    return torch.where(live, torch.rand(batch, n, generator=gen) + 0.25, torch.zeros(()))


def ys_for(plan, trailing, dtype, gen, integers=False):
    """One output per branch, offsets[i+1] - offsets[i] rows each, random normal (or small integers)."""
    counts = plan[0].diff().tolist()
    def draw(c):
        if integers:
            return torch.randint(-4, 5, (c, *trailing), generator=gen).to(dtype)
        return torch.randn(c, *trailing, generator=gen).to(dtype)
    return [draw(c) for c in counts]


def cpu_error(fn):
    """(type, message) of what fn raises (without the C++ backtrace), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared by the callers
        return type(e), str(e).split("\nException raised from")[0]
    return None


__all__ = ["emu", "cpu", "reference", "run", "schedule", "limits", "same_bits", "assert_same_bits",
           "assert_equal_values", "misaligned", "random_plan_gate", "ys_for", "vec_width", "cpu_error",
           "use_schedule", "DTYPES", "SCHEDULES", "SUITE_SCHEDULES"]
