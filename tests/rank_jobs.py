"""Run a worker on several real processes (spawned, as torchrun would start them) and collect
what each rank saved. Shared by the multi-process tests; the worker is
``worker(rank, world, init_file, out_dir)`` and saves its result to ``out_dir/rank{rank}.pt``."""
import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp


def run_ranks(worker, world, timeout_s, what="the job"):
    """Per-rank results of ``worker`` on ``world`` processes; fails the test (and terminates the
    processes) when they do not finish within ``timeout_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(worker, args=(world, init_file, tmp), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    pytest.fail(f"{what} did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def results_of(ranks, name):
    """What every rank recorded for scenario ``name`` as ("ok", value) or ("error", traceback):
    the values, after asserting that no rank failed."""
    out = []
    for r, res in enumerate(ranks):
        status, value = res[name]
        assert status == "ok", f"rank {r}, {name}:\n{value}"
        out.append(value)
    return out
