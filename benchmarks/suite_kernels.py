"""Comparison 4: routing kernels in GB/s against a plain copy (clone) of the same bytes and against
the plain-PyTorch equivalents (index_select for gather, index_add_ for combine, x * mask for scale).

Bytes counted: gather 2*M*D (read + write the routed rows), combine (M + 2B)*D (branch outputs,
base, out), drop-path scale 3*B*D (y, base, out); clone 2*B*D. Top-1 routing over N = 4 branches.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import torch

import maskedbranch as mb

from . import interleaved, med, table


def run(cfg) -> list:
    device = torch.device(cfg.device)
    sizes = ([16, 64, 256] if device.type == "cuda" else [4, 16, 64]) if cfg.quick else ([16, 64, 256] if device.type == "cuda" else [4, 16, 64])
    reps, warmup = (9, 1) if cfg.quick else (20, 3)
    D, N = 1024, 4
    rows = []
    for mib in cfg.progress(sizes, desc="kernels"):
        B = mib * 2**20 // (4 * D)
        x = torch.randn(B, D, device=device)
        ids = torch.randint(0, N, (B,))
        plan = mb.make_plan(ids, N, device)
        packed = mb.gather(x, plan)
        ys = mb.split_packed(packed, plan)
        order = plan.rows
        counts = plan.counts
        scale = ((torch.rand(B) < 0.5).float() / 0.5).to(device)
        y = torch.randn_like(x)
        e = x.element_size()
        ids_d = ids.to(device)

        def torch_combine():
            out = x.clone()
            return out.index_add_(0, order, packed)

        fns = {
            "clone": lambda: x.clone(),
            "gather": lambda: mb.gather(x, plan),
            "index_select": lambda: x.index_select(0, order),
            "combine": lambda: mb.combine(ys, plan, base=x),
            "clone + index_add_": torch_combine,
            "drop_path_scale": lambda: mb.drop_path_scale(y, scale, x),
            "x + y * mask": lambda: x + y * scale[:, None],
        }
        nbytes = {
            "clone": 2 * B * D * e, "gather": 2 * B * D * e, "index_select": 2 * B * D * e,
            "combine": 3 * B * D * e, "clone + index_add_": 3 * B * D * e,
            "drop_path_scale": 3 * B * D * e, "x + y * mask": 3 * B * D * e,
        }
        with torch.no_grad():
            t = interleaved(fns, reps, warmup, device)
        bw = {k: nbytes[k] / med(t[k]) / 1e9 for k in fns}
        for op, ref in (("gather", "index_select"), ("combine", "clone + index_add_"), ("drop_path_scale", "x + y * mask")):
            rows.append([mib, op, bw[op], bw["clone"], bw[op] / bw["clone"], ref, bw[ref], bw[op] / bw[ref]])
    _plot(cfg, rows)
    return [table(
        f"Kernels: effective bandwidth (GB/s, from median times, {reps} interleaved reps, float32, D = {D})",
        ["MiB of x", "op", "GB/s", "clone GB/s", "op / clone", "plain PyTorch", "plain GB/s", "op / plain"],
        rows,
        "Target (GPU): op / clone >= 0.8 at 64 MiB and more.",
    )]


def _plot(cfg, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for op in ("gather", "combine", "drop_path_scale"):
        pts = [r for r in rows if r[1] == op]
        ax.plot([r[0] for r in pts], [r[4] for r in pts], marker="o", label=f"{op} / clone")
        ax.plot([r[0] for r in pts], [r[6] / r[3] for r in pts], ls="--", marker="x", label=f"{pts[0][5]} / clone")
    ax.axhline(0.8, color="k", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MiB of x")
    ax.set_ylabel("bandwidth / clone bandwidth")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(cfg.out / "kernels.png", dpi=100)
    plt.close(fig)
