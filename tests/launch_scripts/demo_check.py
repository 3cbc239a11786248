"""Run by tests/test_launch.py under torchrun (two nodes on loopback, two processes each): the
demo model, checked on every rank.

1. The reference case: two bias-free Linear(1, 1) layers with weight 1 as the branches of a
   MaskedBranch; rank r feeds r + 1 ones through layer1 when r is odd, layer2 when even;
   loss = sum(0.5 * out**2). With 4 ranks every rank must see the averaged gradients
   layer1 = (2 + 4) / 4 = 1.5 and layer2 = (1 + 3) / 4 = 1.0, iteration after iteration
   (DDP with find_unused_parameters=False).
2. A few AdamW steps of a small expert model with per-rank, per-row routing: the parameters
   must end bitwise identical on every rank.

Prints "DEMO OK <details>" on rank 0 and exits 0 when everything holds; raises otherwise.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from maskedbranch import MaskedBranch


def reference_case(rank):
    layer1, layer2 = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    nn.init.ones_(layer1.weight)
    nn.init.ones_(layer2.weight)
    model = DDP(MaskedBranch([layer1, layer2]), find_unused_parameters=False)
    x = torch.ones(rank + 1, 1)
    for iteration in range(3):
        out = model(x, 0 if rank % 2 == 1 else 1)
        (0.5 * out**2).sum().backward()
        grads = (layer1.weight.grad.item(), layer2.weight.grad.item())
        assert grads == (1.5, 1.0), f"rank {rank}, iteration {iteration}: gradients {grads}, expected (1.5, 1.0)"
        model.zero_grad(set_to_none=True)


def expert_training(rank, steps=5):
    torch.manual_seed(0)  # identical initial weights on every rank
    experts = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)]
    model = DDP(MaskedBranch(experts), find_unused_parameters=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(12, 8, generator=gen)
        ids = torch.randint(-1, 3, (12,), generator=gen)  # differs per rank and step
        loss = model(x, ids).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    for r, other in enumerate(everyone):
        assert torch.equal(other, flat), f"rank {rank}: parameters differ from rank {r}'s"


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, f"expected 4 ranks (2 nodes x 2), got {world}"
    where = (int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]))
    nodes = [None] * world
    dist.all_gather_object(nodes, where)
    assert sorted(nodes) == [(0, 0), (0, 1), (1, 0), (1, 1)], f"ranks per (node, local rank): {nodes}"
    reference_case(rank)
    expert_training(rank)
    dist.barrier()
    if rank == 0:
        print(f"DEMO OK world={world} nodes={sorted(nodes)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
