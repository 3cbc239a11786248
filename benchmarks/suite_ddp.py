"""DDP step of a 24-layer routed residual MLP: every layer picks one of 4 MLP branches per rank and
step (an int gate, different on every rank). 2 gloo ranks on CPU (one thread each), 1 NCCL rank on
a GPU; ``--ddp-ranks N`` sets another world size. Contenders, interleaved step by step:

* masked: MaskedBranch with the defaults, DDP(find_unused_parameters=False). The branches'
  parameters are left out of DDP's buckets; maskedbranch averages those some rank ran at the end
  of the backward, in one all-reduce, and the others keep None, so training equals if/else with
  find_unused_parameters=True (checked below);
* masked, bucket view: the same with DDP(gradient_as_bucket_view=True) (which then touches the
  trunk's parameters only);
* masked (static_graph): the defaults under DDP(static_graph=True) (dead branches get zeros);
* masked, no pruning: MaskedBranch(materialize_grads=False): the optimizer steps the zero gradients
  of unused branches (momentum, weight decay): the pruning's cost, and what it buys;
* if/else (fup=True): ``layer[k](x)``, DDP(find_unused_parameters=True), with and without bucket views;
* dense 0/1: every branch times a one-hot coefficient, DDP(find_unused_parameters=False).

"module fwd" is the same model's forward without DDP, autograd on (the graph is dropped), so
fwd - module fwd is what DDP adds to the forward (for find_unused_parameters=True: the graph walk);
"no-grad fwd" is that forward under torch.no_grad().
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import torch

from . import table
from .ddp_train import backend, columns, launch_all, record_checks, summarize
from .models import RoutedMLP

NAMES = ["masked", "masked, bucket view", "masked (static_graph)", "masked, no pruning",
         "if/else (fup=True)", "if/else (fup=True), bucket view", "dense 0/1"]
REF = "if/else (fup=True)"
DENSE = "dense 0/1"
# Contenders that train exactly as if/else with find_unused_parameters=True.
SAME = [["masked", REF], ["masked, bucket view", REF + ", bucket view"], ["masked (static_graph)", REF]]
BUDGET = 0.95  # issue 41: masked step / if/else (fup=True) step


def build(name: str, job: dict) -> torch.nn.Module:
    kind = "dense" if name.startswith("dense") else name.split(" ")[0].rstrip(",")
    mat = False if "no pruning" in name else None
    return RoutedMLP(kind, job["layers"], job["d"], job["h"], materialize_grads=mat)


def ddp_kwargs(name: str) -> dict:
    kw = {"gradient_as_bucket_view": "bucket view" in name}
    if "static_graph" in name:
        return dict(kw, static_graph=True)
    return dict(kw, find_unused_parameters="fup=True" in name)


def draw(g: torch.Generator, job: dict):
    path = torch.randint(0, 4, (job["layers"],), generator=g).tolist()
    x = torch.randn(job["batch"], job["d"], generator=g)
    return (x, path), torch.zeros(())


def loss(out, target):
    return out.square().mean()


def ref_of(name: str) -> str:
    return REF + ", bucket view" if "bucket view" in name else REF


def run(cfg) -> list:
    cuda = cfg.device == "cuda"
    world = cfg.ddp_ranks or (1 if cuda else 2)
    size = cfg.size
    d, h, batch = {"smoke": (16, 32, 8), "quick": (32, 64, 16), "full": (64, 256, 64)}[size]
    launches, reps, warmup = {"smoke": (1, 4, 1), "quick": (3, 60, 3), "full": (3, 60, 5)}[size]
    job = dict(device=cfg.device, layers=24, d=d, h=h, batch=batch, reps=reps, warmup=warmup,
               lr=1e-3, weight_decay=1e-4, module_phases=True)
    runs = launch_all(__name__, NAMES, SAME, world, launches, job)
    record_checks(cfg, runs, "ddp")
    rows = summarize(runs, NAMES, ref_of, module_phases=True, vs=[DENSE])
    from .plots import ddp_steps

    ddp_steps(cfg.out / "ddp.png", rows, "24 routed MLP layers")
    return [table(
        f"DDP step ({backend(world, cuda)}; 24 routed layers x 4 MLP branches {d}->{h}->{d}, batch {batch} per rank, "
        f"SGD momentum 0.9, weight decay 1e-4; {launches} launches x {reps} interleaved steps; medians in ms, rank 0)",
        columns(True, vs=[DENSE]),
        rows,
        f"Budget (issue 41): masked / if/else (fup=True) <= {BUDGET}. *Median of per-step ratios against the "
        "contender in 'against' (if/else with the same gradient_as_bucket_view setting), over all launches, then "
        "per launch (fresh processes and routing draws). masked, masked (static_graph) and masked, bucket view "
        "train exactly as if/else (fup=True) (checked: parameters and buffers equal after the timed steps); "
        "masked, no pruning steps the zero gradients of unused branches. 'step / dense 0/1': the median of per-step ratios "
        "against dense 0/1.",
    )]
