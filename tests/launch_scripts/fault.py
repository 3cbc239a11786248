"""Run by tests/test_launch.py under torchrun: rank 1 raises inside a branch of a MaskedBranch
in the third training step, while the other ranks wait in DDP's all-reduce. torchrun must end
the job (non-zero exit status) and report the failure; nothing may hang.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from maskedbranch import MaskedBranch

FAIL_RANK, FAIL_STEP = 1, 3


class Fragile(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rank = rank
        self.step = 0

    def forward(self, x):
        if self.rank == FAIL_RANK and self.step == FAIL_STEP:
            raise RuntimeError(f"injected failure inside a branch on rank {self.rank} at step {self.step}")
        return self.lin(x)


@record  # torchrun's failure summary then carries the exception and its traceback
def main():
    # The process group timeout is the backstop: torchrun should end the job long before it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    branches = [Fragile(rank), nn.Linear(4, 4)]
    model = DDP(MaskedBranch(branches), find_unused_parameters=False)
    try:
        for step in range(6):
            branches[0].step = step
            out = model(torch.ones(4, 4), torch.tensor([0, 1, 0, 1]))
            out.sum().backward()
            print(f"rank {rank}: step {step} done", flush=True)
    except Exception:
        if rank != FAIL_RANK:
            # The other ranks fail as a consequence ("connection closed by peer") within
            # milliseconds. torchrun orders failures by their error files' timestamps, which are
            # whole seconds, so a tie would name rank 0: report the consequence later.
            time.sleep(1.5)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
