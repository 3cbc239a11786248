"""DDP training of a single-path one-shot NAS supernet (benchmarks/models.py: 12 choice layers x 4
ShuffleNetV2 choices with BatchNorm): every rank samples its own path each step, 2 gloo ranks on
CPU, SGD with momentum and weight decay. Contenders, interleaved step by step:

* masked: each choice layer a MaskedBranch called with the int choice, DDP with the defaults
  (find_unused_parameters=False); the optimizer-step pruning is automatic;
* if/else (fup=True): ``layer[k](x)`` on the same ModuleList, DDP(find_unused_parameters=True);
* the same two with gradient_as_bucket_view=True;
* dense 0/1: every choice of every layer times a one-hot coefficient, DDP(find_unused_parameters=
  False) (every parameter used; every choice's BatchNorm statistics train too).

masked and if/else train identically (checked: parameters and BatchNorm buffers bitwise equal after the timed
steps); the table gives the step ratio (budget, issue 41: masked <= 0.92x if/else).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import torch

from . import table
from .ddp_train import backend, columns, launch_all, record_checks, summarize
from .models import Supernet

REF = "if/else (fup=True)"
DENSE = "dense 0/1"
NAMES = ["masked", REF, "masked, bucket view", REF + ", bucket view", DENSE]
SAME = [["masked", REF], ["masked, bucket view", REF + ", bucket view"]]
BUDGET = 0.92  # issue 41

SIZES = {  # widths of the 3 stages, stem width, image side, batch per rank
    "smoke": ((16, 32, 64), 8, 16, 4),
    "quick": ((24, 48, 96), 16, 32, 16),
    "full": ((48, 96, 192), 16, 32, 32),
}


def build(name: str, job: dict) -> torch.nn.Module:
    kind = "masked" if name.startswith("masked") else "dense" if name == DENSE else "if/else"
    return Supernet(kind, widths=job["widths"], stem=job["stem"])


def ddp_kwargs(name: str) -> dict:
    return {"find_unused_parameters": name.startswith("if/else"), "gradient_as_bucket_view": "bucket view" in name}


def draw(g: torch.Generator, job: dict):
    path = torch.randint(0, 4, (12,), generator=g).tolist()  # this rank's path for this step
    x = torch.randn(job["batch"], 3, job["side"], job["side"], generator=g)
    return (x, path), torch.randint(0, 10, (job["batch"],), generator=g)


def loss(out, target):
    return torch.nn.functional.cross_entropy(out, target)


def ref_of(name: str) -> str:
    return REF + ", bucket view" if "bucket view" in name else REF


def run(cfg) -> list:
    cuda = cfg.device == "cuda"
    world = cfg.ddp_ranks or (1 if cuda else 2)
    widths, stem, side, batch = SIZES[cfg.size]
    launches, reps, warmup = {"smoke": (1, 3, 1), "quick": (2, 20, 2), "full": (3, 40, 3)}[cfg.size]
    job = dict(device=cfg.device, widths=widths, stem=stem, side=side, batch=batch, reps=reps, warmup=warmup,
               lr=0.05, weight_decay=4e-5, module_phases=False)
    runs = launch_all(__name__, NAMES, SAME, world, launches, job)
    record_checks(cfg, runs, "nas")
    rows = summarize(runs, NAMES, ref_of, module_phases=False, vs=[DENSE])
    from .plots import ddp_steps

    ddp_steps(cfg.out / "nas.png", rows, "NAS supernet, 12 choice layers")
    return [table(
        f"NAS supernet DDP step ({backend(world, cuda)}; "
        f"12 choice layers x 4 ShuffleNetV2 choices (3x3, 5x5, 7x7, Xception) "
        f"with BatchNorm, stages {'/'.join(map(str, widths))}, {side}x{side} images, batch {batch} per rank, every rank "
        f"its own path per step; SGD momentum 0.9, weight decay 4e-5; {launches} launches x {reps} interleaved steps; "
        "medians in ms, rank 0)",
        columns(False, vs=[DENSE]),
        rows,
        f"Budget (issue 41): masked / if/else (fup=True) <= {BUDGET:.2f}, training identical (checked: parameters and "
        "BatchNorm buffers bitwise equal after the timed steps). *Median of per-step ratios against the contender in "
        "'against', over all launches, then per launch; 'step / dense 0/1' against dense 0/1.",
    )]
