"""Per-call overhead of MaskedBranch's int gate over calling the branch directly (issue 13 budget:
at most 15 us on CPU).

A MaskedBranch of 4 small branches (Linear(d, d), 16 rows, so that the branch itself costs little)
is called as ``layer(x, k)`` (A) and ``layer[k](x)`` (B), in interleaved chunks of calls (A then B,
then B then A, ...); the overhead is the median over chunks of the per-call difference A - B, which
cancels the machine's drift between chunks. Modes:

* one process: forward under ``torch.no_grad()``, forward with autograd on (x requires grad), and
  forward+backward;
* under DDP, 1 rank (gloo on CPU): the forward with autograd on inside a DDP forward (a chain of
  calls per DDP forward, DDP's own cost cancels in the difference);
* in a training loop, as users train: a model of ``LOOP_LAYERS`` routed residual layers whose
  path changes every iteration, each iteration a forward, a backward and an AdamW step. In one
  process against the same if/else model; under DDP (1 and 2 gloo ranks) against the if/else model
  under ``find_unused_parameters=True``, the flag MaskedBranch replaces. The per-call figures are
  the differences of each phase (forward, backward, optimizer step) and of the whole step divided
  by the routed calls per forward (where the step's overhead goes);
  both contenders' parameters must be equal bit for bit after the timed iterations.

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
LOOP_BUDGET_US = {"one process": 5.0, "DDP": 10.0}  # issue 29: a routed call in a training loop
# issue 41, DDP with 2 ranks: the step against the flag's, and the forward's overhead per routed call
LOOP_BUDGET_RATIO, LOOP_BUDGET_FWD_US = 0.95, 10.0
D, ROWS, CHAIN = 64, 16, 8
LOOP_LAYERS, LOOP_N, LOOP_D, LOOP_H, LOOP_ROWS = 32, 4, 32, 64, 16


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


class LoopNet(nn.Module):
    """``LOOP_LAYERS`` residual layers of ``LOOP_N`` MLP branches, one branch per layer and
    iteration: ``layer(x, k)`` (MaskedBranch) or ``layer[k](x)`` (the if/else model)."""

    def __init__(self, masked: bool):
        super().__init__()
        torch.manual_seed(0)
        self.masked = masked
        mlp = lambda: nn.Sequential(nn.Linear(LOOP_D, LOOP_H), nn.GELU(), nn.Linear(LOOP_H, LOOP_D))  # noqa: E731
        self.layers = nn.ModuleList(
            (MaskedBranch if masked else nn.ModuleList)([mlp() for _ in range(LOOP_N)]) for _ in range(LOOP_LAYERS))

    def forward(self, x, path):
        for layer, k in zip(self.layers, path):
            x = x + (layer(x, k) if self.masked else layer[k](x))
        return x


def _loop_job(rank: int, world: int, job: dict) -> dict:
    """Interleaved training iterations of MaskedBranch and if/else (under DDP: if/else with
    find_unused_parameters=True); per-call differences of the forward and of the step."""
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = job["ddp"]
    contenders = {}
    for name, masked in (("masked", True), ("if/else", False)):
        model = LoopNet(masked)
        wrapped = DDP(model, find_unused_parameters=not masked) if ddp else model
        contenders[name] = (wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    g = torch.Generator().manual_seed(rank)
    times = {k: {"fwd": [], "bwd": [], "opt": [], "step": []} for k in contenders}
    with threads(job["threads"]):
        for it in range(job["warmup"] + job["iterations"]):
            x = torch.randn(LOOP_ROWS, LOOP_D, generator=g)
            path = torch.randint(0, LOOP_N, (LOOP_LAYERS,), generator=g).tolist()
            names = list(contenders) if it % 2 == 0 else list(reversed(contenders))
            for name in names:
                model, opt = contenders[name]
                if ddp:
                    torch.distributed.barrier()
                t0 = time.perf_counter()
                out = model(x, path)
                t1 = time.perf_counter()
                out.square().mean().backward()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                if it >= job["warmup"]:
                    for phase, t in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2), ("step", t3 - t0)):
                        times[name][phase].append(t)
    same = max_diff([p.detach() for p in contenders["masked"][1].param_groups[0]["params"]],
                    [p.detach() for p in contenders["if/else"][1].param_groups[0]["params"]])

    def per_call(phase):
        d = [(a - b) / LOOP_LAYERS * 1e6 for a, b in zip(times["masked"][phase], times["if/else"][phase])]
        return statistics.median(d)

    ratio = statistics.median(a / b for a, b in zip(times["masked"]["step"], times["if/else"]["step"]))
    where = f"DDP, {world} rank{'s' if world > 1 else ''}" if ddp else "one process"
    ref = "if/else + find_unused_parameters=True" if ddp else "if/else"
    return {"row": [where, f"training loop, against {ref}", label(job["threads"], "wall"),
                    statistics.median(times["if/else"]["step"]) * 1e3, per_call("fwd"), per_call("bwd"), per_call("opt"),
                    per_call("step"), ratio],
            "same": same}


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
    loop_sizes = {"smoke": (3, 6), "quick": (20, 120), "full": (30, 300)}[cfg.size]
    loop_rows = []
    if cfg.device == "cpu":
        for t, _clock in settings(cfg):
            for ddp, world in ((False, 1), (True, 1), (True, 2)):
                # (the ranks share the machine's threads, one each at --threads 2, as the DDP suites run)
                job = dict(ddp=ddp, threads=max(1, t // world) if t else t, warmup=loop_sizes[0],
                           iterations=loop_sizes[1], device=cfg.device)
                res = spawn_ranks(_loop_job, world, job) if ddp else _loop_job(0, 1, job)
                check(cfg, f"overhead: training loop ({res['row'][0]}): parameters equal to if/else's", res["same"])
                budget = LOOP_BUDGET_US["DDP" if ddp else "one process"]
                fwd_ratio = (res["row"][4] <= LOOP_BUDGET_FWD_US and res["row"][8] <= LOOP_BUDGET_RATIO) if world > 1 else "-"
                loop_rows.append(res["row"] + [res["row"][7] <= budget, fwd_ratio])
    tables = [table(
        f"Int gate: per-call overhead of MaskedBranch(x, k) over calling branch k directly (Linear({D}, {D}), "
        f"{ROWS} rows; medians over {sizes['chunks']} interleaved A/B chunks of {sizes['calls']} calls, DDP: "
        f"{ddp_sizes['calls']} forwards of {CHAIN} calls)",
        ["where", "mode", "setting", "direct us", "overhead us*", "q1 us", "q3 us", f"<= {BUDGET_US:.0f} us"],
        rows,
        f"Budget (issue 13): overhead <= {BUDGET_US:.0f} us per call on CPU. *Median over chunks of the per-call "
        "difference (chunks alternate A-B and B-A); q1 / q3: its quartiles over chunks. direct: the per-call time "
        f"of calling the branch (DDP: a DDP forward of {CHAIN} direct calls, divided by {CHAIN}).",
    )]
    if loop_rows:
        tables.append(table(
            f"A routed call in a training loop: {LOOP_LAYERS} routed layers of {LOOP_N} MLP branches "
            f"({LOOP_D} -> {LOOP_H} -> {LOOP_D}, {LOOP_ROWS} rows), a new path every iteration, forward + backward + "
            f"AdamW step per iteration ({loop_sizes[1]} interleaved iterations)",
            ["where", "against", "setting", "reference step ms", "fwd us per call*", "bwd us per call*",
             "optimizer us per call*", "step us per call*", "step ratio", "step within budget",
             "fwd and ratio within budget"],
            loop_rows,
            "*Median over iterations of (MaskedBranch - reference) / routed calls per forward, per phase: the forward "
            "(under DDP with the wrapper's hooks: the records turned into bit sets, the usage launch, the tie of the "
            "one parameter DDP keeps), the backward (under DDP: the averaging of the routed parameters at its end, "
            "against DDP's buckets and graph walk), the optimizer step with zero_grad (the reset before it), and the "
            "whole step (the phases' medians need not add up to it). Budgets (issue 29): "
            f"{LOOP_BUDGET_US['one process']:.0f} us per call in one process, {LOOP_BUDGET_US['DDP']:.0f} us under "
            "DDP, for the whole step ('step within budget'). Budgets (issue 41), DDP with 2 ranks: step ratio "
            f"<= {LOOP_BUDGET_RATIO}, forward <= {LOOP_BUDGET_FWD_US:.0f} us per call ('fwd and ratio within budget'). "
            "Parameters equal bit for bit after the timed iterations.",
        ))
    return tables
