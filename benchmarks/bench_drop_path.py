"""DropPath on a transformer MLP residual branch: maskedbranch against the alternatives.

    python benchmarks/bench_drop_path.py                  # CPU, the default sizes
    python benchmarks/bench_drop_path.py --device cuda    # also checks: no host-device sync

Contenders, each timed forward + backward of ``out = x + drop_path(branch(x))`` with
``branch = LayerNorm -> Linear(C, H) -> GELU -> Linear(H, C)``:

* ``timm``: timm's way: the branch on every row, then multiply by the scaled mask and add;
* ``hand``: a hand-written skip: ``index_select`` the kept rows, run the branch, scale,
  ``index_add`` back into x (mask drawn on the host too);
* ``ours``: ``maskedbranch.drop_add_residual`` (gather, branch on the kept rows, fused scaled add).

Method. For every mask draw (a CPU generator seeded per draw, the same draw for every
contender) the three contenders run back to back in a shuffled order, so that they see the same
kept count and the same machine state (``--repeats K``: K shuffled rounds per draw, the fastest
run of each contender counts); ratios are taken per draw against ``timm`` (or ``hand``)
and the table shows their median over the draws (and the ratio of the summed times, i.e. the
average cost over the draws). ``eval`` times a no-grad forward in eval mode. ``--clock cpu``
measures the process's CPU time instead of elapsed time, for machines shared with other work.

Peak memory: on CPU, the profiler's allocation records (``torch.profiler`` with
``profile_memory=True``: one record per allocation and per free in the CPU allocator, with its
size and time); we replay them in time order and report the highest running total above the
level before the forward, i.e. the peak of the tensors allocated by forward + backward
(activations, saved tensors, gradients of x and of the parameters; x and the parameters
themselves are excluded since all contenders share them). On CUDA: ``max_memory_allocated``
after ``reset_peak_memory_stats``, minus the memory allocated before.
"""
from __future__ import annotations

import argparse
import contextlib
import platform
import random
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn

import maskedbranch as mb

if __package__:
    from . import peak_memory
else:  # run as a file: benchmarks/ is on sys.path, the folder that holds the package is not
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from benchmarks import peak_memory

TARGETS_VS_TIMM = {0.5: 0.55, 0.25: 0.80, 0.1: 0.93, 0.0: 1.01}
TARGET_VS_HAND = 0.97
TARGET_MEMORY = 0.6  # peak memory at drop_prob 0.5, vs timm


def make_branch(c: int, hidden: int, device, dtype) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(c), nn.Linear(c, hidden), nn.GELU(), nn.Linear(hidden, c)).to(device, dtype)


def contenders(branch: nn.Module) -> Dict[str, Callable]:
    def timm_way(x, p, g):
        y = branch(x)
        keep = 1.0 - p
        if p == 0.0:  # timm's drop_path returns its input at drop_prob 0
            return x + y
        mask = torch.empty(x.shape[0], dtype=y.dtype).bernoulli_(keep, generator=g)
        if keep > 0.0:
            mask.div_(keep)
        mask = mask.to(x.device, non_blocking=True)
        return x + y * mask.view(-1, *([1] * (y.dim() - 1)))

    def hand(x, p, g):
        keep = 1.0 - p
        mask = torch.empty(x.shape[0]).bernoulli_(keep, generator=g)
        idx = mask.nonzero().flatten().to(x.device, non_blocking=True)
        y = branch(x.index_select(0, idx))
        if keep > 0.0:
            y = y * (1.0 / keep)
        return x.index_add(0, idx, y)

    def ours(x, p, g):
        return mb.drop_add_residual(x, branch, p, True, generator=g)

    return {"timm": timm_way, "hand": hand, "ours": ours}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def no_sync_allowed(device, name):
    if device.type == "cuda" and name == "ours":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        yield


CLOCK = time.perf_counter


def step(fn, name, x, branch, p, seed, device, grad_out):
    x.grad = None
    branch.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(seed)
    sync(device)
    t0 = CLOCK()
    with no_sync_allowed(device, name):
        out = fn(x, p, g)
        out.backward(grad_out)
    sync(device)
    return CLOCK() - t0


def time_training(fns, x, branch, p, draws, warmup, repeats, device, grad_out, rng) -> Dict[str, List[float]]:
    """Per draw: every contender ``repeats`` times, interleaved in shuffled rounds; the fastest."""
    times = {name: [] for name in fns}
    for i in range(warmup + draws):
        best = {name: float("inf") for name in fns}
        for _ in range(repeats):
            order = list(fns)
            rng.shuffle(order)
            for name in order:
                best[name] = min(best[name], step(fns[name], name, x, branch, p, 1000 + i, device, grad_out))
        if i >= warmup:
            for name in fns:
                times[name].append(best[name])
    return times


