"""Entry point: python -m benchmarks [--page] [--smoke | --quick] [--only SUITES] [--device cpu|cuda] [--threads 2,1] [--out DIR]

Writes results.md (markdown tables), results.json and PNG plots into the results folder; exits
with status 1 when a check (contenders that must compute the same thing) fails. ``--page``
runs what the results page needs and writes it: benchmarks/RESULTS.md, benchmarks/plots/ and the
README's excerpt (benchmarks/page.py); ``--page --smoke`` writes them into the results folder.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import platform
import sys
import time

SUITES = ["masked", "overhead", "ddp", "nas", "droppath", "kernels", "timm", "hf", "compile", "demo"]
ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPILE_CASES = ["timm", "timm-plain", "supernets", "moe", "depth", "conv-supernets", "hetero-supernet", "timm-cold"]  # the first five by default


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{cpu}, {os.cpu_count()} cores{load}"


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes and few repetitions (minutes)")
    size.add_argument("--smoke", action="store_true",
                      help="tiny sizes, one or two repetitions: runs every suite end to end and checks the contenders "
                           "(a minute or two; the timings mean nothing)")
    ap.add_argument("--page", action="store_true",
                    help="the results page: the suites its headline reads (quick sizes unless --smoke; --threads 2; "
                         "the compile suite's timm, moe, depth and hetero-supernet cases, at drop_path_rate 0.4, without the ideal), then "
                         "benchmarks/RESULTS.md, benchmarks/plots/ and the README's excerpt from them (with --smoke: "
                         "RESULTS.md, plots/ and readme-excerpt.md in the results folder, the repository untouched)")
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(SUITES))
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, help="results folder (default results/<device>[-quick|-smoke])")
    ap.add_argument("--threads", default=None,
                    help="CPU thread settings, comma-separated (default 2,1). Comparisons run at each: T > 1 timed "
                         "by wall clock, T = 1 by the thread's CPU time; sweeps run at the first; kernels at each, by "
                         "wall clock")
    ap.add_argument("--ddp-ranks", type=int, default=None,
                    help="world size of the DDP suites (default 2 on CPU, 1 on a GPU)")
    ap.add_argument("--compile-cases", default=None,
                    help="comma-separated cases of the compile suite (default: timm,timm-plain,supernets,moe,depth; "
                         "conv-supernets: the supernets less the ShuffleNetV2 one, whose conds take most of the time; "
                         "hetero-supernet: only the conv supernet of kernels 3/5/7/3; "
                         "timm-cold: timm's and patched timm's first compiled step from empty caches)")
    args = ap.parse_args(argv)
    if args.page:  # what the page reads, unless set
        from . import page

        args.quick = not args.smoke
        args.only = args.only or ",".join(page.SUITES)
        args.compile_cases = args.compile_cases or ",".join(page.COMPILE_CASES)
        args.threads = args.threads or "2"
        args.compile_rates, args.compile_ideal = page.COMPILE_RATES, False
    args.only = args.only or ",".join(SUITES)
    args.compile_cases = args.compile_cases or ",".join(COMPILE_CASES[:5])
    args.threads = args.threads or "2,1"
    try:
        args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--threads: expected comma-separated thread counts, got {args.threads!r}")
    if not args.threads or min(args.threads) < 1:
        ap.error(f"--threads: expected thread counts of at least 1, got {args.threads}")
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    for s in args.only:
        if s not in SUITES:
            ap.error(f"--only: unknown suite {s!r} (choose from {', '.join(SUITES)})")
    args.compile_cases = [c.strip() for c in args.compile_cases.split(",") if c.strip()]
    for c in args.compile_cases:
        if c not in COMPILE_CASES:
            ap.error(f"--compile-cases: unknown case {c!r} (choose from {', '.join(COMPILE_CASES)})")
    if args.ddp_ranks is not None and args.ddp_ranks < 1:
        ap.error(f"--ddp-ranks: expected at least 1, got {args.ddp_ranks}")
    return ap, args


def main(argv=None) -> int:
    ap, args = parse(argv)
    import torch

    import maskedbranch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.ddp_ranks is not None and args.device == "cuda" and args.ddp_ranks > torch.cuda.device_count():
        ap.error(f"--ddp-ranks: {args.ddp_ranks} NCCL ranks need as many GPUs; {torch.cuda.device_count()} visible")
    args.size = "smoke" if args.smoke else "quick" if args.quick else "full"
    from . import keep_freed_memory_mapped, markdown, table

    heap_kept = args.device == "cpu" and keep_freed_memory_mapped()
    torch.set_num_threads(args.threads[0])
    default_out = f"page{'-smoke' if args.smoke else ''}" if args.page else \
        f"{args.device}{'' if args.size == 'full' else '-' + args.size}"
    out = pathlib.Path(args.out or f"results/{default_out}")
    out.mkdir(parents=True, exist_ok=True)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None

    def progress(it, desc=""):
        it = list(it)
        return tqdm(it, desc=desc, file=sys.stderr, leave=False) if tqdm else it

    args.out, args.progress, args.checks, args.notes = out, progress, [], []
    started = time.perf_counter()
    command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(args.device) + ("; freed memory kept mapped (no page faults once warm)" if heap_kept else ""),
        "torch": torch.__version__,
        "maskedbranch": maskedbranch.__version__,
        "python": platform.python_version(),
        "command": command.strip(),
    }
    tables, walls = [], {}
    routable = args.device == "cpu" or maskedbranch.WITH_CUDA
    for s in args.only:
        if not routable:
            args.notes.append(f"{s}: skipped on cuda: this maskedbranch build has no CUDA kernels")
            continue
        t0 = time.perf_counter()
        for t in importlib.import_module(f"benchmarks.suite_{s}").run(args):
            t["suite"] = s
            t["command"] = f"python -m benchmarks --only {s}" + (f" --{args.size}" if args.size != "full" else "")
            if s == "compile" and args.compile_cases != COMPILE_CASES[:5]:
                t["command"] += " --compile-cases " + ",".join(args.compile_cases)
            tables.append(t)
        walls[s] = time.perf_counter() - t0
        print(f"[{s}: {walls[s]:.0f} s]", file=sys.stderr, flush=True)
    failed = [c for c in args.checks if not c["ok"]]
    checks = table(f"Checks: contenders that must compute the same thing ({len(args.checks) - len(failed)} of "
                   f"{len(args.checks)} hold)", ["check", "max abs diff", "tolerance", "holds"],
                   [[c["check"], c["max abs diff"], c["tolerance"], c["ok"]] for c in args.checks])
    md = [f"# maskedbranch benchmarks ({args.device}, {args.size})", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += ["- wall time per suite: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items())]
    md += [f"- note: {n}" for n in args.notes] + [""]
    md += [markdown(t) for t in tables] + [markdown(checks)]
    (out / "results.md").write_text("\n".join(md))
    results = {**header, "device": args.device, "size": args.size, "threads": args.threads, "out": out.as_posix(),
               "wall_s": time.perf_counter() - started, "walls_s": walls,
               "notes": args.notes, "checks": args.checks, "tables": tables}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(md))
    print(f"\nwrote {out}/results.md, results.json and PNG plots", file=sys.stderr)
    if args.page:
        from . import page

        # The page from the numbers as results.json holds them (what a rerun of the page reads).
        results = json.loads((out / "results.json").read_text())
        lost = page.missing(results)
        written = page.publish(results, out, out if args.smoke else ROOT / "benchmarks",
                               None if args.smoke else ROOT / "README.md")
        print(f"wrote {written}, its plots and the README's excerpt", file=sys.stderr)
        if lost:  # a suite ran but a headline row found no number: a table, row or column renamed
            print("headline rows without a number: " + "; ".join(lost), file=sys.stderr)
            return 1
    if failed:
        print(f"{len(failed)} check(s) FAILED: " + "; ".join(c["check"] for c in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file path (e.g. by a loop over benchmarks/*.py): nothing to do
        print("run the suite as a module: python -m benchmarks [--smoke | --quick]")
        raise SystemExit(0)
    raise SystemExit(main())
