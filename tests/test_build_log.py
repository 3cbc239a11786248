"""The build log says why the CUDA kernels are or are not built (setup.py's decision).

`setup.py --version` decides and prints without compiling anything."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="needs the source tree")


def _decision(**env):
    clean = {k: v for k, v in os.environ.items() if k not in ("FORCE_CUDA", "MASKEDBRANCH_CPU_ONLY", "CUDA_HOME", "CUDA_PATH")}
    clean.update(env)
    run = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=clean, capture_output=True, text=True)
    return run.returncode, run.stdout + run.stderr


def test_cpu_only_names_the_knob():
    rc, out = _decision(MASKEDBRANCH_CPU_ONLY="1")
    assert rc == 0, out
    assert "maskedbranch: building CPU kernels only (MASKEDBRANCH_CPU_ONLY=1)" in out


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU-only build of torch")
def test_cpu_torch_names_the_torch_build():
    rc, out = _decision()
    assert rc == 0, out
    assert f"maskedbranch: building CPU kernels only (torch {torch.__version__} is a CPU-only build)" in out


def _setup_functions(monkeypatch):
    """setup.py's functions, with setuptools.setup made a no-op (nothing is built)."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.setenv("MASKEDBRANCH_CPU_ONLY", "1")  # what running the file decides and prints
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")


def test_no_toolkit_is_named_as_the_reason(monkeypatch):
    decide = _setup_functions(monkeypatch)["cuda_decision"]
    monkeypatch.delenv("MASKEDBRANCH_CPU_ONLY")
    monkeypatch.delenv("FORCE_CUDA", raising=False)
    with_cuda, reason = decide(None)
    assert not with_cuda
    if torch.version.cuda is None:
        assert reason == f"torch {torch.__version__} is a CPU-only build"
    else:
        assert reason.startswith("no CUDA toolkit found") and "nvcc is not on PATH" in reason
        assert decide("/opt/toolkit") == (True, "torch is a CUDA build and /opt/toolkit has nvcc")
    monkeypatch.setenv("FORCE_CUDA", "1")
    with pytest.raises(SystemExit, match="FORCE_CUDA=1 but no CUDA toolkit was found"):
        decide(None)
    assert decide("/opt/toolkit") == (True, "FORCE_CUDA=1")
