"""maskedbranch demo: conditional branches under DistributedDataParallel with
find_unused_parameters=False.

    torchrun --standalone --nproc_per_node=4 examples/demo.py

4 CPU ranks with gloo by default; one rank per GPU with NCCL when GPUs are present.

1. The reference case (two Linear(1, 1) layers, rank r uses layer1 when odd, layer2 when even):
   before - plain if/else: gradients not averaged, then DDP's "Expected to have finished
   reduction" error; after - MaskedBranch: layer1 1.5 and layer2 1.0 on every rank.
2. A small expert model (one MLP expert per domain, chosen per row, a rare expert that some ranks
   do not see in some steps) trained the usual DDP way with
   MaskedBranch + find_unused_parameters=False, beside (a) if/else + find_unused_parameters=True
   and (b) the dense 0/1-coefficient trick: step time, loss, gradient agreement across ranks and
   between the variants.
"""
import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from maskedbranch import MaskedBranch

EXPERTS = 4


def setup():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)  # old launcher style
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512, help="per rank; global = this x world size")
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))  # torchrun sets LOCAL_RANK
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    return args, device


def say(*lines):
    if dist.get_rank() == 0:
        print(*lines, sep="\n", flush=True)


def gather_to_rank0(value):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


# ----------------------------------------------------------------------------------------------
# 1. The reference case.


def two_layers(device):
    layer1, layer2 = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    nn.init.ones_(layer1.weight)
    nn.init.ones_(layer2.weight)
    return layer1.to(device), layer2.to(device)


def show_grads(title, grads):
    say(f"  {title} (expected layer1 1.5, layer2 1.0 on every rank):")
    for r, (g1, g2) in enumerate(grads):
        say(f"    rank {r}: layer1 {g1}  layer2 {g2}")


def reference_before(device):
    class IfElse(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1, self.layer2 = two_layers(device)

        def forward(self, x, use_layer1):
            return self.layer1(x) if use_layer1 else self.layer2(x)

    rank = dist.get_rank()
    # A group of its own: the failure below must not disturb what follows.
    model = DDP(IfElse(), process_group=dist.new_group())
    x = torch.ones(rank + 1, 1, device=device)
    for iteration in (1, 2):
        try:
            out = model(x, use_layer1=rank % 2 == 1)
            (0.5 * out**2).sum().backward()
        except RuntimeError as e:
            say(f"  iteration {iteration}: RuntimeError: {str(e).splitlines()[0][:160]} ...")
            return
        m = model.module
        grads = gather_to_rank0([None if p.grad is None else round(p.grad.item(), 4) for p in (m.layer1.weight, m.layer2.weight)])
        show_grads(f"iteration {iteration}", grads)
        say("    -> not averaged: each rank kept its own gradient (replicas now differ)")


def reference_after(device, iterations=3):
    rank = dist.get_rank()
    layer1, layer2 = two_layers(device)
    model = DDP(MaskedBranch([layer1, layer2]))
    x = torch.ones(rank + 1, 1, device=device)
    for iteration in range(1, iterations + 1):
        out = model(x, 0 if rank % 2 == 1 else 1)  # an int gate: odd ranks layer1, even ranks layer2
        (0.5 * out**2).sum().backward()
        grads = gather_to_rank0([round(p.grad.item(), 4) for p in (layer1.weight, layer2.weight)])
        model.zero_grad(set_to_none=True)
        show_grads(f"iteration {iteration}", grads)
        ok = all(g == [1.5, 1.0] for g in grads)
        say(f"    -> {'correct on every rank' if ok else 'WRONG'}")


# ----------------------------------------------------------------------------------------------
# 2. Training an expert model three ways.


def expert(d):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class Experts(nn.Module):
    """stem -> one expert per row (by domain) -> residual -> head; ``variant`` picks the routing."""

    def __init__(self, d_in, d, classes, variant):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.experts = MaskedBranch(expert(d) for _ in range(EXPERTS))
        self.head = nn.Linear(d, classes)
        self.variant = variant

    def forward(self, x, domain):
        h = torch.relu(self.stem(x))
        experts = self.experts.branches
        if self.variant == "masked":
            y = self.experts(h, domain)  # domain stays on the host: no device sync
        elif self.variant == "ifelse":
            domain = domain.to(h.device)
            y = torch.zeros_like(h)
            for i, e in enumerate(experts):
                rows = (domain == i).nonzero().squeeze(1)
                if rows.numel():  # an expert without rows is not in the graph
                    y = y.index_add(0, rows, e(h.index_select(0, rows)))
        else:  # dense 0/1 coefficients: every expert on every row
            coef = nn.functional.one_hot(domain, EXPERTS).to(h.device, h.dtype)
            y = sum(coef[:, i, None] * e(h) for i, e in enumerate(experts))
        return self.head(h + y)


def make_dataset(size, d_in, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, d_in, generator=g)
    # skewed domains: the last expert is rare, so some ranks have none of its rows in a step
    domain = torch.multinomial(torch.tensor([0.5, 0.3, 0.197, 0.003]), size, replacement=True, generator=g)
    proj = torch.randn(EXPERTS, d_in, classes, generator=g)
    y = torch.einsum("nd,ndc->nc", x, proj[domain]).argmax(1)
    return TensorDataset(x, domain, y)


def flat_grads(model):
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()])


