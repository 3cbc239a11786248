"""BEFORE: branches chosen with Python if/else under DistributedDataParallel.

    torchrun --standalone --nproc_per_node=4 examples/ifelse_before.py

1. The reference case: two bias-free Linear(1, 1) layers with weight 1; rank r feeds r + 1 ones
   through layer1 when r is odd, layer2 when r is even. With find_unused_parameters=False the
   first iteration silently keeps each rank's own gradient (2, 4 / 1, 3 instead of 1.5 / 1.0
   everywhere), the second raises "Expected to have finished reduction ...".
2. The usual way out: per-row routing by hand (index_select / index_add) with
   find_unused_parameters=True, which walks the autograd graph and all-reduces a "used" bitmap
   every iteration. examples/masked_after.py is the same script with MaskedBranch.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def setup():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)  # old launcher style
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank; global = this x world size")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    return args, device


def reference_case(device):
    """Two layers, if/else per rank, find_unused_parameters=False."""

    class IfElse(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Linear(1, 1, bias=False)
            self.layer2 = nn.Linear(1, 1, bias=False)
            nn.init.ones_(self.layer1.weight)
            nn.init.ones_(self.layer2.weight)

        def forward(self, x, use_layer1):
            return self.layer1(x) if use_layer1 else self.layer2(x)

    rank = dist.get_rank()
    # A group of its own: the failure below must not disturb the rest of the script.
    model = DDP(IfElse().to(device), process_group=dist.new_group())
    x = torch.ones(rank + 1, 1, device=device)
    for iteration in (1, 2):
        try:
            out = model(x, use_layer1=rank % 2 == 1)
            (0.5 * out**2).sum().backward()
        except RuntimeError as e:
            if rank == 0:
                print(f"  iteration {iteration}: RuntimeError: {str(e).splitlines()[0]}")
            return
        grads = [None if p.grad is None else round(p.grad.item(), 4) for p in (model.module.layer1.weight, model.module.layer2.weight)]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, grads)
        if rank == 0:
            print(f"  iteration {iteration} (expected layer1 1.5, layer2 1.0 on every rank):")
            for r, (g1, g2) in enumerate(everyone):
                print(f"    rank {r}: layer1 {g1}  layer2 {g2}")


class Experts(nn.Module):
    """A stem, one expert MLP per domain chosen per row by if/else, a head."""

    def __init__(self, d_in=64, d=128, experts=4, classes=10):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(experts))
        self.head = nn.Linear(d, classes)

    def forward(self, x, domain):
        h = torch.relu(self.stem(x))
        y = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (domain == i).nonzero().squeeze(1)  # a host-device sync per expert on GPUs
            if rows.numel():  # experts without rows are not in the graph
                y = y.index_add(0, rows, expert(h.index_select(0, rows)))
        return self.head(h + y)


def make_dataset(size=8192, d_in=64, experts=4, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, d_in, generator=g)
    # skewed domains: the last expert is rare, so some ranks get none of its rows in a step
    domain = torch.multinomial(torch.tensor([0.5, 0.3, 0.17, 0.03]), size, replacement=True, generator=g)
    proj = torch.randn(experts, d_in, classes, generator=g)
    y = torch.einsum("nd,ndc->nc", x, proj[domain]).argmax(1)
    return TensorDataset(x, domain, y)


def main():
    args, device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"== before: plain if/else, {world} ranks, {dist.get_backend()} ==")
        print("reference case, find_unused_parameters=False:")
    reference_case(device)

    torch.manual_seed(0)  # identical initial weights on every rank
    model = DDP(Experts().to(device), device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=True)  # needed: experts without rows on a rank are unused there
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_dataset()
    sampler = DistributedSampler(data, shuffle=True)  # shuffle on the sampler, not the loader
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print(f"training, find_unused_parameters=True, global batch {args.batch_size} x {world} = {args.batch_size * world}:")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        t0 = time.perf_counter()
        for x, domain, y in loader:
            x, domain, y = x.to(device), domain.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x, domain), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(total)  # the loss over all ranks, for logging
        if rank == 0:
            print(f"  epoch {epoch}: loss {total[0].item() / total[1].item():.4f} ({time.perf_counter() - t0:.1f} s)")
    dist.barrier()  # no collective in flight when the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
