"""examples/demo.py (what `bash scripts/demo.sh` runs): its closing comparison of MaskedBranch with
if/else + find_unused_parameters=True states the measured ratio and which one was faster,
whichever way it came out; a short run on two gloo ranks ends with DEMO PASS."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import maskedbranch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "demo.py")


def load_demo():
    spec = importlib.util.spec_from_file_location("maskedbranch_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("masked_ms, ifelse_ms, faster, ratio", [
    (10.0, 11.0, "MaskedBranch", "1.10"),    # MaskedBranch faster
    (11.0, 10.0, "(a) if/else", "1.10"),     # if/else + find_unused_parameters=True faster
    (10.0, 25.0, "MaskedBranch", "2.50"),
    (30.0, 10.0, "(a) if/else", "3.00"),
])
def test_comparison_names_the_faster_one_and_the_ratio(masked_ms, ifelse_ms, faster, ratio):
    line = load_demo().speed_comparison(masked_ms, ifelse_ms)
    assert f"{masked_ms:.1f} ms" in line and f"{ifelse_ms:.1f} ms" in line
    assert re.search(rf": {re.escape(faster)}[^:]* was {ratio}x as fast as ", line), line
    assert ("noise" in line) == (float(ratio) < 1.05)


def test_comparison_close_and_equal():
    demo = load_demo()
    line = demo.speed_comparison(10.0, 10.3)
    assert "MaskedBranch (find_unused_parameters=False) was 1.03x as fast as" in line and "noise" in line
    assert demo.speed_comparison(10.0, 10.0).endswith("equal on this run")


def test_demo_runs_and_prints_the_comparison():
    """Two CPU ranks, a small model: the table, the measured comparison, DEMO PASS."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(maskedbranch.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p),
               OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", DEMO, "--cpu",
         "--epochs", "1", "--steps-per-epoch", "4", "--batch-size", "32", "--dim", "16"],
        capture_output=True, text=True, timeout=300, env=env, cwd=os.path.dirname(DEMO))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "DEMO PASS" in out, out
    line = next(l for l in out.splitlines() if l.startswith("step time"))
    assert re.search(r"(MaskedBranch|\(a\) if/else)[^:]* (was [0-9.]+x as fast as|equal on this run)", line), line
