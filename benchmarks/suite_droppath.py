"""Comparison 3: DropPath sweep over drop_prob on a transformer MLP residual branch.

out = x + drop_path(branch(x)), branch = LayerNorm -> Linear(C, 4C) -> GELU -> Linear(4C, C); forward+backward.
* timm: timm.layers.DropPath on the branch output (timm-equivalent code when timm does not import);
* torchvision: torchvision.ops.stochastic_depth(mode="row") (torchvision-equivalent when absent);
* subset: a fixed-count subset (the DINOv2 way): randperm, keep int(B * (1 - p)) rows, branch on
  them, index_add back scaled by B / kept;
* ours: maskedbranch.ResidualDropPath (branch only on the kept rows, fused scaled add).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import torch

from . import interleaved, med, paired, peak_memory, table
from .bench_drop_path import contenders as dp_contenders, make_branch

from maskedbranch import ResidualDropPath

PROBS = [0.0, 0.1, 0.2, 0.3, 0.5, 0.7]


def _timm(branch):
    try:
        from timm.layers import DropPath

        dp = DropPath(0.0)

        def f(x, p, g):
            dp.drop_prob = p
            return x + dp(branch(x))

        return "timm", f
    except Exception:
        return "timm-equivalent", dp_contenders(branch)["timm"]


def _torchvision(branch):
    try:
        from torchvision.ops import stochastic_depth

        return "torchvision", lambda x, p, g: x + stochastic_depth(branch(x), p, "row", True)
    except Exception:

        def stochastic_depth(y, p, training=True):  # torchvision's semantics, mode="row"
            if not training or p == 0.0:
                return y
            survival = 1.0 - p
            noise = torch.empty([y.shape[0]] + [1] * (y.ndim - 1), dtype=y.dtype, device=y.device)
            noise = noise.bernoulli_(survival)
            if survival > 0.0:
                noise.div_(survival)
            return y * noise

        return "torchvision-equivalent", lambda x, p, g: x + stochastic_depth(branch(x), p)


def _subset(branch):
    def f(x, p, g):
        b = x.shape[0]
        k = max(int(b * (1 - p)), 1)
        idx = torch.randperm(b, generator=g)[:k].to(x.device)
        res = branch(x[idx])
        return torch.index_add(x.flatten(1), 0, idx, res.flatten(1).to(x.dtype), alpha=b / k).view_as(x)

    return "subset (DINOv2)", f


def run(cfg) -> list:
    device = torch.device(cfg.device)
    B, T, C = ((64, 197, 384) if device.type == "cuda" else (64, 32, 128)) if cfg.quick else ((128, 197, 384) if device.type == "cuda" else (64, 64, 256))
    reps, warmup = (11, 1) if cfg.quick else (15, 2)
    torch.manual_seed(0)
    branch = make_branch(C, 4 * C, device, torch.float32)
    ours_mod = ResidualDropPath(branch)

    def ours(x, p, g):
        ours_mod.drop_prob, ours_mod.generator = p, g
        return ours_mod(x)

    cs = dict([_timm(branch), _torchvision(branch), _subset(branch), ("ours", ours)])
    names = list(cs)
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    gout = torch.randn(B, T, C, device=device)
    rows, mem_rows = [], []
    for p in cfg.progress(PROBS, desc="droppath"):
        seed = [0]

        def mk(f):
            def step():
                seed[0] += 1
                x.grad = None
                branch.zero_grad(set_to_none=True)
                f(x, p, torch.Generator().manual_seed(seed[0])).backward(gout)

            return step

        t = interleaved({k: mk(f) for k, f in cs.items()}, reps, warmup, device)
        ref = names[0]
        rows.append([p, med(t[ref]) * 1e3] + [paired(t, k, ref) for k in names[1:]] + [1 - p])
        peaks = {}
        for k, f in cs.items():
            x.grad = None
            branch.zero_grad(set_to_none=True)
            peaks[k] = peak_memory(lambda: f(x, p, torch.Generator().manual_seed(7)).backward(gout), device)
        mem_rows.append([p] + [peaks[k] / 2**20 for k in names] + [peaks["ours"] / peaks[ref]])
    tt = table(
        f"DropPath sweep: forward+backward time relative to {names[0]} (median of per-repetition ratios, "
        f"x [{B}, {T}, {C}], {reps} reps)",
        ["drop_prob", f"{names[0]} ms (median)"] + [f"{k} / {names[0]}" for k in names[1:]] + ["ideal (1 - p)"],
        rows,
        "Target (GPU): ours / timm <= 0.55 at drop_prob 0.5.",
    )
    tm = table(
        "DropPath sweep: peak memory of forward+backward (MiB above the level before)",
        ["drop_prob"] + [f"{k} MiB" for k in names] + [f"ours / {names[0]}"],
        mem_rows,
    )
    _plot(cfg, rows, mem_rows, names)
    return [tt, tm]


def _plot(cfg, rows, mem_rows, names):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ps = [r[0] for r in rows]
    for j, k in enumerate(names[1:]):
        a.plot(ps, [r[2 + j] for r in rows], marker="o", label=k)
    a.plot(ps, [1 - p for p in ps], "k--", label="ideal (1 - p)")
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_xlabel("drop_prob")
    a.set_ylabel(f"time / {names[0]}")
    a.legend(fontsize=8)
    for j, k in enumerate(names):
        b.plot(ps, [r[1 + j] for r in mem_rows], marker="o", label=k)
    b.set_xlabel("drop_prob")
    b.set_ylabel("peak MiB (fwd+bwd)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(cfg.out / "droppath.png", dpi=100)
    plt.close(fig)
