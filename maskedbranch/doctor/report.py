"""What the doctor found (find.py decides it) and how it reads: findings grouped by module, a
verdict, and the advice that fits each finding."""
from __future__ import annotations

import itertools
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

# Per-rank states of a parameter (the "ranks" column).
GRAD, ZERO, TIED, UNUSED, FAILED = "+", "0", "~", "-", "!"
IN_GRAPH = (GRAD, ZERO, TIED)
_LEGEND = (f"  {GRAD} gradient   {ZERO} zero gradient   {TIED} in the graph, no gradient (tied in by a routing "
           f"module: DDP fills zeros)\n  {UNUSED} not in the graph (DDP's hook does not fire)   {FAILED} the rank failed")

# Findings. All but OK and NOT_SAMPLED break DDP with find_unused_parameters=False.
OK, NOT_SAMPLED, DIVERGENT, CHOICE, NOT_CALLED, UNUSED_ = (
    "ok", "not sampled", "divergent", "choice not sampled", "not called", "unused")
# A routing module never called whose parameters DDP leaves to maskedbranch: fine for DDP.
LEFT = "NOT CALLED, no gradient (DDP leaves its parameters to maskedbranch)"
# finding -> (the table's words, the verdict's words, the advice)
_FINDINGS = {
    DIVERGENT: ("DIVERGENT", "used on some ranks only",
                "Used on some ranks only: route with maskedbranch.MaskedBranch or maskedbranch.masked_branch (if/else, "
                "random or top-k choices, experts) or maskedbranch.ResidualDropPath or maskedbranch.drop_add_residual "
                "(LayerDrop, stochastic depth; a Hugging Face model's LayerDrop: "
                "maskedbranch.integrations.transformers.patch(model)), which keep skipped branches in the graph "
                "without computing them, or use DistributedDataParallel(..., find_unused_parameters=True)."),
    CHOICE: ("NOT SAMPLED (plain Python routing)", "of routing choices that no rank picked",
             "Routing choices that no rank picked (experts, branches or layers whose siblings in the same container "
             "are used) are not dead weight: do not delete them or freeze them. Route the choice with "
             "maskedbranch.MaskedBranch or maskedbranch.masked_branch (a Hugging Face model's LayerDrop: "
             "maskedbranch.integrations.transformers.patch(model)), which keeps the choices no rank picked in the "
             "graph, or use DistributedDataParallel(..., find_unused_parameters=True)."),
    NOT_CALLED: ("NOT CALLED", "of routing modules never called",
                 "Call each routing module itself on every rank (choices(x, gate), gate -1 for no branch), not its "
                 "branches (choices[i](x)); call a functional form (masked_branch, drop_add_residual) with its "
                 "branches on every rank too; or remove the routing if the model does not need it."),
    UNUSED_: ("UNUSED", "unused on every rank",
              "Unused on every rank: if no input uses them, remove them or freeze them (p.requires_grad_(False)) "
              "before wrapping the model in DDP; if some inputs or draws do, route with maskedbranch.MaskedBranch."),
}
_BREAKS = ("With find_unused_parameters=False, DDP silently skips averaging the gradients in the first "
           "iteration and raises 'Expected to have finished reduction in the prior iteration' in the second.")


@dataclass
class ParameterUse:
    """One trainable parameter: its state on each simulated rank, and the finding."""

    name: str
    shape: Tuple[int, ...]
    ranks: Tuple[str, ...]
    aliases: Tuple[str, ...] = ()  # other qualified names of the same (tied) parameter
    finding: str = OK
    detail: str = ""  # the routing module or choice concerned
    owned: bool = False  # left out of DDP's buckets (maskedbranch averages it): unused on every rank is fine

    @property
    def used_on(self) -> List[int]:  # ranks where it is in the graph (its DDP hook fires)
        return [r for r, s in enumerate(self.ranks) if s in IN_GRAPH]

    @property
    def unused_on(self) -> List[int]:
        return [r for r, s in enumerate(self.ranks) if s == UNUSED]

    @property
    def kind(self) -> str:  # as DDP sees it: in the graph on every rank that ran, on none, on some
        used, unused = self.used_on, self.unused_on
        if self.owned and unused and not used:
            return "ok"
        return "unknown" if not used and not unused else "ok" if not unused else "divergent" if used else "unused"


