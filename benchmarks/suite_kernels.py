"""The routing ops at the memory limit: bytes moved, GB/s, and the ratio to a clone of the same
bytes (a plain copy: what a memory-bound pass can hope for), at each ``--threads`` count (wall clock)
and at small (1 MiB), medium and large sizes of x ([B, 384] float32).

Two routings: top-1 over 4 branches (MaskedBranch; M = B entries) and drop path at 0.5 (one branch,
M ~ B / 2 kept rows, weight 1 / keep). The ops (``torch.ops.maskedbranch``), and the bytes counted
(R = bytes of a row; indices int64, weights float32; read once, written once):

* gather: M rows read and written, M row ids: 2MR + 8M;
* combine, no base (also gather's backward): M rows read, B rows written (rows with no entry are
  zero-filled), the row CSR (B + 1 offsets, M branches, M positions): (M + B)R + 8(B + 1) + 16M;
* gather with weights (combine's backward w.r.t. the branch outputs, drop path): 2MR + 8M + 4M;
* combine with base = the residual add ``x + y * 1/keep`` on the kept rows: (2B + M)R + 8(B + 1) + 16M + 4M;
* drop-path scale ``y * mask`` (timm's formula; aten's mul since the op left the library): 2BR + 4B.

Each op is interleaved with a clone of a tensor of half its byte count (clone reads and writes it)
and with the plain-PyTorch way to compute the same result; the ratio to clone is the median of
per-repetition time ratios (1.0: the op runs at copy bandwidth). Before timing, every op is
checked against its plain-PyTorch result.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

from typing import Callable, Dict, Tuple

import torch

import maskedbranch as mb

from . import check, interleaved, max_diff, med, note, paired, table, threads

D = 384
TARGET = 0.8  # issue 18: every routing op at >= 80% of clone bandwidth from 1 MiB up


def cases(x: torch.Tensor, g: torch.Generator) -> Dict[str, Tuple[Callable, int, str, Callable]]:
    """op name -> (op, bytes moved, plain-PyTorch name, plain-PyTorch op or None: the op is aten's)."""
    O = torch.ops.maskedbranch
    B, R, dev = x.shape[0], x.shape[1] * x.element_size(), x.device
    top1 = mb.make_plan(torch.randint(0, 4, (B,), generator=g), 4, dev)
    keep = torch.rand(B, generator=g) < 0.5
    drop = mb.make_plan(keep.long() - 1, 1, dev)  # 0: kept, -1: dropped
    ys4 = O.gather(x, top1.rows, None, top1.counts)
    ys1 = O.gather(x, drop.rows, None, drop.counts)
    packed4 = torch.cat(ys4)
    w = torch.full((B, 1), 2.0, device=dev)
    mask = (keep.float() * 2.0).view(B, 1).to(dev)
    M4, M1 = top1.num_entries, drop.num_entries
    csr = lambda m: 8 * (B + 1) + 16 * m  # noqa: E731 - row offsets, branches, positions
    return {
        "gather (top-1 of 4)": (
            lambda: O.gather(x, top1.rows, None, top1.counts), 2 * M4 * R + 8 * M4,
            "index_select", lambda: list(x.index_select(0, top1.rows).split(top1.counts))),
        "combine = gather backward (top-1 of 4)": (
            lambda: O.combine(None, ys4, None, top1.row_offsets, top1.row_branch, top1.row_pos), (M4 + B) * R + csr(M4),
            "zeros + index_add_", lambda: torch.zeros_like(x).index_add_(0, top1.rows, packed4)),
        "gather weighted = combine backward (drop path)": (
            lambda: O.gather(x, drop.rows, w, drop.counts), 2 * M1 * R + 12 * M1,
            "index_select * 2", lambda: [x.index_select(0, drop.rows) * 2.0]),
        "combine with base = residual add (drop path)": (
            lambda: O.combine(x, ys1, w, drop.row_offsets, drop.row_branch, drop.row_pos), (2 * B + M1) * R + csr(M1) + 4 * M1,
            "index_add(x, alpha=2)", lambda: torch.index_add(x, 0, drop.rows, ys1[0], alpha=2.0)),
        "drop-path scale y * mask (aten mul)": (lambda: x * mask, 2 * B * R + 4 * B, "-", None),
    }


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def run(cfg) -> list:
    device = torch.device(cfg.device)
    if device.type == "cuda" and not mb.WITH_CUDA:
        note(cfg, "kernels: skipped on cuda: this maskedbranch build has no CUDA kernels")
        return []
    sizes = {"smoke": [1], "quick": [1, 16, 64], "full": [1, 16, 128]}[cfg.size]
    reps, warmup = {"smoke": (3, 1), "quick": (9, 2), "full": (25, 3)}[cfg.size]
    counts = [None] if device.type == "cuda" else cfg.threads
    rows = []
    g = torch.Generator().manual_seed(0)
    # Checked once, at the smallest size: the ops against the plain-PyTorch results.
    x = torch.randn(sizes[0] * 2**20 // (4 * D), D, device=device)
    for name, (op, _, plain_name, plain) in cases(x, g).items():
        if plain is None:
            continue
        with torch.no_grad():
            check(cfg, f"kernels: {name} == {plain_name}", max_diff(_as_list(op()), _as_list(plain())), 1e-6)
    for t in counts:
        for mib in cfg.progress(sizes, desc=f"kernels ({t or 'GPU'} threads)"):
            x = torch.randn(mib * 2**20 // (4 * D), D, device=device)
            for name, (op, nbytes, plain_name, plain) in cases(x, g).items():
                buf = torch.empty(nbytes // 2 // x.element_size(), device=device)
                fns = {"op": op, "clone": buf.clone, **({"plain": plain} if plain else {})}
                with torch.no_grad(), threads(t):
                    times = interleaved(fns, reps, warmup, device, "wall")
                vs_clone = paired(times, "clone", "op")  # a bandwidth ratio: same bytes
                rows.append([f"{t} thread{'s' if t > 1 else ''}" if t else "GPU", mib, name, nbytes / 1e6,
                             nbytes / med(times["op"]) / 1e9, nbytes / med(times["clone"]) / 1e9, vs_clone,
                             vs_clone >= TARGET, plain_name, paired(times, "op", "plain") if plain else "-"])
    from .plots import kernels

    kernels(cfg.out / "kernels.png", rows)
    return [table(
        f"Routing ops: bytes moved, GB/s and the ratio to a clone of the same bytes ([B, {D}] float32, wall clock, "
        f"medians of {reps} interleaved repetitions)",
        ["threads", "MiB of x", "op", "MB moved", "GB/s", "clone GB/s (same bytes)", "op / clone*", f">= {TARGET}",
         "plain PyTorch", "op time / plain*"],
        rows,
        f"Target (issue 18): every routing op at >= {TARGET} of clone bandwidth from 1 MiB up. *Median of "
        "per-repetition ratios (op / clone: clone time / op time). combine's backward "
        "w.r.t. the branch outputs without weights (MaskedBranch's ids and int gates) is the unweighted gather; "
        "w.r.t. the base it passes the gradient through (no pass).",
    )]
