"""DropPath on a residual branch, ``out = x + drop_path(branch(x))``, forward+backward.

Contenders (all but the subset draw the same mask in one repetition: each is preceded by the same
seed of torch's default CPU generator, from which they all draw):

* timm: ``x + timm.layers.DropPath(p)(branch(x))`` (the branch on every row, then the mask);
* torchvision: ``x + torchvision.ops.stochastic_depth(branch(x), p, "row")``;
* subset (DINOv2): a random subset of int(B (1 - p)) rows, the branch on them, ``index_add`` back
  scaled by B / kept;
* hand skip: ``torch.index_add(x, 0, idx, branch(x.index_select(0, idx)), alpha=1 / (1 - p))`` with
  idx the kept rows of the mask (the hand-written skip of issue 18);
* ours: ``maskedbranch.ResidualDropPath(branch, p)`` (defaults: a skipped branch's parameters get
  zero gradients, as timm's dense formula gives them).

1. The sweep over drop_prob (branch LayerNorm -> Linear(C, 4C) -> GELU -> Linear(4C, C)), time
   relative to timm against the ideal (1 - p), and peak memory; first ``--threads`` setting.
2. The budget case (issue 18): p = 0.5, branch Linear(384, 1536) -> GELU -> Linear(1536, 384),
   x [512, 25, 384], at every ``--threads`` setting: ours / hand skip <= 1.00, ours / timm <= 0.55.
Before timing, ours, timm, torchvision and hand skip are checked to compute the same output and
gradients (x and parameters) for the same seed.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

from typing import Callable, Dict

import torch
from torch import nn

from maskedbranch import ResidualDropPath

from . import check, interleaved, label, max_diff, med, paired, peak_memory, pooled, settings, table, threads
from .models import mlp

BUDGET_HAND, BUDGET_TIMM = 1.00, 0.55


def contenders(branch: nn.Module, p: float) -> Dict[str, Callable]:
    """name -> f(x): one forward of each contender at drop_prob ``p`` (training mode)."""
    keep = 1.0 - p
    try:
        from timm.layers import DropPath

        timm_dp, timm_name = DropPath(p), "timm"
    except ImportError:  # timm's formula
        timm_name = "timm-equivalent"

        def timm_dp(y):
            if p == 0.0:
                return y
            mask = y.new_empty((y.shape[0],) + (1,) * (y.ndim - 1)).bernoulli_(keep)
            return y * mask.div_(keep) if keep > 0.0 else y * mask
    fns = {timm_name: lambda x: x + timm_dp(branch(x))}
    try:
        from torchvision.ops import stochastic_depth

        fns["torchvision"] = lambda x: x + stochastic_depth(branch(x), p, "row", True)
    except ImportError:
        pass

    def subset(x):
        b = x.shape[0]
        k = max(int(b * keep), 1)
        idx = torch.randperm(b)[:k].to(x.device)
        return torch.index_add(x, 0, idx, branch(x.index_select(0, idx)), alpha=b / k)

    def hand(x):
        idx = torch.empty(x.shape[0]).bernoulli_(keep).nonzero().flatten().to(x.device)
        return torch.index_add(x, 0, idx, branch(x.index_select(0, idx)), alpha=1.0 / keep if keep > 0 else 1.0)

    ours = ResidualDropPath(branch, p)
    fns.update({"subset (DINOv2)": subset, "hand skip": hand, "ours": ours})
    return fns


def _step(f, x, branch, gout):
    def step():
        x.grad = None
        branch.zero_grad(set_to_none=True)
        f(x).backward(gout)

    return step


def _seed(name: str, rep: int) -> None:
    torch.manual_seed(1000 + rep)  # every contender draws the same mask in one repetition


def check_same(cfg, fns, x, branch, gout, what: str) -> None:
    def result(f):
        x.grad = None
        branch.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        out = f(x)
        out.backward(gout)
        return [out.detach(), x.grad] + [q.grad for q in branch.parameters()]

    ref_name = next(iter(fns))
    ref = result(fns[ref_name])
    # Relative to the largest reference value (at least 1): parameter gradients sum over every
    # row, and float32 sums in another order differ by their magnitude times the rounding.
    scale = max([1.0] + [float(t.abs().max()) for t in ref if t is not None and t.numel()])
    for k in ("torchvision", "hand skip", "ours"):
        if k in fns:  # the branch on a subset of rows rounds like on all of them, up to GEMM blocking
            check(cfg, f"droppath, {what}: {k} == {ref_name} (output, grad x, grad params; relative)",
                  max_diff(ref, result(fns[k])) / scale, 1e-4)


def sweep(cfg, t, clock) -> tuple:
    device = torch.device(cfg.device)
    gpu = device.type == "cuda"
    shape = {"smoke": (16, 8, 32), "quick": (64, 197, 384) if gpu else (64, 32, 128),
             "full": (128, 197, 384) if gpu else (64, 64, 256)}[cfg.size]
    probs = [0.0, 0.1, 0.2, 0.3, 0.5, 0.7]
    reps, warmup = {"smoke": (2, 1), "quick": (11, 1), "full": (15, 2)}[cfg.size]
    B, T, C = shape
    torch.manual_seed(0)
    branch = nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C)).to(device)
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    gout = torch.randn(B, T, C, device=device)
    rows, mem_rows, names = [], [], None
    for p in cfg.progress(probs, desc="droppath"):
        fns = contenders(branch, p)
        names = list(fns)
        if cfg.size == "smoke":
            check_same(cfg, fns, x, branch, gout, f"sweep p={p}")
        with threads(t):
            times = interleaved({k: _step(f, x, branch, gout) for k, f in fns.items()}, reps, warmup, device, clock, _seed)
        rows.append([p, med(times[names[0]]) * 1e3] + [paired(times, k, names[0]) for k in names[1:]] + [1 - p])
        peaks = {}
        for k, f in fns.items():
            torch.manual_seed(7)
            peaks[k] = peak_memory(_step(f, x, branch, gout), device)
        mem_rows.append([p] + [peaks[k] / 2**20 for k in names] + [peaks["ours"] / peaks[names[0]]])
    ref = names[0]
    tt = table(
        f"DropPath sweep: forward+backward time / {ref} (median of per-repetition ratios, x [{B}, {T}, {C}], "
        f"branch LayerNorm + MLP {C}->{4 * C}->{C}, {reps} reps, {label(t, clock)})",
        ["drop_prob", f"{ref} ms"] + [f"{k} / {ref}" for k in names[1:]] + ["ideal (1 - p)"],
        rows,
    )
    tm = table(
        "DropPath sweep: peak memory of forward+backward (MiB above the level before)",
        ["drop_prob"] + [f"{k} MiB" for k in names] + [f"ours / {ref}"],
        mem_rows,
    )
    from .plots import droppath

    droppath(cfg.out / "droppath.png", probs, {k: [r[2 + j] for r in rows] for j, k in enumerate(names[1:])}, ref)
    return tt, tm


def budget(cfg) -> dict:
    device = torch.device(cfg.device)
    (B, T, C), H = ((32, 5, 48), 192) if cfg.size == "smoke" else ((512, 25, 384), 1536)
    reps, warmup = {"smoke": (2, 1), "quick": (9, 2), "full": (25, 3)}[cfg.size]
    torch.manual_seed(0)
    branch = mlp(C, H).to(device)
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    gout = torch.randn(B, T, C, device=device)
    fns = {k: f for k, f in contenders(branch, 0.5).items() if k in ("timm", "timm-equivalent", "hand skip", "ours")}
    check_same(cfg, fns, x, branch, gout, f"budget case x [{B}, {T}, {C}]")
    timm = next(iter(fns))
    steps = {k: _step(f, x, branch, gout) for k, f in fns.items()}
    out = []
    for t, clock in settings(cfg):
        with threads(t):
            times = interleaved(steps, reps, warmup, device, clock, _seed)
        r_h, r_t = paired(times, "ours", "hand skip"), paired(times, "ours", timm)
        out.append([label(t, clock)] + [med(times[k]) * 1e3 for k in (timm, "hand skip", "ours")]
                   + [r_h, pooled(times, "ours", "hand skip"), r_h <= BUDGET_HAND, r_t, r_t <= BUDGET_TIMM])
    return table(
        f"ResidualDropPath budget case: drop_prob 0.5, MLP {C} -> {H} -> {C}, x [{B}, {T}, {C}], forward+backward "
        f"({reps} interleaved reps, the same mask for every contender in a repetition)",
        ["setting", f"{timm} ms", "hand skip ms", "ours ms", "ours / hand skip*", "(of totals)",
         f"<= {BUDGET_HAND:.2f}", f"ours / {timm}*", f"<= {BUDGET_TIMM}"],
        out,
        "Budgets (issue 18), at 2 threads wall clock and 1 thread CPU time. *Median of per-repetition ratios; "
        "'(of totals)': ratio of summed times.",
    )


def run(cfg) -> list:
    t, clock = settings(cfg)[0]
    tt, tm = sweep(cfg, t, clock)
    return [budget(cfg), tt, tm]
