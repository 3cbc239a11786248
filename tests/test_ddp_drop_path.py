"""ResidualDropPath under DistributedDataParallel with find_unused_parameters=False: real
processes (torch.multiprocessing spawn, gloo on CPU), 4 ranks, 50 steps per configuration.

Ranks skip branches independently (each rank draws its own masks), so on many steps a branch
runs on some ranks and not on others: the case where plain if/else silently fails to average
gradients and then raises "Expected to have finished reduction in the prior iteration".
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import maskedbranch as mb

WORLD = 4
STEPS = 50
WIDTH = 16
PER_RANK_BATCH = 3  # small, so that "row" mode also drops every row of a rank now and then

# (mode, drop probabilities of the blocks, identical draws on every rank)
CONFIGS = [
    ("batch", (0.5, 0.3, 0.7), False),
    ("row", (0.5, 0.3, 0.7), False),
    ("batch", (0.5, 0.5, 0.5), True),
    ("row", (0.6, 0.6, 0.6), True),
]


class Branch(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 2 * c)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * c, c)
        self.calls = 0  # forward calls (the branch did run)

    def forward(self, x):
        self.calls += 1
        return self.fc2(self.act(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, mode, probs, generator):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(
            mb.ResidualDropPath(Branch(WIDTH), p, mode, generator=generator) for p in probs
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def flat_grads(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def run_config(rank, mode, probs, identical):
    torch.manual_seed(0)  # identical initial weights on every rank
    seed = 1234 if identical else 1234 + 7919 * rank
    model = Net(mode, probs, torch.Generator().manual_seed(seed))
    reference = copy.deepcopy(model)  # same weights, same generator state: replays this rank's draws
    ddp = DDP(model, find_unused_parameters=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    ran = []  # per step: did each block's branch run on this rank?
    for step in range(STEPS):
        x = torch.randn(PER_RANK_BATCH, 5, 8, generator=data)
        target = torch.randn(PER_RANK_BATCH, 1, generator=data)
        before = [b.branch.calls for b in model.blocks]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), target)
        loss.backward()
        ran.append([int(b.branch.calls > c) for b, c in zip(model.blocks, before)])
        if step == 0:
            # the averaged gradient equals the mean of the ranks' own gradients
            nn.functional.mse_loss(reference(x), target).backward()
            want = flat_grads(reference)
            dist.all_reduce(want)
            want /= WORLD
            torch.testing.assert_close(flat_grads(model), want, rtol=1e-5, atol=1e-6)
        opt.step()

    # parameters identical on every rank
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(WORLD)]
    dist.all_gather(gathered, params)
    assert torch.isfinite(params).all(), f"{mode}: training diverged"
    for r, other in enumerate(gathered):
        assert torch.equal(other, params), f"{mode}: parameters of rank {r} differ from rank {rank}"

    # the run exercised what it should: ranks disagreeing about running a branch (independent
    # draws) or always agreeing (identical draws), and branches skipped on some steps
    ran = torch.tensor(ran)
    all_ran = [torch.empty_like(ran) for _ in range(WORLD)]
    dist.all_gather(all_ran, ran)
    stacked = torch.stack(all_ran)  # [world, steps, blocks]
    disagree = (stacked.amin(0) != stacked.amax(0)).sum().item()
    if identical:
        assert disagree == 0, f"{mode}: identical draws, yet ranks disagreed {disagree} times"
    else:
        assert disagree > 0, f"{mode}: ranks never disagreed; the test does not exercise skipping"
    assert (stacked == 0).any(), f"{mode}: no branch was ever skipped"


def worker(rank, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for mode, probs, identical in CONFIGS:
            run_config(rank, mode, probs, identical)
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_residual_drop_path_ddp_gloo(tmp_path):
    init_file = os.path.join(tmp_path, "pg_init")
    mp.spawn(worker, args=(init_file,), nprocs=WORLD, join=True)
