"""Comparison 1: MaskedBranch vs the dense 0/1 trick vs plain if/else (one process) vs the oracle.

N MLP branches (d -> 4d -> d, GELU), top-1 routing (uniform, or skewed: p_i ~ 1/(i+1)^2) drawn per
repetition on the host; forward and forward+backward; peak memory of forward+backward.
* oracle: each branch on its rows, pre-split into contiguous tensors (no routing at all);
* dense 0/1: every branch on every row, times a one-hot coefficient;
* if/else: for each branch, boolean-mask the rows (x[ids == i]), run it, write out[ids == i];
* masked: MaskedBranch with the integer [B] gate (host tensor).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import torch

from . import interleaved, med, paired, peak_memory, table

try:  # the colleague's benchmark's branch definition
    from .bench_masked_branch import mlp
except Exception:  # pragma: no cover
    from torch import nn

    def mlp(d):
        return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

from maskedbranch import MaskedBranch

NAMES = ["oracle", "dense 0/1", "if/else", "masked"]


def _draw(rows, n, skewed, g):
    if not skewed:
        return torch.randint(0, n, (rows,), generator=g)
    p = torch.tensor([1.0 / (i + 1) ** 2 for i in range(n)])
    return torch.multinomial(p, rows, replacement=True, generator=g)


def _contenders(model, x, grad_out, ctx, backward):
    branches = list(model.branches)
    n = len(branches)

    def fin(out):
        if backward:
            if isinstance(out, list):
                torch.autograd.backward(out, ctx["grads"])
            else:
                out.backward(grad_out)
        return out

    def oracle():
        return fin([br(xi) for br, xi in zip(branches, ctx["xs"])])

    def dense():
        coef = ctx["onehot"]
        return fin(sum(coef[:, i, None] * br(x) for i, br in enumerate(branches)))

    def ifelse():
        ids = ctx["ids"]
        out = torch.zeros_like(x)
        for i, br in enumerate(branches):
            sel = ids == i
            if sel.any():
                out[sel] = br(x[sel])
        return fin(out)

    def masked():
        return fin(model(x, ctx["ids_host"]))

    return dict(zip(NAMES, [oracle, dense, ifelse, masked]))


def run(cfg) -> list:
    device, dtype = torch.device(cfg.device), torch.float32
    gpu = device.type == "cuda"
    d = 64 if cfg.quick and not gpu else 256
    batches = ([4096, 16384] if gpu else [1024, 4096]) if cfg.quick else [1024, 4096, 16384]
    reps, warmup = (7, 1) if cfg.quick else (15, 2)
    rows_t, rows_m = [], []
    configs = [(n, r, b) for n in (2, 4, 8) for r in ("uniform", "skewed") for b in batches]
    for n, routing, rows in cfg.progress(configs, desc="masked"):
        torch.manual_seed(0)
        model = MaskedBranch([mlp(d) for _ in range(n)]).to(device, dtype)
        x = torch.randn(rows, d, device=device, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(rows, d, device=device, dtype=dtype)
        g = torch.Generator().manual_seed(1)
        ids_host = _draw(rows, n, routing == "skewed", g)
        order = ids_host.argsort(stable=True).to(device)
        counts = torch.bincount(ids_host, minlength=n).tolist()
        ctx = {
            "ids_host": ids_host,
            "ids": ids_host.to(device),
            "onehot": torch.nn.functional.one_hot(ids_host, n).to(device, dtype),
            "xs": [t.detach().clone().requires_grad_(True) for t in x.detach()[order].split(counts)],
            "grads": list(grad_out[order].split(counts)),
        }
        for mode, backward in (("fwd", False), ("fwd+bwd", True)):
            fns = _contenders(model, x, grad_out, ctx, backward)
            if not backward:
                fns = {k: (lambda f=f: torch.no_grad()(f)()) for k, f in fns.items()}
            else:
                fns = {k: (lambda f=f: (model.zero_grad(set_to_none=True), f())) for k, f in fns.items()}
            t = interleaved(fns, reps, warmup, device)
            o = med(t["oracle"])
            rows_t.append([n, routing, rows, mode, o * 1e3] + [paired(t, k, "oracle") for k in NAMES[1:]])
        if rows == batches[-1]:
            fns = _contenders(model, x, grad_out, ctx, True)
            peaks = {k: peak_memory(f, device) for k, f in fns.items()}
            rows_m.append([n, routing, rows] + [peaks[k] / 2**20 for k in NAMES] + [peaks["masked"] / peaks["oracle"]])
    tt = table(
        f"MaskedBranch vs alternatives: time ratios to the oracle (median of per-repetition ratios, {reps} reps, d={d})",
        ["N", "routing", "B", "pass", "oracle ms (median)", "dense 0/1 / oracle", "if/else / oracle", "masked / oracle"],
        rows_t,
        "Target (GPU): masked / oracle <= 1.05 at N = 4.",
    )
    tm = table(
        "MaskedBranch vs alternatives: peak memory of forward+backward (MiB above the level before)",
        ["N", "routing", "B"] + [f"{k} MiB" for k in NAMES] + ["masked / oracle"],
        rows_m,
    )
    _plot(cfg, rows_t)
    return [tt, tm]


def _plot(cfg, rows_t):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for col, name in zip((5, 6, 7), NAMES[1:]):
            for routing, ls in (("uniform", "-"), ("skewed", "--")):
                pts = [(r[0], r[col]) for r in rows_t if r[3] == mode and r[1] == routing and r[2] == rows_t[-1][2]]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", label=f"{name} ({routing})")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("branches N")
        ax.set_title(f"{mode}, B={rows_t[-1][2]}")
    axes[0].set_ylabel("time / oracle")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(cfg.out / "masked.png", dpi=100)
    plt.close(fig)
