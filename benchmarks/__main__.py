"""Entry point: python -m benchmarks [--quick] [--only masked,ddp,droppath,kernels,hf] [--device cpu|cuda] [--out DIR]

Writes results.md (markdown tables), results.json and PNG plots into the results folder.
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

SUITES = ["masked", "ddp", "droppath", "kernels", "hf"]


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except Exception:
        pass
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{cpu}, {os.cpu_count()} cores{load}, {torch.get_num_threads()} torch threads"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few repetitions")
    ap.add_argument("--only", default=",".join(SUITES), help="comma-separated subset of " + ",".join(SUITES))
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, help="results folder (default results/<device>[-quick])")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1: steadier on a shared machine)")
    ap.add_argument("--ddp-ranks", type=int, default=None,
                    help="DDP suite world size (default 2 on CPU, 1 on a GPU; 1 on CPU shows each approach's own "
                         "cost without a second rank's all-reduce noise)")
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from . import keep_freed_memory_mapped

    heap_kept = args.device == "cpu" and keep_freed_memory_mapped()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.ddp_ranks is not None and args.ddp_ranks < 1:
        ap.error(f"--ddp-ranks: expected at least 1, got {args.ddp_ranks}")
    if args.ddp_ranks is not None and args.device == "cuda" and args.ddp_ranks > torch.cuda.device_count():
        ap.error(f"--ddp-ranks: {args.ddp_ranks} NCCL ranks need as many GPUs; {torch.cuda.device_count()} visible")
    for s in only:
        if s not in SUITES:
            ap.error(f"--only: unknown suite {s!r} (choose from {', '.join(SUITES)})")
    out = pathlib.Path(args.out or f"results/{args.device}{'-quick' if args.quick else ''}")
    out.mkdir(parents=True, exist_ok=True)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None

    def progress(it, desc=""):
        it = list(it)
        return tqdm(it, desc=desc, file=sys.stderr, leave=False) if tqdm else it

    args.out, args.progress = out, progress
    command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(args.device) + ("; freed memory kept mapped (no page faults once warm)" if heap_kept else ""),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command.strip(),
    }
    tables, walls = [], {}
    for s in only:
        t0 = time.perf_counter()
        mod = importlib.import_module(f"benchmarks.suite_{s}")
        for t in mod.run(args):
            t["suite"] = s
            t["command"] = " ".join(w for w in command.replace(f"--only {args.only}", "").split()) + f" --only {s}"
            tables.append(t)
            print(f"\n### {t['title']}\n", flush=True)
        walls[s] = time.perf_counter() - t0
        print(f"[{s}: {walls[s]:.0f} s]", file=sys.stderr, flush=True)
    from . import markdown

    md = [f"# maskedbranch benchmarks ({args.device}{', --quick' if args.quick else ''})", ""]
    md += [f"- {k}: {v}" for k, v in header.items()]
    md += [f"- wall time per suite: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()), ""]
    md += [markdown(t) for t in tables]
    (out / "results.md").write_text("\n".join(md))
    (out / "results.json").write_text(json.dumps({**header, "walls_s": walls, "tables": tables}, indent=1, default=str))
    print("\n".join(md))
    print(f"\nwrote {out}/results.md, results.json and PNG plots", file=sys.stderr)


if __name__ == "__main__":
    if not __package__:  # run as a file path (e.g. by a loop over benchmarks/*.py): nothing to do
        print("run the suite as a module: python -m benchmarks [--quick]")
        raise SystemExit(0)
    main()
