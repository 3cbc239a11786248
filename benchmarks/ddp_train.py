"""DDP training steps timed phase by phase, shared by the DDP suites (suite_ddp.py, suite_nas.py).

Every rank builds one DDP model and one optimizer per contender (same seed, so the same initial
parameters), draws its own inputs and routing path per step, and runs every contender's step on
them, the order rotating from step to step; a barrier before each step makes both ranks start it
together. Phases: forward (DDP's pre-forward and, for ``find_unused_parameters=True``, its graph
walk), backward (the reducer's all-reduces, the copy of the averaged buckets into ``.grad``),
optimizer (the step hooks, the step, ``zero_grad``). After the timed steps, contenders that must
train identically are compared parameter by parameter and buffer by buffer.

A suite module provides ``build(name, job) -> nn.Module``, ``ddp_kwargs(name) -> dict``,
``draw(g, job) -> (args, target)`` and ``loss(out, target)``.
"""
from __future__ import annotations

import importlib
import statistics
import time
from typing import Dict, List, Sequence

import torch

from . import check, max_diff, spawn_ranks

PHASES = ["step", "fwd", "bwd", "opt", "module fwd", "no-grad fwd"]


def _train(rank: int, world: int, job: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    suite = importlib.import_module(job["suite"])
    cuda = job["device"] == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    names: List[str] = job["names"]
    models, opts = {}, {}
    for name in names:
        torch.manual_seed(0)
        m = suite.build(name, job).to(dev)
        models[name] = DDP(m, device_ids=[rank] if cuda else None, **suite.ddp_kwargs(name))
        opts[name] = torch.optim.SGD(m.parameters(), lr=job["lr"], momentum=0.9, weight_decay=job["weight_decay"])
    g = torch.Generator().manual_seed(1000 + rank + 100 * job["launch"])
    phases: Dict[str, Dict[str, List[float]]] = {k: {p: [] for p in PHASES} for k in names}
    for rep in range(job["warmup"] + job["reps"]):
        args, target = suite.draw(g, job)
        args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
        target = target.to(dev)
        s = rep % len(names)
        for name in names[s:] + names[:s]:
            ddp, opt = models[name], opts[name]
            t = {}
            if job["module_phases"]:
                # The module's own forward (no DDP), before the step: it records the same branches
                # as the step's forward, so the optimizer's pruning sees what the step used.
                sync(); a0 = time.perf_counter()
                ddp.module(*args)  # autograd on; the graph is dropped
                sync(); a1 = time.perf_counter()
                with torch.no_grad():
                    ddp.module(*args)
                sync(); a2 = time.perf_counter()
                t["module fwd"], t["no-grad fwd"] = a1 - a0, a2 - a1
            dist.barrier()  # both ranks start the step together: the phases time one rank's work
            sync(); t0 = time.perf_counter()
            loss = suite.loss(ddp(*args), target)
            sync(); t1 = time.perf_counter()
            loss.backward()
            sync(); t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(); t3 = time.perf_counter()
            t.update({"step": t3 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2})
            if rep >= job["warmup"]:
                for p, v in t.items():
                    phases[name][p].append(v)
        dist.barrier()

    def state(name):
        m = models[name].module
        return [p.detach() for p in m.parameters()] + [b.detach() for b in m.buffers()]

    same = {f"{a} == {b}": max_diff(state(a), state(b)) for a, b in job["same"]}
    return {"phases": phases, "same": same}


def launch_all(suite: str, names: List[str], same: List[List[str]], world: int, launches: int, job: dict) -> List[dict]:
    """``launches`` fresh jobs of ``world`` ranks (other routing draws each): a process's memory
    layout moves a step ratio by a few percent, more than the steps within one launch vary."""
    job = dict(job, suite=suite, names=names, same=same)
    return [spawn_ranks(_train, world, dict(job, launch=k)) for k in range(launches)]


def summarize(runs: List[dict], names: List[str], ref_of, module_phases: bool, vs: Sequence[str] = ()) -> List[list]:
    """Per contender: median phases (ms, pooled over launches), the median of per-step ratios to
    ``ref_of(name)`` over all launches, and per launch; then the median of per-step ratios to
    each contender of ``vs`` (the steps of one repetition ran on the same inputs)."""
    pooled = {k: {p: [v for r in runs for v in r["phases"][k][p]] for p in PHASES} for k in names}

    def ratio(k, ref):
        return statistics.median(a / b for a, b in zip(pooled[k]["step"], pooled[ref]["step"]))

    rows = []
    for k in names:
        ref = ref_of(k)
        per_launch = [statistics.median(a / b for a, b in zip(r["phases"][k]["step"], r["phases"][ref]["step"])) for r in runs]
        ms = {p: statistics.median(v) * 1e3 if v else float("nan") for p, v in pooled[k].items()}
        row = [k, ms["step"], ms["fwd"], ms["bwd"], ms["opt"]]
        if module_phases:
            row += [ms["module fwd"], ms["no-grad fwd"], ms["fwd"] - ms["module fwd"]]
        rows.append(row + [ref, ratio(k, ref), " / ".join(f"{x:.3g}" for x in per_launch)] + [ratio(k, v) for v in vs])
    return rows


def columns(module_phases: bool, vs: Sequence[str] = ()) -> List[str]:
    cols = ["contender", "step ms", "fwd ms", "bwd ms", "opt ms"]
    if module_phases:
        cols += ["module fwd ms", "no-grad fwd ms", "DDP in fwd ms"]
    return cols + ["against", "step ratio*", "per launch*"] + [f"step / {v}*" for v in vs]


def backend(world: int, cuda: bool) -> str:
    """The launch as a table's title says it: ranks, and NCCL or gloo with 1 thread each."""
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    return f"{ranks}, NCCL" if cuda else f"{ranks}, gloo, 1 thread{' each' if world > 1 else ''}"


def record_checks(cfg, runs: List[dict], what: str) -> None:
    """Contenders that must train identically: parameters and buffers bitwise equal after the
    timed steps, in every launch."""
    for pair in runs[0]["same"]:
        check(cfg, f"{what}: {pair} after the timed steps (parameters and buffers)", max(r["same"][pair] for r in runs))
