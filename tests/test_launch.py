"""Real launches with torchrun (CPU, gloo):

* two nodes on loopback: two torchrun agents (--nnodes=2, c10d rendezvous on 127.0.0.1, two
  processes each) run examples/masked_after.py (small), which checks the reference case's
  averaged gradients on every rank (for the world size it runs on) and bitwise-identical
  replicas after a DistributedSampler training, and prints PASS;
* a fault: rank 1 raises inside a branch (tests/launch_scripts/fault.py); torchrun must end the
  job with a non-zero status well before the timeout and report the failure.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import pytest
import torch.distributed as dist

SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 180

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's connections on loopback too
    return env


def torchrun(*args: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--max_restarts=0", "--monitor_interval=0.5", *args]


def run_all(commands: List[List[str]], cwd: Path) -> List[Tuple[int, str, float]]:
    """Start every command, wait for all of them (killing everything at TIMEOUT_S); return
    (exit status, output, seconds) per command."""
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(c, cwd=cwd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
        for c in commands
    ]
    results = []
    try:
        for p in procs:
            left = max(1.0, TIMEOUT_S - (time.monotonic() - t0))
            try:
                out, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                try:
                    out, _ = p.communicate(timeout=10)
                except subprocess.TimeoutExpired:  # a worker outside the agent's group holds the pipe
                    p.stdout.close()
                    out = "(no output: a worker of the killed agent still held its pipe)"
                pytest.fail(f"{' '.join(p.args)} did not finish within {TIMEOUT_S} s; output:\n{out[-6000:]}")
            results.append((p.returncode, out, time.monotonic() - t0))
    finally:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
    return results


def test_two_nodes_on_loopback_run_the_example(tmp_path):
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=maskedbranch-launch-test",
        "--local_addr=127.0.0.1",
    ]
    script = [str(EXAMPLES / "masked_after.py"), "--cpu", "--epochs=1", "--samples=1024", "--batch-size=64"]
    results = run_all(
        [torchrun(*common, "--node_rank=0", *script), torchrun(*common, "--node_rank=1", *script)], cwd=tmp_path
    )
    every = "\n".join(f"--- node {n} (exit {rc}):\n{out[-5000:]}" for n, (rc, out, _) in enumerate(results))
    for node, (rc, out, _) in enumerate(results):
        assert rc == 0, f"node {node}: torchrun exited with {rc}; the output of both nodes:\n{every}"
    outputs = "\n".join(out for _, out, _ in results)
    assert outputs.count("== after: MaskedBranch, 4 ranks, gloo on cpu ==") == 1, outputs[-6000:]
    assert outputs.count("on every rank): PASS") == 3 and "FAIL" not in outputs, outputs[-6000:]
    assert outputs.count("masked_after: PASS") == 1, outputs[-6000:]


def test_a_rank_raising_inside_a_branch_ends_the_job(tmp_path):
    script = str(SCRIPTS / "fault.py")
    (rc, out, seconds), = run_all([torchrun("--standalone", "--nproc_per_node=3", script)], cwd=tmp_path)
    assert rc != 0, f"torchrun exited with 0 although rank 1 failed; output:\n{out[-6000:]}"
    # torchrun's failure summary names the failing rank as the root cause, with its exception
    assert "ChildFailedError" in out, out[-6000:]
    root = out.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2, out[-6000:]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root[1]), root[1][:3000]
    assert "RuntimeError: injected failure inside a branch on rank 1 at step 3" in root[1], root[1][:6000]
    # the other ranks did not go on past the failing step, and nothing hung until the timeout
    assert "rank 1: step 3 done" not in out
    assert "step 5 done" not in out
    assert seconds < TIMEOUT_S / 2, f"the job took {seconds:.0f} s to end"
