"""Per-call overhead of MaskedBranch's int gate over calling the branch directly (issue 13 budget:
at most 15 us on CPU).

A MaskedBranch of 4 small branches (Linear(d, d), 16 rows, so that the branch itself costs little)
is called as ``layer(x, k)`` (A) and ``layer[k](x)`` (B), in interleaved chunks of calls (A then B,
then B then A, ...); the overhead is the median over chunks of the per-call difference A - B, which
cancels the machine's drift between chunks. Modes:

* one process: forward under ``torch.no_grad()``, forward with autograd on (x requires grad), and
  forward+backward;
* under DDP, 1 rank (gloo on CPU): the forward with autograd on inside a DDP forward (a chain of
  calls per DDP forward, DDP's own cost cancels in the difference). Here the layer ties the other
  branches' parameters into the graph (a copy of the output), which is part of its overhead; what
  the tie costs in the backward and the reducer shows in the DDP suites.

At every ``--threads`` setting (2 threads wall clock, 1 thread CPU time by default). Before timing,
A's output is checked to equal B's bitwise.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import statistics
from typing import List

import torch
from torch import nn

from maskedbranch import MaskedBranch

from . import ab_chunks, check, label, max_diff, no_grad, settings, spawn_ranks, table, threads

BUDGET_US = 15.0
D, ROWS, CHAIN = 64, 16, 8


def _layer(device) -> MaskedBranch:
    torch.manual_seed(0)
    return MaskedBranch([nn.Linear(D, D) for _ in range(4)]).to(device)


class Chain(nn.Module):
    """CHAIN routed calls per forward: through the layer (``direct=False``) or its branch."""

    def __init__(self, layer: MaskedBranch):
        super().__init__()
        self.layer = layer
        self.direct = list(layer)  # a plain list: no ModuleList indexing in the direct calls

    def forward(self, x, k: int, direct: bool):
        for _ in range(CHAIN):
            x = self.direct[k](x) if direct else self.layer(x, k)
        return x


def _measure(a, b, sizes: dict, device, clock: str, per: int = 1) -> List[float]:
    diffs, base = ab_chunks(a, b, sizes["calls"], sizes["chunks"], sizes["warmup"], device, clock)
    us = [d / per * 1e6 for d in diffs]
    q = statistics.quantiles(us, n=4) if len(us) > 1 else [us[0]] * 3
    return [statistics.median(base) / per * 1e6, statistics.median(us), q[0], q[2]]


def one_process(cfg, sizes: dict, t, clock: str) -> List[list]:
    device = torch.device(cfg.device)
    layer = _layer(device)
    x = torch.randn(ROWS, D, device=device, requires_grad=True)
    k = 2
    branch = layer[k]
    modes = {
        "fwd, no grad": (no_grad(lambda: layer(x, k)), no_grad(lambda: branch(x))),
        "fwd, autograd": (lambda: layer(x, k), lambda: branch(x)),
        "fwd+bwd": (lambda: layer(x, k).sum().backward(), lambda: branch(x).sum().backward()),
    }
    rows = []
    with threads(t):
        for mode, (a, b) in modes.items():
            rows.append(["one process", mode, label(t, clock)] + _measure(a, b, sizes, device, clock))
    return rows


def _ddp_job(rank: int, world: int, job: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", rank) if job["device"] == "cuda" else torch.device("cpu")
    ddp = DDP(Chain(_layer(device)), device_ids=[rank] if device.type == "cuda" else None)
    x = torch.randn(ROWS, D, device=device, requires_grad=True)
    same = max_diff([ddp(x, 1, False)], [ddp(x, 1, True)])
    rows = []
    for t, clock in job["settings"]:
        with threads(t):
            m = _measure(lambda: ddp(x, 1, False), lambda: ddp(x, 1, True), job["sizes"], device, clock, per=CHAIN)
        rows.append([f"DDP, {world} rank", "fwd, autograd (in DDP's forward)", label(t, clock)] + m)
    return {"rows": rows, "same": same}


def run(cfg) -> list:
    sizes = {"smoke": dict(calls=20, chunks=4, warmup=1), "quick": dict(calls=100, chunks=15, warmup=2),
             "full": dict(calls=200, chunks=41, warmup=3)}[cfg.size]
    layer = _layer(cfg.device)
    x = torch.randn(ROWS, D, device=cfg.device)
    check(cfg, "overhead: layer(x, k) == layer[k](x)", max_diff([layer(x, 3)], [layer[3](x)]))
    rows = []
    for t, clock in settings(cfg):
        rows += one_process(cfg, sizes, t, clock)
    ddp_sizes = dict(sizes, calls=max(sizes["calls"] // CHAIN, 2))
    res = spawn_ranks(_ddp_job, 1, dict(device=cfg.device, settings=settings(cfg), sizes=ddp_sizes))
    check(cfg, "overhead: under DDP, layer(x, k) == layer[k](x)", res["same"])
    rows += res["rows"]
    rows = [r + [r[4] <= BUDGET_US] for r in rows]
    return [table(
        f"Int gate: per-call overhead of MaskedBranch(x, k) over calling branch k directly (Linear({D}, {D}), "
        f"{ROWS} rows; medians over {sizes['chunks']} interleaved A/B chunks of {sizes['calls']} calls, DDP: "
        f"{ddp_sizes['calls']} forwards of {CHAIN} calls)",
        ["where", "mode", "setting", "direct us", "overhead us*", "q1 us", "q3 us", f"<= {BUDGET_US:.0f} us"],
        rows,
        f"Budget (issue 13): overhead <= {BUDGET_US:.0f} us per call on CPU. *Median over chunks of the per-call "
        "difference (chunks alternate A-B and B-A); q1 / q3: its quartiles over chunks. direct: the per-call time "
        f"of calling the branch (DDP: a DDP forward of {CHAIN} direct calls, divided by {CHAIN}).",
    )]
