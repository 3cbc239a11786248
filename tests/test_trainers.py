"""The trainer examples, launched as users launch them (2 CPU processes, gloo, loopback), each with
--compare: the reference run (HF's model, or the if/else model, with find_unused_parameters=True)
and then the maskedbranch run with the trainer's plain DDP setting, in the same processes.

* HF Trainer (torchrun): examples/hf_trainer_layerdrop.py, a patched Wav2Vec2 with
  ``ddp_find_unused_parameters=False``;
* Accelerate (``accelerate launch --multi_gpu``, which starts CPU processes too): examples/accelerate_layerdrop.py, a patched BART with
  ``DistributedDataParallelKwargs(find_unused_parameters=False)``;
* Lightning (torchrun): examples/lightning_masked_branch.py, MaskedBranch experts with
  ``strategy="ddp"`` (Lightning's automatic optimization steps with a closure).

Each checks, from the records every rank saves: the gradients of every step equal the reference
run's (a missing gradient counts as zeros) and are the same on both ranks, and the parameters after
the last step (AdamW with weight decay: a zero gradient where the reference has none would move
them) equal the reference's. The draws must have differed across ranks in some step and left some
layer unused by every rank in another, or the check would prove nothing.
"""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from test_launch import free_port, run_all, torchrun

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
]


def launch(command, tmp_path):
    (rc, out, _), = run_all([command], cwd=tmp_path)
    assert rc == 0, f"{' '.join(command)} exited with {rc}; output:\n{out[-6000:]}"
    return [torch.load(tmp_path / f"records.rank{r}.pt", weights_only=False) for r in range(2)], out


def check(ranks, layered=True):
    for r, records in enumerate(ranks):
        want, got = records["reference"], records["patched"]
        params = want["params"]
        assert len(got["grads"]) == len(want["grads"]) > 0
        for s, (a, b) in enumerate(zip(want["grads"], got["grads"])):
            for n, p in params.items():
                ga = torch.zeros_like(p) if a[n] is None else a[n]
                gb = torch.zeros_like(p) if b[n] is None else b[n]
                torch.testing.assert_close(gb, ga, rtol=0, atol=0, msg=f"rank {r} step {s} {n}")
                other = ranks[1 - r]["patched"]["grads"][s][n]
                torch.testing.assert_close(gb, torch.zeros_like(p) if other is None else other, rtol=0, atol=0)
        for n, p in params.items():
            torch.testing.assert_close(got["params"][n], p, rtol=0, atol=0, msg=f"rank {r} {n}")
    if layered:
        ran = [records["reference"]["ran"] for records in ranks]
        assert any(set(a) != set(b) for a, b in zip(*ran)), "the ranks never drew differently"
        layers = {k for steps in ran for s in steps for k in s}
        assert any(layers - set(a) - set(b) for a, b in zip(*ran)), "no layer was dropped on every rank"


def test_hf_trainer_with_ddp_find_unused_parameters_false(tmp_path):
    pytest.importorskip("accelerate")  # the Trainer needs it
    command = torchrun("--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                       str(EXAMPLES / "hf_trainer_layerdrop.py"), "--compare", "--out", "records")
    ranks, out = launch(command, tmp_path)
    check(ranks)
    assert "equal on all 2 ranks: True" in out and "equal to HF's model with find_unused_parameters=True: True" in out


def test_accelerate_with_find_unused_parameters_false(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    # accelerate's multi-process launcher (its --cpu flag means one process); the script picks the CPU
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
               "--mixed_precision=no", "--dynamo_backend=no", "--main_process_ip=127.0.0.1", f"--main_process_port={free_port()}",
               str(EXAMPLES / "accelerate_layerdrop.py"), "--compare", "--out", "records"]
    ranks, out = launch(command, tmp_path)
    check(ranks)
    assert "equal on all 2 ranks: True" in out and "equal to HF's model with find_unused_parameters=True: True" in out


def test_lightning_with_strategy_ddp(tmp_path):
    pytest.importorskip("lightning", minversion="2.1")  # the example makes its model in configure_model
    command = torchrun("--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                       str(EXAMPLES / "lightning_masked_branch.py"), "--compare", "--out", "records")
    ranks, out = launch(command, tmp_path)
    check(ranks, layered=False)  # the experts' routing differs by rank and leaves one idle every step
    assert "equal on all 2 ranks: True" in out and "equal to the if/else model with find_unused_parameters=True: True" in out
