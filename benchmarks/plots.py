"""The suite's figures: small PNGs (about 50-100 KB), written into the results folder.

* masked.png: routing cost against the oracle (time / oracle vs the number of branches);
* droppath.png: DropPath time vs drop_prob, against the ideal (1 - p) line;
* ddp.png / nas.png: the DDP step by approach (forward, backward, optimizer);
* kernels.png: the routing ops' bandwidth as a fraction of a clone of the same bytes;
* headline.png: the results page's headline ratios, masked / contender (benchmarks/page.py).
"""
from __future__ import annotations

import contextlib
import pathlib
from typing import Iterator, List, Sequence


@contextlib.contextmanager
def figure(path: pathlib.Path, ncols: int = 1, width: float = 5.5) -> Iterator[list]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 3.6), squeeze=False)
    try:
        yield list(axes[0])
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    finally:
        plt.close(fig)


def routing_cost(path: pathlib.Path, rows: List[list], names: Sequence[str]) -> None:
    """rows: [N, routing, B, pass, oracle ms, <name> / oracle ...] of the masked sweep."""
    big = max(r[2] for r in rows)
    with figure(path, 2) as axes:
        for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
            for j, name in enumerate(names):
                for routing, ls in (("uniform", "-"), ("skewed", "--")):
                    pts = [(r[0], r[5 + j]) for r in rows if r[3] == mode and r[1] == routing and r[2] == big]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", color=f"C{j}",
                            label=f"{name}" if routing == "uniform" else None)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("branches N (solid: uniform, dashed: skewed routing)")
            ax.set_title(f"{mode}, B = {big}", fontsize=10)
        axes[0].set_ylabel("time / oracle")
        axes[0].legend(fontsize=7)


def droppath(path: pathlib.Path, probs: Sequence[float], ratios: dict, ref: str) -> None:
    """ratios: contender -> time / ``ref`` per drop_prob."""
    with figure(path) as (ax,):
        for name, vals in ratios.items():
            ax.plot(probs, vals, marker="o", label=name)
        ax.plot(probs, [1 - p for p in probs], "k--", label="ideal (1 - p)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("drop_prob")
        ax.set_ylabel(f"forward+backward time / {ref}")
        ax.legend(fontsize=7)


def ddp_steps(path: pathlib.Path, rows: List[list], what: str) -> None:
    """rows: [contender, step, fwd, bwd, opt, ...] (ms) of a DDP suite."""
    with figure(path, width=7) as (ax,):
        bottom = [0.0] * len(rows)
        for j, phase in ((2, "forward"), (3, "backward"), (4, "optimizer")):
            vals = [r[j] for r in rows]
            ax.bar([r[0] for r in rows], vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("median ms per step")
        ax.set_title(f"DDP step by approach: {what}", fontsize=10)
        ax.tick_params(axis="x", labelsize=7, labelrotation=20)
        ax.legend(fontsize=7)


def kernels(path: pathlib.Path, rows: List[list]) -> None:
    """rows: [threads, MiB, op, bytes, GB/s, clone GB/s, op / clone, ...] of the kernels suite."""
    settings = sorted({r[0] for r in rows}, key=str)
    with figure(path, len(settings)) as axes:
        for ax, t in zip(axes, settings):
            ops = list(dict.fromkeys(r[2] for r in rows if r[0] == t))
            for j, op in enumerate(ops):
                pts = [r for r in rows if r[0] == t and r[2] == op]
                ax.plot([r[1] for r in pts], [r[6] for r in pts], marker="o", color=f"C{j}", label=op)
            ax.axhline(0.8, color="k", lw=0.8, ls=":")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("MiB of x")
            ax.set_title(str(t), fontsize=10)
        axes[0].set_ylabel("GB/s / clone GB/s (same bytes)")
        axes[0].legend(fontsize=6)


def headline(path: pathlib.Path, rows: List[tuple]) -> None:
    """rows: (label, masked / contender) in the page's order, drawn top to bottom."""
    height = 1.0 + 0.24 * max(len(rows), 1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, height))
    try:
        labels = [r[0] for r in rows][::-1]
        vals = [r[1] for r in rows][::-1]
        ax.barh(range(len(vals)), [v - 1.0 for v in vals], left=1.0,
                color=["C2" if v <= 1.0 else "C3" for v in vals])
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f} ", va="center", ha="left" if v > 1.0 else "right", fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        lo, hi = min(vals + [1.0]), max(vals + [1.0])
        ax.set_xlim(lo / 1.6, hi * 1.6)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("masked / contender (log scale; left of 1: masked is faster)")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    finally:
        plt.close(fig)
