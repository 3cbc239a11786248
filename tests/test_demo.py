"""examples/demo.py (what `bash scripts/demo.sh` runs): its closing comparison of MaskedBranch with
if/else + find_unused_parameters=True states the measured ratio and which one was faster,
whichever way it came out (`bash scripts/demo.sh` runs it end to end; CI does not)."""
import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "demo.py")


def load_demo():
    """examples/demo.py as torchrun loads it: its folder first on the path (for examples/_ranks.py)."""
    spec = importlib.util.spec_from_file_location("maskedbranch_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(DEMO))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(DEMO))
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

