"""The demo's expert model (examples/demo.py) under DDP: a stem, one MLP expert per row chosen by
the row's domain (4 experts, skewed domains: the last one so rare that a rank often has none of
its rows), a residual and a head; cross-entropy, SGD with momentum 0.9 and weight decay 1e-3, as
the demo trains it. 2 gloo ranks on CPU (one thread each), 1 NCCL rank on a GPU. Contenders,
interleaved step by step on the same batches:

* masked: the demo's MaskedBranch with an int64 per-row gate, DDP(find_unused_parameters=False);
* if/else (fup=True): the demo's loop over the experts (``index_add`` of each expert's rows),
  DDP(find_unused_parameters=True);
* dense 0/1: every expert on every row times a one-hot coefficient.

masked trains as if/else up to float rounding (the rows are summed in another order; checked after
the timed steps, as the demo checks it). The model classes are the demo's own, loaded from its file.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only demo")
    raise SystemExit(0)

import functools
import importlib.util
import pathlib
import sys

import torch

from . import check, table
from .ddp_train import backend, columns, launch_all, summarize

REF = "if/else (fup=True)"
DENSE = "dense 0/1"
BUDGET = 0.95  # issue 41
NAMES = ["masked", REF, DENSE]
VARIANT = {"masked": "masked", REF: "ifelse", DENSE: "dense"}  # the demo's names
D_IN, CLASSES = 64, 10  # the demo's


@functools.lru_cache(maxsize=None)
def demo():
    """examples/demo.py as a module (its main() runs only as a script), its folder first on the
    path while it loads, as for a script (it imports examples/_ranks.py)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "demo.py"
    spec = importlib.util.spec_from_file_location("maskedbranch_demo", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def build(name: str, job: dict) -> torch.nn.Module:
    return demo().Experts(D_IN, job["dim"], CLASSES, VARIANT[name])


def ddp_kwargs(name: str) -> dict:
    return {"find_unused_parameters": name == REF}


def draw(g: torch.Generator, job: dict):
    """A batch of the demo's data set (its skewed domains and labels), fresh per step and rank."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    x, domain, y = demo().make_dataset(job["batch"], D_IN, CLASSES, seed=seed).tensors
    return (x, domain), y


def loss(out, target):
    return torch.nn.functional.cross_entropy(out, target)


def run(cfg) -> list:
    cuda = cfg.device == "cuda"
    world = cfg.ddp_ranks or (1 if cuda else 2)
    dim, batch = {"smoke": (16, 32), "quick": (128, 256), "full": (128, 256)}[cfg.size]  # the demo's defaults
    launches, reps, warmup = {"smoke": (1, 4, 1), "quick": (2, 40, 3), "full": (3, 60, 5)}[cfg.size]
    job = dict(device=cfg.device, dim=dim, batch=batch, reps=reps, warmup=warmup, lr=0.05, weight_decay=1e-3,
               module_phases=False)
    runs = launch_all(__name__, NAMES, [["masked", REF]], world, launches, job)
    # The demo's tolerance: the same parameters up to float rounding after training.
    check(cfg, f"demo: masked == {REF} after the timed steps (parameters, up to rounding)",
          max(r["same"][f"masked == {REF}"] for r in runs), 1e-3)
    rows = summarize(runs, NAMES, lambda n: REF, module_phases=False, vs=[DENSE])
    return [table(
        f"The demo's expert model under DDP ({backend(world, cuda)}; examples/demo.py: "
        f"4 MLP experts {dim}->{4 * dim}->{dim} chosen "
        f"per row by a skewed domain, batch {batch} per rank, SGD momentum 0.9, weight decay 1e-3; {launches} launches x "
        f"{reps} interleaved steps; medians in ms, rank 0)",
        columns(False, vs=[DENSE]),
        rows,
        f"Budget (issue 41): masked / {REF} <= {BUDGET}. "
        "*Median of per-step ratios against the contender in 'against', over all launches, then per launch; "
        "'step / dense 0/1' against dense 0/1. masked trains as if/else (fup=True) up to rounding (checked).",
    )]