VARIANTS = ("masked", "ifelse", "dense")


def train(base, data, args, device):
    """Train the three variants in lockstep (same batches, each its own DDP model and optimizer),
    so that they share whatever else the machine is doing; time each variant's steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    models, opts = {}, {}
    for v in VARIANTS:
        module = copy.deepcopy(base).to(device)
        module.variant = v
        models[v] = DDP(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=v == "ifelse",  # (a) needs it: a rank may have no rows of an expert
        )
        opts[v] = torch.optim.SGD(models[v].parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # shuffle on the sampler, not the loader
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    step_times = {v: [] for v in VARIANTS}
    first_grads, skipped, steps = {}, 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        totals = {v: torch.zeros(2, device=device) for v in VARIANTS}
        for x, domain, y in loader:
            x, y = x.to(device), y.to(device)  # MaskedBranch keeps the gate (domain) on the host
            skipped += int(torch.bincount(domain, minlength=EXPERTS).eq(0).sum())
            steps += 1
            order = VARIANTS[steps % 3:] + VARIANTS[: steps % 3]  # rotate who goes first
            for v in order:
                model, opt = models[v], opts[v]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x, domain), y)
                loss.backward()
                if v not in first_grads:
                    first_grads[v] = flat_grads(model.module)
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                step_times[v].append(time.perf_counter() - t0)
                totals[v] += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        for v in VARIANTS:
            dist.all_reduce(totals[v])  # the loss over all ranks, for logging
        say(f"  epoch {epoch}: loss " + ", ".join(f"{v} {totals[v][0].item() / totals[v][1].item():.4f}" for v in VARIANTS))
    skipped_all = torch.tensor(skipped, device=device)
    dist.all_reduce(skipped_all)
    results = {}
    for v in VARIANTS:
        # gradient agreement: the last step's gradients against rank 0's
        g = flat_grads(models[v].module)
        g0 = g.clone()
        dist.broadcast(g0, src=0)
        step_ms = torch.tensor(statistics.median(step_times[v][2:] or step_times[v]) * 1e3, device=device)
        dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        results[v] = {
            "step_ms": step_ms.item(),
            "loss": totals[v][0].item() / totals[v][1].item(),
            "vs_rank0": gather_to_rank0(float((g - g0).abs().max())),
            "first_grads": first_grads[v],
            "skipped": int(skipped_all),
            "steps": steps,
        }
    return results


def main():
    args, device = setup()
    world = dist.get_world_size()
    say(f"maskedbranch demo: {world} ranks, {dist.get_backend()} on {device.type}")
    say("", "== 1. Reference case (DESIGN.md), DDP with find_unused_parameters=False ==")
    say("before: plain if/else")
    reference_before(device)
    say("after: MaskedBranch([layer1, layer2]) with an int gate per rank")
    reference_after(device)

    d_in, classes = 64, 10
    data = make_dataset(size=8 * args.batch_size * world, d_in=d_in, classes=classes)
    torch.manual_seed(0)  # identical initial weights on every rank, and for every variant
    base = Experts(d_in, args.dim, classes, "masked")
    say(
        "",
        f"== 2. Training: {EXPERTS} experts ({args.dim} -> {4 * args.dim} -> {args.dim}), one per row by domain, "
        f"global batch {args.batch_size} x {world} = {args.batch_size * world}, {args.epochs} epochs ==",
    )
    results = train(base, data, args, device)

    names = {
        "masked": "MaskedBranch, find_unused_parameters=False",
        "ifelse": "(a) if/else, find_unused_parameters=True",
        "dense": "(b) dense 0/1 coefficients",
    }
    ref = results["ifelse"]["first_grads"]
    rows = []
    for v, res in results.items():
        vs_ifelse = (res["first_grads"] - ref).abs().max()
        dist.all_reduce(vs_ifelse, op=dist.ReduceOp.MAX)
        rows.append((v, res, vs_ifelse.item()))
    say(
        "",
        f"(expert slots with no rows on a rank, over all ranks and steps: {results['masked']['skipped']} of "
        f"{EXPERTS * world * results['masked']['steps']}; if/else needs find_unused_parameters=True for those)",
        "",
        f"{'variant':46s} {'step ms':>8s} {'vs masked':>9s} {'loss':>7s}   max |grad - grad(rank 0)| per rank   max |grad - grad(a)| step 1",
    )
    t_masked = results["masked"]["step_ms"]
    for v, res, vs_ifelse in rows:
        per_rank = " ".join(f"{x:.0e}" if x else "0" for x in res["vs_rank0"])
        say(
            f"{names[v]:46s} {res['step_ms']:8.1f} {res['step_ms'] / t_masked:8.2f}x {res['loss']:7.4f}   "
            f"{per_rank:36s} {vs_ifelse:.1e}"
        )
    ok = all(x == 0 for x in results["masked"]["vs_rank0"])
    say(
        "",
        f"MaskedBranch: gradients {'identical' if ok else 'NOT identical'} on all ranks, equal to (a) up to float "
        "rounding, no find_unused_parameters, no compute for rows an expert does not serve.",
    )
    dist.barrier()  # no collective in flight when the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
