"""Benchmark suite of maskedbranch: ``python -m benchmarks [--smoke | --quick]`` (benchmarks/README.md).

Shared helpers: clocks and thread settings, interleaved timing (contenders round-robin within each
repetition, the order rotating), A/B chunks for per-call overheads, medians and paired ratios,
peak memory, equality checks, spawned process-group jobs, and the tables.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

# A clock per setting: wall clock when several threads work (what a user waits for), and the
# calling thread's CPU time with one thread (which other processes on a shared machine disturb
# far less; with one intra-op thread, forward and backward on CPU run on the calling thread).
CLOCKS: Dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def keep_freed_memory_mapped() -> bool:
    """glibc serves large blocks with mmap and returns them to the OS on free, so every large
    output would be page-faulted in again and CPU timings of memory-bound ops would measure page
    faults, not bandwidth. Keep freed memory mapped for this process (Linux/glibc only); returns
    whether that worked."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        no_mmap = libc.mallopt(m_mmap_max, 0)  # every block from the heap ...
        no_trim = libc.mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1))  # ... which is never trimmed
        return bool(no_mmap and no_trim)
    except (OSError, AttributeError):
        return False


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def settings(cfg) -> List[Tuple[Optional[int], str]]:
    """(threads, clock) pairs a comparison runs under: ``--threads`` on CPU (T > 1: wall clock,
    T = 1: the thread's CPU time); wall clock with synchronization on a GPU."""
    if cfg.device == "cuda":
        return [(None, "wall")]
    return [(t, "wall" if t > 1 else "cpu") for t in cfg.threads]


@contextlib.contextmanager
def threads(n: Optional[int]) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (None: unchanged)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run under ``torch.no_grad()``."""
    def call():
        with torch.no_grad():
            return fn()

    return call


def label(t: Optional[int], clock: str) -> str:
    return "GPU, wall" if t is None else f"{t} thread{'s' if t > 1 else ''}, {clock}"


def interleaved(fns: Dict[str, Callable[[], object]], reps: int, warmup: int, device, clock: str = "wall",
                before: Optional[Callable[[str, int], None]] = None) -> Dict[str, List[float]]:
    """Run every contender once per repetition, in an order that rotates; return the times.
    ``before(name, rep)`` runs untimed before each call (e.g. seeding, so that contenders draw
    the same masks in one repetition)."""
    now = CLOCKS[clock]
    names = list(fns)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for rep in range(warmup + reps):
        s = rep % len(names)
        for k in names[s:] + names[:s]:
            if before is not None:
                before(k, rep)
            sync(device)
            t0 = now()
            fns[k]()
            sync(device)
            if rep >= warmup:
                times[k].append(now() - t0)
    return times


def ab_chunks(a: Callable[[], object], b: Callable[[], object], calls: int, chunks: int, warmup: int, device,
              clock: str = "wall") -> Tuple[List[float], List[float]]:
    """Per-call times of ``a`` and ``b`` in interleaved chunks of ``calls`` calls each (A then B,
    B then A in the next chunk): the per-chunk differences ``a - b`` and ``b``'s per-call times.
    A difference taken chunk by chunk cancels the drift of the machine between chunks."""
    now = CLOCKS[clock]
    diffs, base = [], []
    for c in range(warmup + chunks):
        t = {}
        for name, fn in ((("a", a), ("b", b)) if c % 2 == 0 else (("b", b), ("a", a))):
            sync(device)
            t0 = now()
            for _ in range(calls):
                fn()
            sync(device)
            t[name] = (now() - t0) / calls
        if c >= warmup:
            diffs.append(t["a"] - t["b"])
            base.append(t["b"])
    return diffs, base


def med(v: Sequence[float]) -> float:
    return statistics.median(v)


def paired(times: Dict[str, List[float]], a: str, b: str) -> float:
    """Median over repetitions of the per-repetition ratio a / b (robust to drifting load)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def pooled(times: Dict[str, List[float]], a: str, b: str) -> float:
    """sum(a) / sum(b): the average cost over the repetitions (what random draws average to)."""
    return sum(times[a]) / sum(times[b])


def peak_memory(fn: Callable[[], object], device) -> int:
    """Peak bytes allocated by ``fn`` above the level before it (its result is dropped at the end)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    records.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for e in records:
        level += e.nbytes()
        peak = max(peak, level)
    return peak


# ----------------------------------------------------------------------------------------------
# Equality checks: contenders that should compute the same thing are compared before (or after)
# they are timed; a failed check fails the run (exit status 1).


def max_diff(a: Sequence[Optional[torch.Tensor]], b: Sequence[Optional[torch.Tensor]]) -> float:
    """Largest absolute difference between paired tensors (inf when one is None and the other not,
    or shapes differ)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            worst = max(worst, (x.detach().double() - y.detach().double()).abs().max().item())
    return worst


def rel_diff(a: Sequence[Optional[torch.Tensor]], b: Sequence[Optional[torch.Tensor]]) -> float:
    """Largest over the pairs of max |x - y| / max |x|: for tensors of very different scales."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = x.detach().abs().max().item() if x is not None and x.numel() else 0.0
        worst = max(worst, max_diff([x], [y]) / (scale or 1.0))
    return worst


def check(cfg, name: str, diff: float, tol: float = 0.0) -> bool:
    """Record that ``name`` holds (``diff <= tol``; tol 0: bitwise)."""
    ok = diff <= tol
    cfg.checks.append({"check": name, "max abs diff": diff, "tolerance": tol, "ok": ok})
    return ok


def note(cfg, text: str) -> None:
    """A line for the report's notes (skips and what they mean)."""
    cfg.notes.append(text)


# ----------------------------------------------------------------------------------------------
# Process-group jobs: ranks spawned as torchrun would start them, each writing its result.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, fn, job, port, path):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = job["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(job.get("threads", 1))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, job)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(result, f)
        dist.barrier()  # no collective in flight when the group goes away
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[[int, int, dict], dict], world: int, job: dict) -> dict:
    """``fn(rank, world, job)`` on ``world`` fresh processes in one process group (gloo on CPU,
    NCCL on GPUs); returns rank 0's result (JSON). ``fn`` must be a module-level function."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank_main, args=(world, fn, job, _free_port(), path), nprocs=world, join=True)
        with open(path) as f:
            return json.load(f)


# ----------------------------------------------------------------------------------------------
# Tables.


def table(title: str, columns: List[str], rows: List[list], notes: str = "") -> dict:
    return {"title": title, "columns": columns, "rows": rows, "notes": notes}


def fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(t: dict) -> str:
    lines = [f"### {t['title']}", ""]
    if t.get("command"):
        lines += [f"`{t['command']}`", ""]
    lines += ["| " + " | ".join(t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in t["rows"]]
    if t.get("notes"):
        lines += ["", t["notes"]]
    return "\n".join(lines) + "\n"
