"""BEFORE: branches chosen with Python if/else under DistributedDataParallel.

    torchrun --standalone --nproc_per_node=4 examples/ifelse_before.py

1. The reference case: two bias-free Linear(1, 1) layers with weight 1; rank r feeds r + 1 ones
   through layer1 when r is odd, layer2 when r is even; loss = sum(0.5 * out**2). The right
   gradients, identical on every rank, are layer1 = sum(r + 1 for odd r) / W and
   layer2 = sum(r + 1 for even r) / W (W = 4: 1.5 and 1.0). With find_unused_parameters=False
   the first iteration silently keeps each rank's own gradient (r + 1, not averaged), the
   second raises "Expected to have finished reduction ...".
2. The usual way out: per-row routing by hand (index_select / index_add) with
   find_unused_parameters=True, which walks the autograd graph and all-reduces a "used" bitmap
   every iteration. examples/masked_after.py is the same script with MaskedBranch.

Prints what happened (rank 0) and whether the failure of 1. was reproduced.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from _ranks import everyone, leave, sent  # examples/_ranks.py

EXPERTS = 4


def setup():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)  # older launchers
    parser.add_argument("--cpu", action="store_true", help="CPU processes with gloo even where GPUs are")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank; the global batch is this x world size")
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))  # torchrun sets LOCAL_RANK
    if torch.cuda.is_available() and not args.cpu:  # one process per GPU
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    return args, device


def say(*lines):
    if dist.get_rank() == 0:
        print(*lines, sep="\n", flush=True)


def expected_reference(world):
    """(layer1, layer2) averaged gradients of the reference case for ``world`` ranks."""
    return (sum(r + 1 for r in range(world) if r % 2) / world, sum(r + 1 for r in range(world) if not r % 2) / world)


class IfElse(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
        nn.init.ones_(self.layer1.weight)
        nn.init.ones_(self.layer2.weight)

    def forward(self, x, use_layer1):
        return self.layer1(x) if use_layer1 else self.layer2(x)


def reference_case(device):
    """Returns whether the failure was reproduced (gradients not averaged, or DDP's error)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # A process group of its own: the failure below must not disturb the rest of the script.
    model = DDP(IfElse().to(device), process_group=dist.new_group())
    want = expected_reference(world)
    x = torch.ones(rank + 1, 1, device=device)
    wrong = False
    for iteration in (1, 2):
        try:
            (0.5 * model(x, use_layer1=rank % 2 == 1) ** 2).sum().backward()
        except RuntimeError as e:
            say(f"  iteration {iteration}: RuntimeError: {str(e).splitlines()[0][:150]} ...")
            return True
        m = model.module
        grads = everyone(tuple(None if p.grad is None else round(p.grad.item(), 4) for p in (m.layer1.weight, m.layer2.weight)))
        wrong |= any(g != (round(want[0], 4) if r % 2 else None, None if r % 2 else round(want[1], 4)) for r, g in enumerate(grads))
        say(f"  iteration {iteration} (right: layer1 {round(want[0], 4)}, layer2 {round(want[1], 4)} on every rank):")
        for r, (g1, g2) in enumerate(grads):
            say(f"    rank {r}: layer1 {g1}  layer2 {g2}")
        if wrong:
            say("    -> not averaged: each rank kept its own gradient, the replicas now differ")
        m.zero_grad(set_to_none=True)
    return wrong


class Experts(nn.Module):
    """A stem, one expert MLP per domain chosen per row by hand, a head."""

    def __init__(self, d_in=64, d=128, classes=10):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(EXPERTS))
        self.head = nn.Linear(d, classes)

    def forward(self, x, domain):
        h = torch.relu(self.stem(x))
        y = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = (domain == i).nonzero().squeeze(1)  # a host-device sync per expert on GPUs
            if rows.numel():  # an expert without rows is not in the graph: DDP must search for it
                y = y.index_add(0, rows, expert(h.index_select(0, rows)))
        return self.head(h + y)


def make_dataset(size, d_in=64, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, d_in, generator=g)
    # skewed domains: the last expert is rare, so some ranks get none of its rows in a step
    domain = torch.multinomial(torch.tensor([0.5, 0.3, 0.17, 0.03]), size, replacement=True, generator=g)
    proj = torch.randn(EXPERTS, d_in, classes, generator=g)
    y = torch.einsum("nd,ndc->nc", x, proj[domain]).argmax(1)
    return TensorDataset(x, domain, y)


def train(args, device):
    world = dist.get_world_size()
    torch.manual_seed(0)  # identical initial weights on every rank
    model = DDP(Experts().to(device), device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=True)  # needed: an expert without rows on a rank is unused there
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data = make_dataset(args.samples)
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # shuffle on the sampler, not the loader
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    say(f"training, find_unused_parameters=True, global batch {args.batch_size} x {world} = {args.batch_size * world}:")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # another shuffle every epoch, the same on every rank
        total = torch.zeros(2, device=device)
        t0 = time.perf_counter()
        for x, domain, y in loader:
            x, domain, y = x.to(device), domain.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x, domain), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(sent(total))  # the loss over all ranks, for logging
        say(f"  epoch {epoch}: loss {total[0].item() / total[1].item():.4f} ({time.perf_counter() - t0:.1f} s)")


def main():
    args, device = setup()
    say(f"== before: plain if/else, {dist.get_world_size()} ranks, {dist.get_backend()} on {device.type} ==",
        "reference case, find_unused_parameters=False:")
    reproduced = reference_case(device)
    train(args, device)
    say("ifelse_before: the failure of plain if/else was " + ("reproduced" if reproduced else "NOT reproduced"))
    leave()


if __name__ == "__main__":
    main()
