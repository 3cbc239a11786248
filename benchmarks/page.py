"""The results page, benchmarks/RESULTS.md, and the README's excerpt of it, written from one run's
results (``python -m benchmarks --page``): one headline table with a row per choice a user makes,
each a ratio masked / contender read from the suites' tables, never typed in.

``HEADLINE`` says where each row's ratio comes from (a suite, the start of a table title, the
table row, the column); :func:`render` turns a run's results (the structure of results.json) into
the page, :func:`readme_block` into the README's excerpt. ``python -m benchmarks.page
[results/page/results.json]`` writes them again from a run's results, without measuring (after a
change of the page's text).
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
from typing import List, Optional, Sequence, Tuple

# What the page runs (python -m benchmarks --page): every suite a headline row reads, and the
# kernels for their plot; the compile suite without its slowest cases.
SUITES = ["ddp", "overhead", "nas", "demo", "hf", "droppath", "masked", "timm", "compile", "kernels"]
COMPILE_CASES = ["timm", "moe", "depth", "hetero-supernet"]  # the timm case's compile times are cold ones
COMPILE_RATES = (0.4,)
SPREAD = 0.05  # run-to-run spread of a ratio on the 2-core machine the suites were built on
MAX_LINES = 300
BEGIN, END = "<!-- results-page:begin", "<!-- results-page:end -->"

# Why masked is slower, per kind of row (shown only where the ratio is above 1).
W_TIE = ("masked reduces which branches ran after each forward and averages the routed parameters in an all-reduce "
         "of its own at the end of the backward, fixed costs per step that the graph walk of "
         "`find_unused_parameters=True` undercuts on this model.")
W_TIE_CONV = ("the usage all-reduce after each forward and the averaging of the choices' parameters at the end of the "
              "backward cost about what the graph walk of `find_unused_parameters=True` costs on this model.")
W_TIE_ROWS = ("masked adds a routing plan per call, the usage all-reduce and the averaging of the experts' parameters, "
              "fixed costs per step above the graph walk of `find_unused_parameters=True` on a graph this small.")
W_DENSE = "the branches are so small that running all of them costs less than the routing's fixed cost per call."
W_HF = ("the usage all-reduce after each forward and the averaging of the layers' parameters at the end of the "
        "backward cost more than the graph walk of `find_unused_parameters=True` on a model this small.")
W_DROP0 = "nothing is dropped, so both compute the dense formula; the difference is the module's own call overhead."
W_DROP = ("the host-side mask draw, the gather of the kept rows and the scaled add back cost more than the dropped "
          "rows' share of the branch saves at this size.")
W_TIMM = ("the routing of each drop path (a plan, a gather, a combine) costs more than the dropped samples' branch "
          "compute saves at this batch size.")
W_TIMM_COMPILED = ("the gather and combine around each block, and branch kernels generated for a data-dependent row "
                   "count, cost more than the dropped samples save.")
W_COMPILE_TIME = ("Dynamo traces the routing's Python and autograd Functions in every block, and inductor generates each "
                  "routed block's kernels for a data-dependent row count, where timm's blocks have static shapes.")
W_ORACLE = ("the oracle gets each expert's rows split before the step; a routed mixture gathers every routed row and "
            "adds it back, at about the speed of a copy (the kernels plot).")
W_DEPTH_INT = ("int gates inline the chosen block as if/else does; the graph adds the record of which branch ran and "
               "the zeros of a dropped block.")
W_DEPTH_TENSOR = ("0-d tensor gates are data: every block's choice runs through the stacked copy and a select for -1 in "
                  "one graph; int gates are the form for a few patterns (docs/guides/compile.md).")
W_COND = ("choices of different structures take one torch.cond each, whose backward runs the chosen choice's forward "
          "again (torch's cond saves only its inputs) and whose subgraphs inductor cannot fuse across.")
W_COND_TIME = "inductor compiles each choice's subgraph, forward and backward, where one path compiles one branch per layer."
W_HAND = ("both move the same rows; masked adds its routing plan and custom ops, a fixed cost per call that shows "
          "on small experts.")


@dataclasses.dataclass(frozen=True)
class Row:
    group: str  # the heading row it sits under
    choice: str  # what the user picks
    against: str  # the contender; "{ideal}" takes the table's ideal ratio where it has one
    short: str  # its label in the headline plot
    suite: str
    title: str  # the start of the suite table's title
    match: Tuple[Tuple[str, object], ...]  # (column, value or pattern) the table row has; the first such row is read
    column: str  # the ratio masked / contender
    why: str  # why masked is slower, where it is
    ideal: str = ""  # the column of the ideal ratio, if any
    key: bool = False  # copied into the README


DDP = "DDP training step (masked: `find_unused_parameters=False`)"
DROP = "Stochastic depth on a residual MLP, forward + backward"
TIMM = "timm models, one train step at drop_path_rate 0.4"
MOE = "Mixture of experts, forward + backward"
COMPILED = "Compiled routing: plain `torch.compile`, one process, a train step"
HETERO = re.compile(r"conv \d+ x 4 BN, kernels 3/5/7/3 \(conds\)")  # any size (--smoke runs a smaller one)
FUP = "if/else, `find_unused_parameters=True`"
DENSE = "dense 0/1 trick (every branch, times 0 or 1)"


def _ddp(choice, short, suite, title, why_fup, key):
    return [Row(DDP, choice, FUP, f"{short} vs if/else + fup", suite, title, (("contender", "masked"),), "step ratio*",
                why_fup, key=key),
            Row(DDP, choice, DENSE, f"{short} vs dense 0/1", suite, title, (("contender", "masked"),),
                "step / dense 0/1*", W_DENSE)]


HEADLINE: List[Row] = [
    *_ddp("`MaskedBranch`: routed MLP, 24 layers x 4 branches", "MLP", "ddp", "DDP step", W_TIE, True),
    Row(DDP, "`MaskedBranch`: routed MLP, 32 layers x 4 branches, AdamW, a step per iteration", FUP,
        "MLP 32 AdamW vs if/else + fup", "overhead", "A routed call in a training loop", (("where", "DDP, 2 ranks"),),
        "step ratio", W_TIE),
    *_ddp("`MaskedBranch`: NAS supernet (SPOS, 12 layers x 4 ShuffleNetV2 choices)", "SPOS supernet", "nas",
          "NAS supernet DDP step", W_TIE_CONV, True),
    *_ddp("`MaskedBranch`: the demo's experts (examples/demo.py, a gate per row)", "demo", "demo",
          "The demo's expert model", W_TIE_ROWS, False),
    Row(DDP, "transformers patch: Wav2Vec2, LayerDrop 0.4", "the HF model, `find_unused_parameters=True`",
        "Wav2Vec2 LayerDrop vs HF + fup", "hf", "HF LayerDrop", (("contender", "patched p=0.4, fup=False"),),
        "step ratio*", W_HF),
    *[Row(DROP, f"`ResidualDropPath`, drop_prob {p}", "timm's `DropPath`{ideal}", f"ResidualDropPath p={p} vs timm",
          "droppath", "DropPath sweep: forward+backward", (("drop_prob", p),), "ours / timm", W_DROP0 if p == 0 else W_DROP,
          ideal="ideal (1 - p)", key=p == 0.3) for p in (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)],
    Row(TIMM, "patched ViT-S/16, eager", "timm{ideal}", "ViT-S eager vs timm", "timm", "timm train step",
        (("family", "ViT-S"),), "patched / timm*", W_TIMM, ideal="ideal", key=True),
    Row(TIMM, "patched ConvNeXt-T, eager", "timm{ideal}", "ConvNeXt-T eager vs timm", "timm", "timm train step",
        (("family", "ConvNeXt"),), "patched / timm*", W_TIMM, ideal="ideal"),
    Row(TIMM, "patched ViT-S/16, `torch.compile` (fullgraph, capture flags)", "timm compiled{ideal}",
        "ViT-S compiled vs timm", "compile", "torch.compile (inductor, fullgraph): patched timm",
        (("model", "ViT-S"), ("drop_path_rate", 0.4)), "patched / timm*", W_TIMM_COMPILED, ideal="ideal", key=True),
    Row(TIMM, "patched ConvNeXt-T, `torch.compile` (fullgraph, capture flags)", "timm compiled{ideal}",
        "ConvNeXt-T compiled vs timm", "compile", "torch.compile (inductor, fullgraph): patched timm",
        (("model", "ConvNeXt-T"), ("drop_path_rate", 0.4)), "patched / timm*", W_TIMM_COMPILED, ideal="ideal"),
    Row(TIMM, "compile time of patched ViT-S/16 (first step, empty caches)", "timm's compile time",
        "ViT-S compile time vs timm", "compile", "torch.compile (inductor, fullgraph): patched timm",
        (("model", "ViT-S"), ("drop_path_rate", 0.4)), "compile ratio", W_COMPILE_TIME, key=True),
    Row(TIMM, "compile time of patched ConvNeXt-T (first step, empty caches)", "timm's compile time",
        "ConvNeXt-T compile time vs timm", "compile", "torch.compile (inductor, fullgraph): patched timm",
        (("model", "ConvNeXt-T"), ("drop_path_rate", 0.4)), "compile ratio", W_COMPILE_TIME),
    Row(MOE, "`MaskedBranch`, eager: 4 MLP experts, top-1", "oracle: each expert on rows split beforehand",
        "MoE eager vs oracle", "masked", "MaskedBranch budget case", (), "masked / oracle*", W_ORACLE),
    Row(MOE, "`MaskedBranch`, eager: 4 MLP experts, top-1", "hand-written skip (`index_select`, expert, `index_add_`)",
        "MoE eager vs hand-written", "masked", "MaskedBranch budget case", (), "masked / hand skip*", W_HAND),
    *[Row(MOE, f"`MaskedBranch`, compiled: router + 8 MLP experts, {gate}", against, f"MoE compiled {tag} vs {short}",
          "compile", "torch.compile (inductor, fullgraph): MaskedBranch as a mixture", (("gate", gate),), column, why,
          key=tag == "top-2" and short == "hand-written")
      for gate, tag in (("top-1 (ids gate)", "top-1"), ("top-2 (weights gate)", "top-2"))
      for against, short, column, why in (
          ("oracle compiled: each expert on rows split beforehand", "oracle", "masked / oracle*", W_ORACLE),
          ("hand-written mixture (`nonzero`, `index_add`), compiled", "hand-written", "masked / hand-written*", W_HAND))],
]

HEADLINE += [
    Row(COMPILED, f"`MaskedBranch`, {form}: random depth, 8 residual MLP blocks", "if/else compiled",
        f"random depth {short} vs if/else compiled", "compile", "torch.compile (inductor, plain): random depth",
        (("masked gates", f"masked, {short} gates"),), "masked / if/else compiled*", why, key=short == "int")
    for form, short, why in (("Python int gates", "int", W_DEPTH_INT), ("0-d tensor gates", "tensor", W_DEPTH_TENSOR))
] + [
    Row(COMPILED, "`MaskedBranch`, 0-d tensor path: conv supernet 6 x 4, kernels 3/5/7/3, BatchNorm", against, short,
        "compile", "torch.compile (inductor, plain): NAS supernets", (("model", HETERO), ("masked compiled", "masked, tensor path")),
        column, why)
    for against, short, column, why in (
        ("if/else eager", "kernels 3/5/7/3 supernet vs if/else eager", "masked / if/else eager*", W_COND),
        ("one path compiled (the ideal)", "kernels 3/5/7/3 supernet vs one path", "masked / one path*", W_COND),
        ("one path's first compiled step", "kernels 3/5/7/3 supernet first step vs one path's", "first step / one path's",
         W_COND_TIME))
]

PLOTS = [  # file, what it shows (embedded where the run wrote it)
    ("headline.png", "The headline ratios (masked / contender, log scale; left of 1: masked is faster)."),
    ("ddp.png", "The DDP step of the routed MLP by approach and phase."),
    ("nas.png", "The DDP step of the NAS supernet by approach and phase."),
    ("droppath.png", "Stochastic depth: time / timm against drop_prob, with the ideal (1 - p)."),
    ("masked.png", "MaskedBranch and the other ways to route, against the oracle, by number of branches."),
    ("kernels.png", "The routing ops' bandwidth against a copy of the same bytes."),
]


def _number(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def _find(tables: Sequence[dict], row: Row) -> Tuple[Optional[dict], Optional[list]]:
    for t in tables:
        if t.get("suite") == row.suite and t["title"].startswith(row.title):
            cols = t["columns"]
            if row.column not in cols or any(c not in cols for c, _ in row.match):
                continue
            for r in t["rows"]:
                if all(_matches(r[cols.index(c)], v) for c, v in row.match):
                    return t, r
    return None, None


def _matches(cell, value) -> bool:
    if isinstance(value, re.Pattern):
        return isinstance(cell, str) and value.fullmatch(cell) is not None
    return cell == value


def measure(results: dict) -> List[dict]:
    """Per headline row: its spec, the ratio on the run's device (None: not measured), the ideal,
    and the table it came from."""
    out = []
    for spec in HEADLINE:
        t, r = _find(results.get("tables", []), spec)
        ratio = ideal = None
        if r is not None:
            ratio = _number(r[t["columns"].index(spec.column)])
            if spec.ideal and spec.ideal in t["columns"]:
                ideal = _number(r[t["columns"].index(spec.ideal)])
        out.append({"spec": spec, "ratio": ratio, "ideal": ideal, "table": t if ratio is not None else None})
    return out


def why(ratio: Optional[float], text: str) -> str:
    """The reason where masked is slower (ratio above 1), else nothing."""
    if ratio is None or ratio <= 1.0:
        return ""
    sentence = text[0].upper() + text[1:]
    if ratio <= 1.0 + SPREAD:
        sentence = sentence.rstrip(".") + f", within the run-to-run spread (about +-{SPREAD:.2f})."
    return sentence


def _cells(m: dict, device: str) -> List[str]:
    spec, ratio = m["spec"], m["ratio"]
    ideal = f" (ideal {m['ideal']:.2f})" if m["ideal"] is not None else ""
    value = "not measured" if ratio is None else f"{ratio:.2f}"
    cpu, gpu = (value, "not measured") if device == "cpu" else ("not measured", value)
    return [spec.choice, spec.against.format(ideal=ideal), cpu, gpu, why(ratio, spec.why)]


def headline_table(measured: List[dict], device: str, keys_only: bool = False) -> List[str]:
    lines = ["| Choice | Against | CPU | GPU | Why masked is slower (where it is) |", "|---|---|---|---|---|"]
    group = None
    for m in measured:
        if keys_only and not m["spec"].key:
            continue
        if m["spec"].group != group and not keys_only:
            group = m["spec"].group
            lines.append(f"| **{group}** | | | | |")
        lines.append("| " + " | ".join(_cells(m, device)) + " |")
    return lines


def _spread(results: dict) -> Optional[float]:
    """The largest difference, between the launches of one DDP suite in this run (fresh
    processes), of a headline row's step ratio."""
    worst = None
    for spec in HEADLINE:
        t, r = _find(results.get("tables", []), spec)
        if r is None or spec.column != "step ratio*" or "per launch*" not in t["columns"]:
            continue
        vals = [_number(float(v)) for v in str(r[t["columns"].index("per launch*")]).split(" / ")
                if re.fullmatch(r"[0-9.e+-]+", v.strip())]
        if len(vals) > 1:
            worst = max(worst or 0.0, max(vals) - min(vals))
    return worst