@dataclass
class RoutingUse:
    """What one routing unit did on each simulated rank: a routing module's (MaskedBranch,
    ResidualDropPath, a patched LayerDrop list), or a functional form's module branch."""

    name: str
    type: str
    units: List[str]  # its branches' module names
    calls: List[int] = field(default_factory=list)  # per rank
    ran: List[int] = field(default_factory=list)  # per rank, bit i: branch i ran
    rows: int = 0  # rows of x over all calls
    drop_prob: Optional[float] = None  # ResidualDropPath's
    mode: str = ""
    functional: bool = False  # a functional form's module branch (name: the branch; calls: 1 per rank that ran it)

    def branch_ran(self, i: int) -> bool:
        return any(bits >> i & 1 for bits in self.ran)


@dataclass
class RankFailure:
    """A simulated rank whose inputs, forward, loss or backward raised."""

    rank: int
    stage: str
    error: str  # "TypeError: ..."
    traceback: str = field(default="", repr=False)


@dataclass
class Group:
    """Parameters of one module (or one parameter) with the same finding and per-rank states."""

    module: str
    parameters: List[str]
    ranks: str
    finding: str
    detail: str = ""


@dataclass
class Report:
    """What :func:`find_unused_parameters` / :func:`find_divergent_parameters` found; ``str()``
    is the grouped table and the verdict."""

    model: str
    num_ranks: int
    training: bool
    parameters: List[ParameterUse]
    groups: List[Group] = field(default_factory=list)
    routing: List[RoutingUse] = field(default_factory=list)
    not_called: List[str] = field(default_factory=list)  # routing modules the forward never calls
    frozen: List[str] = field(default_factory=list)
    failures: List[RankFailure] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def unused(self) -> List[str]:  # in the graph on no rank that ran: breaks DDP
        return [p.name for p in self.parameters if p.kind == "unused"]

    @property
    def divergent(self) -> List[str]:  # in the graph on some ranks only: breaks DDP
        return [p.name for p in self.parameters if p.kind == "divergent"]

    @property
    def not_sampled(self) -> List[str]:  # routing modules' branches that ran on no rank: fine for DDP
        return [p.name for p in self.parameters if p.finding == NOT_SAMPLED]

    @property
    def breaks_ddp(self) -> bool:
        return bool(self.unused or self.divergent)

    @property
    def safe(self) -> bool:  # every rank ran, every trainable parameter in the graph on each
        return not self.failures and not self.breaks_ddp

    @property
    def exit_code(self) -> int:  # the command line's: 0 safe, 1 breaks DDP, 3 a rank failed
        return 3 if self.failures else int(self.breaks_ddp)

    def __str__(self) -> str:
        return self.format()

    def format(self, show_all: bool = False) -> str:
        """The report as text; ``show_all`` lists the modules without findings too."""
        n = len(self.parameters)
        lines = [f"{self.model}: {n} trainable parameter{plural(n)}"
                 + (f" ({len(self.frozen)} frozen, ignored by DDP)" if self.frozen else "")
                 + f", {self.num_ranks} simulated rank{plural(self.num_ranks)}, "
                 + ("training" if self.training else "eval") + " mode"]
        rows = [g for g in self.groups if show_all or g.finding != OK]
        if rows:
            lines += [""] + _table(rows, self.num_ranks) + ["", _LEGEND]
        elif n:
            lines += ["", f"  all {n} parameters are in the graph on every rank"]
        failed: Dict[Tuple[str, str], List[RankFailure]] = {}
        for f in self.failures:
            failed.setdefault((f.stage, f.error), []).append(f)
        for (stage, error), fs in failed.items():
            lines += ["", f"Rank{plural(len(fs))} {ranks_text([f.rank for f in fs])} failed in the {stage}: {error}"]
            lines += ["  " + ln for ln in fs[0].traceback.rstrip().splitlines()]
        lines += [ln for note in self.notes for ln in ("", wrap("Note: " + note))]
        return "\n".join(lines + [""] + [wrap(par) for par in self._verdict()])

    def _verdict(self) -> List[str]:
        failed = len({f.rank for f in self.failures})
        out = [f"Verdict: incomplete: {failed} of {self.num_ranks} simulated ranks failed"
               + ("; among the others:" if failed < self.num_ranks else "; nothing to judge.")] if failed else []
        bad = [p for p in self.parameters if p.kind in ("unused", "divergent")]
        if failed == self.num_ranks:
            return out
        if not bad:
            out.append(("" if failed else "Verdict: ") + "safe for DDP with find_unused_parameters=False" + (
                " on this input; routing that depends on the input or on random draws can still differ "
                "between ranks: run several (find_divergent_parameters, or --ranks K)." if self.num_ranks == 1
                else f": every trainable parameter is in the autograd graph on all {self.num_ranks} ranks"
                + (" but those of routing modules never called, which DDP leaves to maskedbranch and which keep "
                   "no gradient, as with find_unused_parameters=True." if any(p.finding == LEFT for p in self.parameters)
                   else ".")))
        else:
            counts = {f: sum(p.finding == f for p in bad) for f in _FINDINGS}
            modules = len({g.module for g in self.groups if g.finding in _FINDINGS})
            out.append(("" if failed else "Verdict: ") + f"NOT safe for DDP with find_unused_parameters=False: "
                       f"{len(bad)} parameter{plural(len(bad))} in {modules} module{plural(modules)} ("
                       + ", ".join(f"{k} {_FINDINGS[f][1]}" for f, k in counts.items() if k) + ").")
            out += [_BREAKS] + [_FINDINGS[f][2] for f, k in counts.items() if k]
        sampled = [g for g in self.groups if g.finding == NOT_SAMPLED]
        if sampled:
            k = sum(len(g.parameters) for g in sampled)
            out.append(f"Not sampled: {len(sampled)} branch{'es' if len(sampled) > 1 else ''} of routing modules "
                       f"({k} parameter{plural(k)}) ran on no rank. DDP is fine with them (they are in the graph "
                       f"on every rank), and they are not unused: the routing did not pick them in these "
                       f"{self.num_ranks} draws. Do not delete them; run more ranks (--ranks "
                       f"{max(16, 4 * self.num_ranks)}, or more inputs) to see them sampled.")
        return out


