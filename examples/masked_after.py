"""AFTER: the branches of examples/ifelse_before.py in a maskedbranch.MaskedBranch, under
DistributedDataParallel with find_unused_parameters=False.

    torchrun --standalone --nproc_per_node=4 examples/masked_after.py

1. The reference case: two bias-free Linear(1, 1) layers with weight 1; rank r feeds r + 1 ones
   through layer1 when r is odd, layer2 when r is even; loss = sum(0.5 * out**2). Rank r's own
   gradient is r + 1; DDP averages over the W ranks, so every rank must see
   layer1 = sum(r + 1 for odd r) / W and layer2 = sum(r + 1 for even r) / W
   (W = 4: 6 / 4 = 1.5 and 4 / 4 = 1.0), iteration after iteration.
2. An expert model (one MLP per domain, chosen per row) trained the usual DDP way: experts
   without rows on a rank are skipped (no compute) but still get their averaged gradient, with
   no find_unused_parameters. The replicas must end identical.

Prints PASS or FAIL for each check (rank 0) and exits non-zero on a failure.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import maskedbranch
from maskedbranch import MaskedBranch

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
    if torch.cuda.is_available() and maskedbranch.WITH_CUDA and not args.cpu:  # one process per GPU
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    return args, device


def say(*lines):
    if dist.get_rank() == 0:
        print(*lines, sep="\n", flush=True)


def close(got, want):
    """float32 gradients against the exact averages (W = 3: 2 / 3 is not a float32)."""
    return all(abs(g - w) <= 1e-6 * max(1.0, abs(w)) for g, w in zip(got, want))


def expected_reference(world):
    """(layer1, layer2) averaged gradients of the reference case for ``world`` ranks."""
    return (sum(r + 1 for r in range(world) if r % 2) / world, sum(r + 1 for r in range(world) if not r % 2) / world)


def reference_case(device, iterations=3):
    rank, world = dist.get_rank(), dist.get_world_size()
    layer1, layer2 = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    nn.init.ones_(layer1.weight)
    nn.init.ones_(layer2.weight)
    model = DDP(MaskedBranch([layer1, layer2]).to(device))  # find_unused_parameters=False
    want = expected_reference(world)
    ok = True
    x = torch.ones(rank + 1, 1, device=device)
    for iteration in range(1, iterations + 1):
        out = model(x, 0 if rank % 2 == 1 else 1)  # an int gate: odd ranks layer1, even ranks layer2
        (0.5 * out**2).sum().backward()
        grads = everyone((layer1.weight.grad.item(), layer2.weight.grad.item()))
        model.zero_grad(set_to_none=True)
        good = all(close(g, want) for g in grads)
        ok &= good
        say(f"  iteration {iteration} (expected layer1 {round(want[0], 4)}, layer2 {round(want[1], 4)} on every rank): "
            + ("PASS" if good else "FAIL"))
        for r, (g1, g2) in enumerate(grads):
            say(f"    rank {r}: layer1 {round(g1, 4)}  layer2 {round(g2, 4)}")
    return ok


class Experts(nn.Module):
    """A stem, one expert MLP per domain chosen per row by MaskedBranch, a head."""

    def __init__(self, d_in=64, d=128, classes=10):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.experts = MaskedBranch(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(EXPERTS))
        self.head = nn.Linear(d, classes)

    def forward(self, x, domain):
        h = torch.relu(self.stem(x))
        return self.head(h + self.experts(h, domain))  # domain: one expert id per row


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
    model = DDP(Experts().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data = make_dataset(args.samples)
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # shuffle on the sampler, not the loader
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    say(f"training, find_unused_parameters=False, global batch {args.batch_size} x {world} = {args.batch_size * world}:")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # another shuffle every epoch, the same on every rank
        total = torch.zeros(2, device=device)
        t0 = time.perf_counter()
        for x, domain, y in loader:
            x, y = x.to(device), y.to(device)  # the gate (domain) stays on the host: no device sync
            loss = nn.functional.cross_entropy(model(x, domain), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(sent(total))  # the loss over all ranks, for logging
        say(f"  epoch {epoch}: loss {total[0].item() / total[1].item():.4f} ({time.perf_counter() - t0:.1f} s)")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(sent(first), src=0)
    same = everyone(bool(torch.equal(flat, first)))
    say(f"  replicas identical on all {world} ranks after training: " + ("PASS" if all(same) else f"FAIL {same}"))
    return all(same)


def main():
    args, device = setup()
    say(f"== after: MaskedBranch, {dist.get_world_size()} ranks, {dist.get_backend()} on {device.type} ==",
        "reference case, find_unused_parameters=False:")
    ok = reference_case(device)
    ok &= train(args, device)
    say("masked_after: " + ("PASS" if ok else "FAIL"))
    leave()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