def render(results: dict, plots: Sequence[str], wall_s: Optional[float] = None) -> str:
    """The page, from a run's results (results.json's structure, with "device", "size" and
    "threads") and the names of the plots written beside it (in plots/)."""
    device = results.get("device", "cpu")
    measured = measure(results)
    threads = results.get("threads") or [2]
    checks = results.get("checks", [])
    failed = [c["check"] for c in checks if not c["ok"]]
    wall = f"; wall time {wall_s / 60:.0f} min" if wall_s else ""
    spread = _spread(results)
    lines = [
        "# Results",
        "",
        f"- Date: {results['date']}",
        f"- torch {results['torch']}, maskedbranch {results['maskedbranch']}, Python {results['python']}",
        f"- Machine: {results['machine']}",
        f"- Device: {'CPU (no GPU has run these suites)' if device == 'cpu' else 'GPU'}",
        f"- Command: `{results['command']}` ({results.get('size', 'quick')} sizes{wall})",
        "",
        "Each ratio is masked (maskedbranch's module or patch) / contender, the same step timed side by side: "
        "**below 1, masked is faster**. Rows a run did not measure say so.",
        "",
        "## Headline",
        "",
        *headline_table(measured, device),
        "",
        "## How the ratios are measured",
        "",
        "- **Interleaved.** The contenders of one configuration run in one process, one after the other within each "
        "repetition, the order rotating from repetition to repetition, so that they share the machine's state. DDP "
        "steps interleave step by step in each rank, with a barrier before every step, over fresh launches.",
        "- **Ratios** are medians over repetitions of the per-repetition ratio masked / contender; absolute times "
        "are never the claim.",
        f"- **Threads.** One-process suites at {threads[0]} intra-op thread{'s' if threads[0] > 1 else ''}, "
        f"{'wall clock' if threads[0] > 1 else 'the thread CPU time'}; DDP suites on gloo ranks of one thread each, "
        "wall clock; compile times are the first compiled step from empty inductor caches.",
        f"- **Spread.** Two runs of a ratio on a quiet 2-core machine differ by about +-{SPREAD:.2f}"
        + (f"; the headline's DDP ratios differed by up to {spread:.2f} between the launches (fresh processes) of "
           "this run." if spread is not None else "."),
        f"- **Checks.** Contenders that must compute the same thing are compared ({len(checks) - len(failed)} of "
        f"{len(checks)} checks held{': failed ' + '; '.join(failed) if failed else ''}).",
        "- **GPU.** `bash benchmarks/gpu_check.sh` runs the suites on a GPU; the GPU column fills from such a run.",
        "",
        "## Sizes",
        "",
    ]
    seen = []
    for m in measured:
        t = m["table"]
        if t is not None and t["title"] not in seen:
            seen.append(t["title"])
            lines.append(f"- `{t['suite']}`: {t['title']}")
    for n in results.get("notes", []):
        lines.append(f"- note: {n}")
    lines += ["", "Every table of the run (all contenders, phases, settings): the same command writes them to "
              f"`{results.get('out', 'results/page')}/results.md`.", "", "## Plots", ""]
    for name, caption in PLOTS:
        if name in plots:
            lines += [f"![{name[:-4]}](plots/{name})", "", caption, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def readme_block(results: dict, page_link: str, plot_link: str) -> str:
    """The README's excerpt: the key rows and the headline plot, between the markers."""
    device = results.get("device", "cpu")
    measured = measure(results)
    return "\n".join([
        f"{BEGIN} (written by `python -m benchmarks --page`) -->",
        f"Measured on {results['date'][:10]}, {'CPU' if device == 'cpu' else 'GPU'} ({results['machine'].split(';')[0]}): "
        f"masked / contender, below 1 masked is faster. Every row, and how it is measured: [{page_link}]({page_link}).",
        "",
        *headline_table(measured, device, keys_only=True),
        "",
        f"![The headline ratios]({plot_link})",
        END,
    ])


def replace_block(text: str, block: str) -> Optional[str]:
    """``text`` with the part between the markers replaced by ``block`` (None: no markers)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[:start] + block + text[end + len(END):]


def plot_rows(measured: List[dict]) -> List[Tuple[str, float]]:
    return [(m["spec"].short, m["ratio"]) for m in measured if m["ratio"] is not None]


def missing(results: dict) -> List[str]:
    """Headline rows whose suite ran but gave no ratio (a renamed table, row or column)."""
    ran = {t.get("suite") for t in results.get("tables", [])}
    return [m["spec"].short for m in measure(results) if m["ratio"] is None and m["spec"].suite in ran]


def publish(results: dict, out: pathlib.Path, page_dir: pathlib.Path, readme: Optional[pathlib.Path]) -> pathlib.Path:
    """Writes ``page_dir``/RESULTS.md and its plots (``page_dir``/plots: the run's plots from
    ``out`` and the headline plot), and the README's excerpt between its markers (``readme``
    None: into ``page_dir``/readme-excerpt.md instead). Returns the page's path."""
    from .plots import headline

    plots_dir = page_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    measured = measure(results)
    headline(plots_dir / "headline.png", plot_rows(measured))
    names = ["headline.png"]
    for name, _ in PLOTS[1:]:
        if (out / name).exists():
            if (out / name).resolve() != (plots_dir / name).resolve():
                shutil.copyfile(out / name, plots_dir / name)
            names.append(name)
    text = render(results, names, results.get("wall_s"))
    if text.count("\n") > MAX_LINES:
        raise RuntimeError(f"the results page has {text.count(chr(10))} lines, more than {MAX_LINES}")
    page = page_dir / "RESULTS.md"
    page.write_text(text)
    if readme is None:
        (page_dir / "readme-excerpt.md").write_text(readme_block(results, "RESULTS.md", "plots/headline.png") + "\n")
    else:
        rel = page_dir.resolve().relative_to(readme.resolve().parent).as_posix()
        new = replace_block(readme.read_text(), readme_block(results, f"{rel}/RESULTS.md", f"{rel}/plots/headline.png"))
        if new is None:
            raise RuntimeError(f"{readme.name} has no {BEGIN} ... {END} markers to write the excerpt between")
        readme.write_text(new)
    return page


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m benchmarks.page", description="The results page and the README's "
                                 "excerpt, written again from a run's results.json (nothing measured).")
    ap.add_argument("results", nargs="?", default="results/page/results.json")
    args = ap.parse_args(argv)
    path = pathlib.Path(args.results)
    root = pathlib.Path(__file__).resolve().parents[1]
    print(publish(json.loads(path.read_text()), path.parent, root / "benchmarks", root / "README.md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
