"""Train-step time of timm models patched by ``maskedbranch.integrations.timm`` against timm's own.

    python benchmarks/bench_timm_families.py                         # every family, drop_path_rate 0.4
    python benchmarks/bench_timm_families.py --families vit,convnext --rates 0.1,0.2,0.4
    python benchmarks/bench_timm_families.py --out results/timm_families.md

One row per family and drop_path_rate: whether ``patch`` converts the model (or why not), the
step-time ratio patched / timm, and the ideal ratio. A step is forward + backward + SGD step of a
random batch (``--batch``, the family's image size) in training mode. Not run in CI.

Method. timm's model and the patched copy (same weights) alternate, step after step, with the
same seed before each step (so the same masks); the median over ``--steps`` steps after
``--warmup`` counts. ``--clock cpu`` (default) measures the process's CPU time with one intra-op
thread (``--threads``): on a machine shared with other work, elapsed time mostly measures the
others.

Ideal. A block's drop-path branches cost, to first order, their share of the model's FLOPs
(``torch.utils.flop_counter``, per block) and a block whose samples are kept with probability
``k`` needs ``k`` of it. With ``T_rest`` the patched step with every sample dropped (the model
without its branches, routing included) and ``f = sum_b k_b F_b / sum_b F_b``:
``ideal = (T_rest + f (T_timm - T_rest)) / T_timm``.

BatchNorm. A branch holding a BatchNorm that uses batch statistics runs on every sample by
default (timm's numbers): for those families the table also shows ``batch_norm="kept"`` (routed;
the BatchNorm normalizes over the kept samples) and the default with the BatchNorms frozen.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import timm
from timm.layers import DropPath

from maskedbranch.integrations import timm as mb_timm

#: family -> (timm model name, create_model kwargs, image size). Small variants at a reduced
#: resolution where the model allows it, so that a CPU run takes minutes.
FAMILIES: Dict[str, Tuple[str, dict, int]] = {
    "vit": ("vit_small_patch16_224", dict(img_size=112), 112),
    "deit": ("deit_small_patch16_224", dict(img_size=112), 112),
    "convnext": ("convnext_tiny", {}, 112),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=128, window_size=4), 128),
    "swinv2": ("swinv2_tiny_window8_256", dict(img_size=128, window_size=4), 128),
    "resnet": ("resnet50", {}, 112),
    "efficientnet": ("efficientnet_b0", {}, 112),
    "mobilenetv3": ("mobilenetv3_large_100", {}, 112),
    "eva": ("eva02_small_patch14_224", dict(img_size=112), 112),
    "cait": ("cait_xxs24_224", dict(img_size=112), 112),
    "maxvit": ("maxvit_nano_rw_256", dict(img_size=128), 128),
    "coatnet": ("coatnet_nano_rw_224", dict(img_size=128), 128),
    "poolformer": ("poolformer_s12", {}, 112),
    "convformer": ("convformer_s18", {}, 112),
    "efficientformer": ("efficientformer_l1", {}, 224),
    "hiera": ("hiera_tiny_224", {}, 224),
    "regnetz": ("regnetz_b16", {}, 112),
    "edgenext": ("edgenext_small", {}, 112),
    "tiny_vit": ("tiny_vit_5m_224", {}, 224),
    "pvt_v2": ("pvt_v2_b1", {}, 112),
    "beit": ("beit_base_patch16_224", dict(img_size=112), 112),
    "mvitv2": ("mvitv2_tiny", {}, 224),  # timm's own mvitv2 fails at img_size=112 (relative positions)
    "focalnet": ("focalnet_tiny_srf", {}, 112),
    "fastvit": ("fastvit_t8", {}, 112),
    "resnest": ("resnest14d", {}, 112),  # refused: its drop path drops the block input
}

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def clock(kind: str) -> Callable[[], float]:
    return time.process_time if kind == "cpu" else time.perf_counter


def step_fn(model: nn.Module, x: torch.Tensor) -> Callable[[int], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay those of timm's

    def step(seed: int) -> None:
        torch.manual_seed(seed)
        out = model(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(steps: Dict[str, Callable[[int], None]], n: int, warmup: int, now: Callable[[], float]) -> Dict[str, float]:
    """Median time of each contender, run in alternation with the same seed per round."""
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for i in range(warmup + n):
        for name, step in (steps.items() if i % 2 == 0 else reversed(list(steps.items()))):
            t = now()
            step(i)
            if i >= warmup:
                times[name].append(now() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def kept_flop_fraction(model: nn.Module, x: torch.Tensor) -> float:
    """sum_b (1 - p_b) F_b / sum_b F_b over the blocks owning a drop path (forward FLOPs)."""
    owners = {n: m for n, m in model.named_modules() if any(isinstance(c, DropPath) for c in m.children())}
    model.eval()
    with FlopCounterMode(display=False) as counter:  # (not under no_grad: its module tracker fails there)
        model(x[:1])
    counts = counter.get_flop_counts()
    root = type(model).__name__
    num = den = 0.0
    for name, block in owners.items():
        flops = sum(counts.get(f"{root}.{name}", {}).values())
        probs = [c.drop_prob for c in block.children() if isinstance(c, DropPath)]
        num += flops * (1.0 - sum(probs) / len(probs))
        den += flops
    return num / den if den else 1.0


def set_drop_prob(model: nn.Module, p: Optional[float], saved: Dict[str, float]) -> None:
    for name, m in model.named_modules():
        if isinstance(m, DropPath):
            saved.setdefault(name, m.drop_prob)
            m.drop_prob = saved[name] if p is None else p


def freeze(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, BATCH_NORMS):
            m.eval()
    return model


def bench(family: str, rate: float, args) -> dict:
    name, kw, size = FAMILIES[family]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, drop_path_rate=rate, **kw)
    x = torch.randn(args.batch, 3, size, size)
    row = {"family": family, "model": f"{name} @{size}", "rate": rate}
    patched = copy.deepcopy(model)
    try:
        report = mb_timm.patch(patched, strict=False)
    except ValueError as e:
        return {**row, "status": f"refused: {e}"}
    if not len(report):
        return {**row, "status": "refused: " + "; ".join(sorted({w.split(": ", 2)[-1] for w in report.skipped.values()}))}
    has_bn = any(isinstance(m, BATCH_NORMS) for m in model.modules()) and any("BatchNorm" in v for v in report.notes.values())
    row["status"] = f"converted {len(report)} blocks" + (f", {len(report.skipped)} skipped" if report.skipped else "")
    kept = kept_flop_fraction(copy.deepcopy(model), x)
    now = clock(args.clock)
    model.train(), patched.train()
    contenders = {"timm": step_fn(model, x), "patched": step_fn(patched, x)}
    if has_bn:
        kept_bn = copy.deepcopy(patched)
        mb_timm.patch(kept_bn, strict=False, batch_norm="kept")
        frozen_timm, frozen = freeze(copy.deepcopy(model)), freeze(copy.deepcopy(patched))
        contenders.update({"kept": step_fn(kept_bn, x), "timm_frozen": step_fn(frozen_timm, x), "frozen": step_fn(frozen, x)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = timed(contenders, args.steps, args.warmup, now)
    row["warnings"] = sorted({str(w.message)[:160] for w in caught if "maskedbranch" in str(w.message)})
    saved: Dict[str, float] = {}
    rest_model = freeze(copy.deepcopy(patched)) if has_bn else patched
    set_drop_prob(rest_model, 1.0, saved)
    t_rest = timed({"rest": step_fn(rest_model, x)}, max(3, args.steps // 2), 1, now)["rest"]
    base = t["timm_frozen"] if has_bn else t["timm"]
    ideal = (t_rest + kept * (base - t_rest)) / base
    row.update(t_timm=t["timm"], ratio=t["patched"] / t["timm"], ideal=ideal, kept=kept)
    if has_bn:
        row.update(ratio_kept=t["kept"] / t["timm"], ratio_frozen=t["frozen"] / t["timm_frozen"])
    return row


def table(rows: List[dict]) -> str:
    lines = [
        "| family | model @ image | drop_path_rate | status | timm step ms | patched / timm | ideal | "
        "batch_norm='kept' / timm | frozen BN: patched / timm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "ratio" not in r:
            lines.append(f"| {r['family']} | {r['model']} | {r['rate']} | {r['status']} | | | | | |")
            continue
        bn = (f"{r['ratio_kept']:.2f}", f"{r['ratio_frozen']:.2f}") if "ratio_kept" in r else ("", "")
        lines.append(
            f"| {r['family']} | {r['model']} | {r['rate']} | {r['status']} | {r['t_timm'] * 1e3:.0f} | "
            f"{r['ratio']:.2f} | {r['ideal']:.2f} | {bn[0]} | {bn[1]} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, from: " + ", ".join(FAMILIES))
    p.add_argument("--rates", default="0.4", help="drop_path_rate values, comma-separated")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = p.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--batch, --steps and --threads must be at least 1, --warmup at least 0")
    torch.set_num_threads(args.threads)
    rows = []
    for family in families:
        for rate in (float(r) for r in args.rates.split(",")):
            try:
                rows.append(bench(family, rate, args))
            except Exception as e:  # noqa: BLE001 - one family's failure is a row of the table
                rows.append({"family": family, "model": FAMILIES[family][0], "rate": rate, "status": f"error: {type(e).__name__}: {e}"})
            r = rows[-1]
            print(f"{family} {rate}: {r['status']}" + (f" ratio {r['ratio']:.2f} ideal {r['ideal']:.2f}" if "ratio" in r else ""), flush=True)
            for w in r.get("warnings", []):
                print(f"  warning: {w}", flush=True)
    header = (
        f"timm train-step ratio, {datetime.date.today()}, {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, timm {timm.__version__}, batch {args.batch}, {args.threads} thread(s), {args.clock} "
        f"clock, median of {args.steps} steps\n\n"
    )
    text = header + table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
