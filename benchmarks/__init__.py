"""Benchmark suite of maskedbranch: ``python -m benchmarks [--quick]`` (see benchmarks/README.md).

Shared helpers: interleaved timing (contenders round-robin within each repetition, the order
rotating), medians, peak memory (profiler allocation records on CPU, max_memory_allocated on CUDA).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch


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


def interleaved(fns: Dict[str, Callable[[], object]], reps: int, warmup: int, device) -> Dict[str, List[float]]:
    """Run every contender once per repetition, in an order that rotates; return the times."""
    names = list(fns)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for rep in range(warmup + reps):
        s = rep % len(names)
        for k in names[s:] + names[:s]:
            sync(device)
            t0 = time.perf_counter()
            fns[k]()
            sync(device)
            if rep >= warmup:
                times[k].append(time.perf_counter() - t0)
    return times


def med(v: List[float]) -> float:
    return statistics.median(v)


def paired(times: Dict[str, List[float]], a: str, b: str) -> float:
    """Median over repetitions of the per-repetition ratio a / b (robust to drifting load)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


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


def table(title: str, columns: List[str], rows: List[list], notes: str = "") -> dict:
    return {"title": title, "columns": columns, "rows": rows, "notes": notes}


def fmt(v) -> str:
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
