"""Comparison 2: DDP step time with per-rank, per-batch routing (a different branch per rank and step).

A residual model of L routed layers, each 4 small MLP branches; every step every layer picks one
branch per rank (an int gate). 2 ranks on CPU (gloo), 1 rank with NCCL on a GPU (DDP's graph walk of
find_unused_parameters=True happens at any world size); --ddp-ranks N sets another. Contenders, interleaved step by step:
* masked (fup=False): MaskedBranch, DDP(find_unused_parameters=False);
* masked + unused->None: the same, plus maskedbranch.unused_grads_to_none(optimizer, ddp) (before each
  step, one small all-reduce of the recorded used bits; branches no rank ran get a None gradient, so
  the optimizer skips them as with find_unused_parameters=True);
* ..., bucket view: the same with DDP(gradient_as_bucket_view=True) (gradients are views of DDP's
  buckets: DDP copies no gradient back, in particular not the zeros of unused branches);
* masked (static_graph): MaskedBranch(materialize_grads=True), DDP(static_graph=True);
* if/else (fup=True): branches[k](x), DDP(find_unused_parameters=True);
* dense 0/1: every branch times a one-hot coefficient, DDP(find_unused_parameters=False).
Phases per step: forward (DDP's pre-forward and, for fup=True, the graph walk after it), backward
(incl. the reducer's all-reduces and, for fup=True, the used-map all-reduce), optimizer
(SGD momentum step over every parameter with a gradient, then zero_grad). "module fwd" is the same
model's forward without DDP, autograd on (the graph is dropped), so fwd - module fwd is what DDP adds to
the forward (for find_unused_parameters=True: the graph walk); "no-grad fwd" is that forward under
torch.no_grad() (compute plus the Python that runs without autograd).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import json
import os
import socket
import statistics
import tempfile
import time

import torch
from torch import nn

NAMES = ["masked (fup=False)", "masked + unused->None", "masked + unused->None, bucket view", "masked (static_graph)",
         "if/else (fup=True)", "if/else (fup=True), bucket view", "dense 0/1"]


def _mlp(d, h):
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))


class Net(nn.Module):
    def __init__(self, kind, layers, d, h, n=4):
        super().__init__()
        from maskedbranch import MaskedBranch

        self.kind = kind
        if kind.startswith("masked"):
            mat = kind == "masked (static_graph)"
            self.layers = nn.ModuleList(MaskedBranch([_mlp(d, h) for _ in range(n)], materialize_grads=mat) for _ in range(layers))
        else:
            self.layers = nn.ModuleList(nn.ModuleList(_mlp(d, h) for _ in range(n)) for _ in range(layers))

    def forward(self, x, gates, coefs):
        for i, layer in enumerate(self.layers):
            k = gates[i]
            if self.kind.startswith("masked"):
                x = x + layer(x, k)
            elif self.kind == "dense 0/1":
                c = coefs[i]
                x = x + sum(c[j] * br(x) for j, br in enumerate(layer))
            else:
                x = x + layer[k](x)
        return x


def _worker(rank, world, cfg, port, path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = cfg["device"] == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    L, d, h, B, reps, warmup = (cfg[k] for k in ("layers", "d", "h", "batch", "reps", "warmup"))
    from maskedbranch import unused_grads_to_none

    bits_group = dist.new_group(backend="gloo") if cuda else None
    models, opts = {}, {}
    for name in NAMES:
        torch.manual_seed(0)
        m = Net(name, L, d, h).to(dev)
        kw = {"static_graph": True} if "static" in name else {"find_unused_parameters": "fup=True" in name}
        models[name] = DDP(m, device_ids=[rank] if cuda else None, gradient_as_bucket_view="bucket view" in name, **kw)
        opts[name] = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        if "unused" in name:
            # NCCL: the used bits go over a gloo group (host tensors, no device sync)
            unused_grads_to_none(opts[name], models[name], process_group=bits_group)
    g = torch.Generator().manual_seed(1000 + rank + 100 * cfg["launch"])
    phases = {k: {"fwd": [], "bwd": [], "opt": [], "module fwd": [], "bare fwd": [], "step": []} for k in NAMES}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for rep in range(warmup + reps):
        gates = torch.randint(0, 4, (L,), generator=g).tolist()
        coefs = [torch.nn.functional.one_hot(torch.tensor(k), 4).float().to(dev) for k in gates]
        x = torch.randn(B, d, generator=g).to(dev)
        s = rep % len(NAMES)
        for name in NAMES[s:] + NAMES[:s]:
            ddp, opt = models[name], opts[name]
            dist.barrier()  # both ranks start the step together: the phases time one rank's work
            sync(); t0 = time.perf_counter()
            loss = ddp(x, gates, coefs).square().mean()
            sync(); t1 = time.perf_counter()
            loss.backward()
            sync(); t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(); t3 = time.perf_counter()
            ddp.module(x, gates, coefs)  # autograd on, no DDP; the graph is dropped
            sync(); t4 = time.perf_counter()
            with torch.no_grad():
                ddp.module(x, gates, coefs)
            sync(); t5 = time.perf_counter()
            for mod in ddp.module.modules():  # these forwards are not training steps
                if hasattr(mod, "_usage"):
                    mod._usage.bits = 0
            if rep >= warmup:
                ph = phases[name]
                ph["fwd"].append(t1 - t0); ph["bwd"].append(t2 - t1); ph["opt"].append(t3 - t2)
                ph["module fwd"].append(t4 - t3); ph["bare fwd"].append(t5 - t4); ph["step"].append(t3 - t0)
        dist.barrier()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(phases, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ratios(steps, base):
    return [a / b for a, b in zip(steps, base)]


def run(cfg) -> list:
    import torch.multiprocessing as mp

    cuda = cfg.device == "cuda"
    world = cfg.ddp_ranks or (1 if cuda else 2)
    # Several launches (fresh processes, other routing draws): a process's memory layout moves
    # the ratio by a few percent, more than the steps within one launch vary.
    launches = 3
    c = dict(device=cfg.device, layers=24, d=32 if cfg.quick else 64, h=64 if cfg.quick else 256,
             batch=16 if cfg.quick else 64, reps=60, warmup=3 if cfg.quick else 5)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for launch in range(launches):
            path = os.path.join(tmp, f"ddp{launch}.json")
            mp.spawn(_worker, args=(world, dict(c, launch=launch), _free_port(), path), nprocs=world, join=True)
            with open(path) as f:
                runs.append(json.load(f))
    phases = {k: {p: [v for r in runs for v in r[k][p]] for p in runs[0][k]} for k in NAMES}
    ref = "if/else (fup=True)"
    rows = []
    for k in NAMES:
        ph = phases[k]
        base = ref + ", bucket view" if "bucket view" in k else ref
        per_launch = [statistics.median(_ratios(r[k]["step"], r[base]["step"])) for r in runs]
        ratio = statistics.median(_ratios(ph["step"], phases[base]["step"]))
        rows.append([k] + [statistics.median(ph[p]) * 1e3 for p in ("step", "fwd", "bwd", "opt", "module fwd", "bare fwd")]
                    + [(statistics.median(ph["fwd"]) - statistics.median(ph["module fwd"])) * 1e3, ratio,
                       " / ".join(f"{x:.3g}" for x in per_launch)])
    _plot(cfg, rows)
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    backend = f"{ranks}, NCCL" if cuda else f"{ranks}, gloo, 1 thread{' each' if world > 1 else ''}"
    return [{
        "title": f"DDP step ({backend}; {c['layers']} routed layers x 4 MLP branches {c['d']}->{c['h']}->{c['d']}, "
                 f"batch {c['batch']} per rank, {launches} launches x {c['reps']} interleaved steps; medians in ms, rank 0)",
        "columns": ["contender", "step ms", "fwd ms", "bwd ms", "opt ms", "module fwd ms", "no-grad fwd ms",
                    "DDP in fwd ms", "step / if/else (fup=True)*", "per launch*"],
        "rows": rows,
        "notes": "Target: masked step / if/else (fup=True) <= 1.0. *Median of per-step ratios against if/else (fup=True) "
                 "with the same gradient_as_bucket_view setting, over all launches, then per launch (fresh processes "
                 "and routing draws). "
                 "module fwd: the forward without DDP, autograd on; DDP in fwd = fwd - module fwd (the graph walk of "
                 "find_unused_parameters=True). masked + unused->None trains exactly as if/else + fup=True does "
                 "(tests/test_unused_grads.py); masked (fup=False) steps zero gradients of unused branches.",
    }]


def _plot(cfg, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for j, p in ((2, "fwd"), (3, "bwd"), (4, "opt")):
        vals = [r[j] for r in rows]
        ax.bar([r[0] for r in rows], vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("median ms per step")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(cfg.out / "ddp.png", dpi=100)
    plt.close(fig)
