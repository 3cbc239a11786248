"""MaskedBranch against what users write by hand, forward + backward.

N MLP branches (d -> 4d -> d, GELU), top-1 routing drawn uniformly per repetition. Contenders:

* oracle    - each branch on its rows, already split into contiguous tensors (no routing at all);
* dense     - the 0/1-coefficient trick: every branch on every row, times a one-hot coefficient;
* hand skip - index_select -> branch -> index_add_ (in place into zeros), indices from the gate
              each call;
* masked    - MaskedBranch with an integer [B] gate;
* direct    - one branch on the whole batch, against MaskedBranch with an int gate.

Contenders are interleaved within each repetition (the order rotates), the timings are medians
over the repetitions, and the ratios are of medians. Run:

    python benchmarks/bench_masked_branch.py [--rows 8192] [--dim 256] [--branches 4] [--reps 15] [--threads T]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from maskedbranch import MaskedBranch


def mlp(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    n, rows, d = args.branches, args.rows, args.dim
    torch.manual_seed(0)
    model = MaskedBranch([mlp(d) for _ in range(n)]).to(device, dtype)
    branches = list(model.branches)
    params = list(model.parameters())
    x = torch.randn(rows, d, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(rows, d, device=device, dtype=dtype)

    def reset():
        x.grad = None
        for p in params:
            p.grad = None

    def oracle(ctx):
        ys = [br(xi) for br, xi in zip(branches, ctx["xs"])]
        torch.autograd.backward(ys, ctx["grads"])

    def dense(ctx):
        coef = ctx["onehot"]
        out = sum(coef[:, i, None] * br(x) for i, br in enumerate(branches))
        out.backward(grad_out)

    def hand_skip(ctx):
        gate = ctx["ids"]
        out = torch.zeros(rows, d, device=device, dtype=dtype)
        for i, br in enumerate(branches):
            r = (gate == i).nonzero().squeeze(1)
            if r.numel():
                out.index_add_(0, r, br(x.index_select(0, r)))
        out.backward(grad_out)

    def masked(ctx):
        model(x, ctx["ids_host"]).backward(grad_out)

    def direct(ctx):
        branches[ctx["k"]](x).backward(grad_out)

    def masked_int(ctx):
        model(x, ctx["k"]).backward(grad_out)

    contenders = {
        "oracle": oracle,
        "dense 0/1": dense,
        "hand skip": hand_skip,
        "masked": masked,
        "direct": direct,
        "masked int": masked_int,
    }
    times = {k: [] for k in contenders}

    g = torch.Generator().manual_seed(1)
    for rep in range(args.warmup + args.reps):
        ids_host = torch.randint(0, n, (rows,), generator=g)
        order = ids_host.argsort(stable=True)
        counts = torch.bincount(ids_host, minlength=n).tolist()
        ctx = {
            "ids_host": ids_host,  # the gate lives on the host: the plan ships without a sync
            "ids": ids_host.to(device),
            "onehot": torch.nn.functional.one_hot(ids_host, n).to(device, dtype),
            "xs": [t.detach().clone().requires_grad_(True) for t in x.detach()[order.to(device)].split(counts)],
            "grads": list(grad_out[order.to(device)].split(counts)),
            "k": rep % n,
        }
        names = list(contenders)
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            reset()
            sync(device)
            t0 = time.perf_counter()
            contenders[name](ctx)
            sync(device)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in times.items()}

    def paired(a: str, b: str) -> float:
        """Median over repetitions of the per-repetition ratio (robust to slow drifts in load)."""
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(
        f"MaskedBranch benchmark: {n} MLP branches ({d} -> {4 * d} -> {d}, GELU), {rows} rows, "
        f"uniform top-1 routing, forward + backward, {args.dtype} on {device}"
        + (f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else "")
        + f", torch {torch.__version__}; {args.reps} interleaved repetitions"
        + (f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs" if hasattr(os, "getloadavg") else "")
    )
    print()
    print("| contender | median ms | vs oracle | vs hand skip | vs direct |")
    print("|---|---:|---:|---:|---:|")
    for k in ("oracle", "dense 0/1", "hand skip", "masked"):
        print(f"| {k} | {med[k] * 1e3:.1f} | {med[k] / med['oracle']:.3f} | {med[k] / med['hand skip']:.3f} | |")
    for k in ("direct", "masked int"):
        print(f"| {k} | {med[k] * 1e3:.1f} | | | {med[k] / med['direct']:.3f} |")
    print()
    print("ratios above: of medians. Medians of per-repetition ratios, with the targets:")
    checks = [
        ("masked / oracle", paired("masked", "oracle"), 1.05),
        ("masked / hand skip", paired("masked", "hand skip"), 0.97),
        ("masked int / direct", paired("masked int", "direct"), 1.02),
        ("dense 0/1 / oracle", paired("dense 0/1", "oracle"), None),
        ("hand skip / oracle", paired("hand skip", "oracle"), None),
    ]
    for name, r, target in checks:
        verdict = "" if target is None else f"  (target <= {target}: {'met' if r <= target else 'NOT met'})"
        print(f"  {name:20s} {r:.3f}{verdict}")


if __name__ == "__main__":
    main()
