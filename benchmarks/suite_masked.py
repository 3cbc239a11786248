"""MaskedBranch against what users write, one process.

N MLP branches (d -> 4d -> d, GELU), top-1 routing (uniform, or skewed: p_i ~ 1/(i+1)^2) drawn on
the host; forward and forward+backward; peak memory of forward+backward. Contenders:

* oracle: each branch on its rows, pre-split into contiguous tensors (no routing at all: the ideal);
* hand skip: per branch ``index_select`` -> branch -> ``index_add_`` into zeros (indices from the gate);
* if/else: per branch, boolean-mask the rows (``x[ids == i]``), run it, write ``out[ids == i]``;
* dense 0/1: every branch on every row, times a one-hot coefficient;
* masked: MaskedBranch with the integer [B] gate (a host tensor).

1. The sweep: N in {2, 4, 8}, both routings, several batch sizes, at the first ``--threads`` setting.
2. The budget case (issue 13, formerly bench_masked_branch.py): 4 branches 256 -> 1024 -> 256, 8192
   rows, uniform top-1, forward+backward, at every ``--threads`` setting (2 threads wall clock, 1
   thread CPU time by default): masked / oracle <= 1.05 and masked / hand skip <= 1.00.
Before timing, every contender's output, input gradient and parameter gradients are checked
against the oracle's.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only <suite>")
    raise SystemExit(0)

import torch

from maskedbranch import MaskedBranch

from . import check, interleaved, label, max_diff, med, no_grad, paired, peak_memory, pooled, settings, table, threads
from .models import mlp

NAMES = ["oracle", "hand skip", "if/else", "dense 0/1", "masked"]
BUDGET_ORACLE, BUDGET_HAND = 1.05, 1.00


def _draw(rows: int, n: int, skewed: bool, g: torch.Generator) -> torch.Tensor:
    if not skewed:
        return torch.randint(0, n, (rows,), generator=g)
    p = torch.tensor([1.0 / (i + 1) ** 2 for i in range(n)])
    return torch.multinomial(p, rows, replacement=True, generator=g)


class Case:
    """One configuration: the model, x, the routing, and every contender as a closure."""

    def __init__(self, n: int, d: int, h: int, rows: int, skewed: bool, device, seed: int = 0):
        torch.manual_seed(seed)
        self.model = MaskedBranch([mlp(d, h) for _ in range(n)]).to(device)
        self.x = torch.randn(rows, d, device=device, requires_grad=True)
        self.grad_out = torch.randn(rows, d, device=device)
        ids = _draw(rows, n, skewed, torch.Generator().manual_seed(seed + 1))
        order = ids.argsort(stable=True).to(device)
        self.counts = torch.bincount(ids, minlength=n).tolist()
        self.ids_host, self.ids = ids, ids.to(device)
        self.order = order
        self.onehot = torch.nn.functional.one_hot(ids, n).to(device, torch.float32)
        self.xs = [t.detach().clone().requires_grad_(True) for t in self.x.detach()[order].split(self.counts)]
        self.grads = list(self.grad_out[order].split(self.counts))

    def contenders(self, backward: bool):
        branches, x, ids = list(self.model), self.x, self.ids

        def fin(out):
            if backward:
                self.model.zero_grad(set_to_none=True)
                if isinstance(out, list):
                    torch.autograd.backward(out, self.grads)
                else:
                    out.backward(self.grad_out)
            return out

        def oracle():
            for xi in self.xs:
                xi.grad = None
            return fin([br(xi) for br, xi in zip(branches, self.xs)])

        def hand_skip():
            out = torch.zeros_like(x)
            for i, br in enumerate(branches):
                r = (ids == i).nonzero().squeeze(1)
                if r.numel():
                    out.index_add_(0, r, br(x.index_select(0, r)))
            return fin(out)

        def ifelse():
            out = torch.zeros_like(x)
            for i, br in enumerate(branches):
                sel = ids == i
                if sel.any():
                    out[sel] = br(x[sel])
            return fin(out)

        def dense():
            return fin(sum(self.onehot[:, i, None] * br(x) for i, br in enumerate(branches)))

        def masked():
            return fin(self.model(x, self.ids_host))

        fns = dict(zip(NAMES, [oracle, hand_skip, ifelse, dense, masked]))
        if backward:
            return fns
        return {k: no_grad(f) for k, f in fns.items()}

    def results(self, name: str):
        """(output rows in routed order, grad of x in routed order, parameter grads) of one
        forward+backward of ``name``."""
        self.x.grad = None
        out = self.contenders(True)[name]()
        if name == "oracle":
            out, gx = torch.cat(out), torch.cat([xi.grad for xi in self.xs])
        else:
            out, gx = out[self.order], self.x.grad[self.order]
        return [out, gx] + [p.grad for p in self.model.parameters()]


def check_case(cfg, case: Case, what: str, names=NAMES[1:]) -> None:
    ref = case.results("oracle")
    for k in names:  # the same products, added in another order (zeros + y, one-hot sums): rounding
        check(cfg, f"masked, {what}: {k} == oracle (output, grad x, grad params)", max_diff(ref, case.results(k)), 1e-3)


def sweep(cfg, t: int, clock: str) -> tuple:
    device = torch.device(cfg.device)
    gpu = device.type == "cuda"
    d = {"smoke": 16, "quick": 64 if not gpu else 256, "full": 256}[cfg.size]
    batches = {"smoke": [256], "quick": [4096, 16384] if gpu else [1024, 4096], "full": [1024, 4096, 16384]}[cfg.size]
    reps, warmup = {"smoke": (2, 1), "quick": (7, 1), "full": (15, 2)}[cfg.size]
    branches = [2, 4] if cfg.size == "smoke" else [2, 4, 8]
    rows_t, rows_m = [], []
    configs = [(n, r, b) for n in branches for r in ("uniform", "skewed") for b in batches]
    for n, routing, rows in cfg.progress(configs, desc="masked"):
        case = Case(n, d, 4 * d, rows, routing == "skewed", device)
        if cfg.size == "smoke":
            check_case(cfg, case, f"N={n} {routing} B={rows}")
        for mode, backward in (("fwd", False), ("fwd+bwd", True)):
            with threads(t):
                times = interleaved(case.contenders(backward), reps, warmup, device, clock)
            rows_t.append([n, routing, rows, mode, med(times["oracle"]) * 1e3] + [paired(times, k, "oracle") for k in NAMES[1:]])
        if rows == batches[-1]:
            peaks = {k: peak_memory(f, device) for k, f in case.contenders(True).items()}
            rows_m.append([n, routing, rows] + [peaks[k] / 2**20 for k in NAMES] + [peaks["masked"] / peaks["oracle"]])
    tt = table(
        f"MaskedBranch sweep: time / oracle (median of per-repetition ratios, {reps} reps, d={d}, {label(t, clock)})",
        ["N", "routing", "B", "pass", "oracle ms"] + [f"{k} / oracle" for k in NAMES[1:]],
        rows_t,
    )
    tm = table(
        "MaskedBranch sweep: peak memory of forward+backward (MiB above the level before)",
        ["N", "routing", "B"] + [f"{k} MiB" for k in NAMES] + ["masked / oracle"],
        rows_m,
    )
    return tt, tm, rows_t


def budget(cfg) -> dict:
    device = torch.device(cfg.device)
    d, h, rows = (32, 128, 512) if cfg.size == "smoke" else (256, 1024, 8192)
    reps, warmup = {"smoke": (2, 1), "quick": (9, 2), "full": (25, 3)}[cfg.size]
    case = Case(4, d, h, rows, False, device, seed=3)
    names = ["oracle", "hand skip", "masked"]
    check_case(cfg, case, f"budget case d={d} B={rows}", names[1:])
    fns = {k: f for k, f in case.contenders(True).items() if k in names}
    out = []
    for t, clock in settings(cfg):
        with threads(t):
            times = interleaved(fns, reps, warmup, device, clock)
        r_o, r_h = paired(times, "masked", "oracle"), paired(times, "masked", "hand skip")
        out.append([label(t, clock)] + [med(times[k]) * 1e3 for k in names]
                   + [r_o, pooled(times, "masked", "oracle"), r_o <= BUDGET_ORACLE, r_h, r_h <= BUDGET_HAND])
    return table(
        f"MaskedBranch budget case: 4 MLP branches {d} -> {h} -> {d}, {rows} rows, uniform top-1 ids, "
        f"forward+backward ({reps} interleaved reps)",
        ["setting", "oracle ms", "hand skip ms", "masked ms", "masked / oracle*", "(of totals)",
         f"<= {BUDGET_ORACLE}", "masked / hand skip*", f"<= {BUDGET_HAND:.2f}"],
        out,
        "Budgets: issue 13 (masked / oracle, 2 threads) and issue 18 (both, 2 threads wall clock and 1 thread CPU "
        "time). *Median of per-repetition ratios; '(of totals)': ratio of summed times.",
    )


def run(cfg) -> list:
    t, clock = settings(cfg)[0]
    tt, tm, rows_t = sweep(cfg, t, clock)
    from .plots import routing_cost

    routing_cost(cfg.out / "masked.png", rows_t, NAMES[1:])
    return [budget(cfg), tt, tm]