def _table(groups: Sequence[Group], num_ranks: int) -> List[str]:
    def finding(g: Group) -> str:
        if g.finding == DIVERGENT:
            off = [r for r, s in enumerate(g.ranks) if s == UNUSED]
            text = f"DIVERGENT: not in the graph on rank{plural(len(off))} {ranks_text(off)}"
        elif g.finding == UNUSED_ and num_ranks > 1:
            text = "UNUSED on every rank"
        else:
            text = _FINDINGS[g.finding][0] if g.finding in _FINDINGS else g.finding
        return f"{text}: {g.detail}" if g.detail else text

    rows = [["module", "params", "ranks" if num_ranks > 1 else "rank", "finding"]]
    rows += [[g.module, str(len(g.parameters)), g.ranks, finding(g)] for g in groups]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3] for r in rows]


def wrap(paragraph: str) -> str:
    return textwrap.fill(paragraph, width=100, break_long_words=False, break_on_hyphens=False)


def plural(n: int) -> str:
    return "" if n == 1 else "s"


def ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7, 8'."""
    out = []
    for _, run in itertools.groupby(enumerate(sorted(ranks)), lambda t: t[1] - t[0]):
        r = [v for _, v in run]
        out.append(str(r[0]) if len(r) == 1 else f"{r[0]}{', ' if len(r) == 2 else '-'}{r[-1]}")
    return ", ".join(out)