def time_eval(x, branch, draws, warmup, repeats, device, rng) -> Dict[str, List[float]]:
    def timm_eval():
        return x + branch(x)  # timm's drop_path is the identity in eval

    def ours_eval():
        return mb.drop_add_residual(x, branch, 0.5, False)

    fns = {"timm": timm_eval, "ours": ours_eval}
    times = {name: [] for name in fns}
    branch.eval()
    with torch.no_grad():
        for i in range(warmup + draws):
            best = {name: float("inf") for name in fns}
            for _ in range(repeats):
                order = list(fns)
                rng.shuffle(order)
                for name in order:
                    sync(device)
                    t0 = CLOCK()
                    with no_sync_allowed(device, name):
                        fns[name]()
                    sync(device)
                    best[name] = min(best[name], CLOCK() - t0)
            if i >= warmup:
                for name in fns:
                    times[name].append(best[name])
    branch.train()
    return times


def peak_bytes(fn, name, x, branch, p, seed, device, grad_out) -> int:
    x.grad = None
    branch.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(seed)

    def run():
        with no_sync_allowed(device, name):
            out = fn(x, p, g)
            out.backward(grad_out)
        return out

    return peak_memory(run, device)


def paired(times, name, ref):
    return statistics.median(a / b for a, b in zip(times[name], times[ref]))


def total_ratio(times, name, ref):
    return sum(times[name]) / sum(times[ref])


def mark(ok: bool) -> str:
    return "ok" if ok else "MISS"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=197)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--probs", default="0.5,0.25,0.1,0.0")
    ap.add_argument("--draws", type=int, default=20, help="mask draws per drop_prob (timed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per contender and draw, the fastest counts (>1 on busy machines)"
    )
    ap.add_argument("--memory-draws", type=int, default=5, help="mask draws for the peak memory (median)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: elapsed time; cpu: this process's CPU time (all threads), which other processes "
        "on a busy machine disturb far less (set OMP_WAIT_POLICY=PASSIVE so that idle threads don't spin)",
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    branch = make_branch(args.dim, args.hidden, device, dtype)
    x = torch.randn(args.batch, args.tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn_like(x)
    fns = contenders(branch)
    probs = [float(p) for p in args.probs.split(",")]

    print(
        f"# DropPath benchmark: x [{args.batch}, {args.tokens}, {args.dim}] {args.dtype}, MLP hidden "
        f"{args.hidden} (LayerNorm, GELU), forward + backward\n"
        f"# torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f" ({platform.processor() or platform.machine()})")
        + f", {torch.get_num_threads()} threads, {args.clock} clock, {args.draws} mask draws per row"
        + (f" (fastest of {args.repeats} runs each)" if args.repeats > 1 else "")
        + ", medians of per-draw ratios\n"
    )
    print("| drop_prob | timm ms | hand ms | ours ms | ours/timm | (mean) | target | hand/timm | ours/hand | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in probs:
        times = time_training(fns, x, branch, p, args.draws, args.warmup, args.repeats, device, grad_out, rng)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        r_timm = paired(times, "ours", "timm")
        r_hand = paired(times, "ours", "hand")
        target = TARGETS_VS_TIMM.get(p)
        target_s = f"<= {target:.2f} {mark(r_timm <= target)}" if target is not None else "-"
        print(
            f"| {p:g} | {ms['timm']:.1f} | {ms['hand']:.1f} | {ms['ours']:.1f} | {r_timm:.3f} | "
            f"{total_ratio(times, 'ours', 'timm'):.3f} | {target_s} | {paired(times, 'hand', 'timm'):.3f} | "
            f"{r_hand:.3f} | <= {TARGET_VS_HAND:.2f} {mark(r_hand <= TARGET_VS_HAND)} |"
        )
    times = time_eval(x, branch, args.draws, args.warmup, args.repeats, device, rng)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    r = paired(times, "ours", "timm")
    print(
        f"| eval (no grad) | {ms['timm']:.1f} | - | {ms['ours']:.1f} | {r:.3f} | "
        f"{total_ratio(times, 'ours', 'timm'):.3f} | <= 1.01 {mark(r <= 1.01)} | - | - | - |"
    )

    p = 0.5
    peaks = {name: [] for name in fns}
    for i in range(args.memory_draws):
        for name, fn in fns.items():
            peaks[name].append(peak_bytes(fn, name, x, branch, p, 5000 + i, device, grad_out))
    mib = {k: statistics.median(v) / 2**20 for k, v in peaks.items()}
    ratio = mib["ours"] / mib["timm"]
    print(
        f"\nPeak memory of forward + backward at drop_prob {p} (median of {args.memory_draws} draws, "
        f"{'max_memory_allocated' if device.type == 'cuda' else 'profiler allocation records'}):\n"
    )
    print("| timm MiB | hand MiB | ours MiB | ours/timm | target |")
    print("|---|---|---|---|---|")
    print(
        f"| {mib['timm']:.1f} | {mib['hand']:.1f} | {mib['ours']:.1f} | {ratio:.3f} | "
        f"<= {TARGET_MEMORY} {mark(ratio <= TARGET_MEMORY)} |"
    )


if __name__ == "__main__":
    main()
