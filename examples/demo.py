"""maskedbranch demo: conditional branches under DistributedDataParallel with
find_unused_parameters=False.

    torchrun --standalone --nproc_per_node=4 examples/demo.py      (or: bash scripts/demo.sh)

CPU ranks with gloo; one rank per GPU with NCCL when GPUs are present and maskedbranch was
built with its CUDA kernels.

1. The reference case (two bias-free Linear(1, 1) layers with weight 1; rank r feeds r + 1 ones
   through layer1 when r is odd, layer2 when even; loss = sum(0.5 * out**2)). Rank r's own
   gradient is r + 1, so the averaged gradients on W ranks are layer1 = sum(r + 1 for odd r) / W
   and layer2 = sum(r + 1 for even r) / W (1.5 and 1.0 on 4 ranks). Before: plain if/else keeps
   each rank's own gradient, then DDP raises "Expected to have finished reduction". After:
   MaskedBranch gives the averages on every rank.
2. An expert model (one MLP per domain, chosen per row; a rare expert that some ranks do not see
   in some steps) trained the usual DDP way (DistributedSampler, SGD with momentum and weight
   decay), three ways in lockstep: MaskedBranch with find_unused_parameters=False, (a) if/else
   with find_unused_parameters=True, (b) the dense 0/1-coefficient trick. MaskedBranch must
   train as (a) (same parameters up to float rounding) and keep the replicas identical.

Ends with "DEMO PASS" (exit 0) or "DEMO FAIL" (exit 1), printed by rank 0.
"""
import argparse
import os
import statistics
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
VARIANTS = ("masked", "ifelse", "dense")
NAMES = {
    "masked": "MaskedBranch, find_unused_parameters=False",
    "ifelse": "(a) if/else, find_unused_parameters=True",
    "dense": "(b) dense 0/1 coefficients",
}


def setup():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)  # older launchers
    parser.add_argument("--cpu", action="store_true", help="CPU processes with gloo even where GPUs are")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank; the global batch is this x world size")
    parser.add_argument("--steps-per-epoch", type=int, default=8, help="sets the data set's size")
    parser.add_argument("--dim", type=int, default=128)
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


def verdict(ok):
    return "PASS" if ok else "FAIL"


def speed_comparison(masked_ms, ifelse_ms, noise=0.05):
    """The measured step times of MaskedBranch and of (a), said as they came out: which one was
    faster and by what ratio (nothing here assumes which). Within ``noise`` the lead is named
    too, with the note that such a difference is within what two runs of this demo differ by."""
    a = "(a) if/else + find_unused_parameters=True"
    m = "MaskedBranch (find_unused_parameters=False)"
    head = f"step time (median, slowest rank): MaskedBranch {masked_ms:.1f} ms, (a) {ifelse_ms:.1f} ms: "
    if masked_ms == ifelse_ms:
        return head + "equal on this run"
    faster, slower = (m, a) if masked_ms < ifelse_ms else (a, m)
    ratio = max(masked_ms, ifelse_ms) / min(masked_ms, ifelse_ms)
    line = head + f"{faster} was {ratio:.2f}x as fast as {slower} on this run"
    if ratio < 1.0 + noise:
        line += f" (under {noise:.0%} apart: within the run-to-run noise of this demo)"
    return line


# ----------------------------------------------------------------------------------------------
# 1. The reference case.


def close(got, want):
    """float32 gradients against the exact averages (W = 3: 2 / 3 is not a float32)."""
    return all(abs(g - w) <= 1e-6 * max(1.0, abs(w)) for g, w in zip(got, want))


def expected_reference(world):
    return (sum(r + 1 for r in range(world) if r % 2) / world, sum(r + 1 for r in range(world) if not r % 2) / world)


def two_layers(device):
    layer1, layer2 = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    nn.init.ones_(layer1.weight)
    nn.init.ones_(layer2.weight)
    return layer1.to(device), layer2.to(device)


def show(grads):
    for r, (g1, g2) in enumerate(grads):
        say(f"    rank {r}: layer1 {g1}  layer2 {g2}")


def reference_before(device):
    """Plain if/else: returns whether the failure was reproduced."""

    class IfElse(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1, self.layer2 = two_layers(device)

        def forward(self, x, use_layer1):
            return self.layer1(x) if use_layer1 else self.layer2(x)

    rank, want = dist.get_rank(), expected_reference(dist.get_world_size())
    model = DDP(IfElse(), process_group=dist.new_group())  # its own group: its failure stays there
    x = torch.ones(rank + 1, 1, device=device)
    for iteration in (1, 2):
        try:
            (0.5 * model(x, use_layer1=rank % 2 == 1) ** 2).sum().backward()
        except RuntimeError as e:
            say(f"  iteration {iteration}: RuntimeError: {str(e).splitlines()[0][:120]} ...")
            return True
        m = model.module
        grads = everyone([None if p.grad is None else round(p.grad.item(), 4) for p in (m.layer1.weight, m.layer2.weight)])
        say(f"  iteration {iteration} (right: layer1 {round(want[0], 4)}, layer2 {round(want[1], 4)} on every rank):")
        show(grads)
        m.zero_grad(set_to_none=True)
    return False


def reference_after(device, iterations=3):
    """MaskedBranch: returns whether every rank saw the averages in every iteration."""
    rank, want = dist.get_rank(), expected_reference(dist.get_world_size())
    layer1, layer2 = two_layers(device)
    model = DDP(MaskedBranch([layer1, layer2]))
    x = torch.ones(rank + 1, 1, device=device)
    ok = True
    for iteration in range(1, iterations + 1):
        out = model(x, 0 if rank % 2 == 1 else 1)  # an int gate: odd ranks layer1, even ranks layer2
        (0.5 * out**2).sum().backward()
        grads = everyone([layer1.weight.grad.item(), layer2.weight.grad.item()])
        model.zero_grad(set_to_none=True)
        good = all(close(g, want) for g in grads)
        ok &= good
        say(f"  iteration {iteration} (expected layer1 {round(want[0], 4)}, layer2 {round(want[1], 4)} on every rank): {verdict(good)}")
        show([[round(v, 4) for v in g] for g in grads])
    return ok


# ----------------------------------------------------------------------------------------------
# 2. Training an expert model three ways.


def expert(d):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class Experts(nn.Module):
    """stem -> one expert per row (by domain) -> residual -> head; ``variant`` picks the routing."""

    def __init__(self, d_in, d, classes, variant):
        super().__init__()
        self.variant = variant
        self.stem = nn.Linear(d_in, d)
        experts = [expert(d) for _ in range(EXPERTS)]
        self.experts = MaskedBranch(experts) if variant == "masked" else nn.ModuleList(experts)  # same keys
        self.head = nn.Linear(d, classes)

    def forward(self, x, domain):
        h = torch.relu(self.stem(x))
        if self.variant == "masked":
            y = self.experts(h, domain)  # domain stays on the host: no device sync
        elif self.variant == "ifelse":
            domain = domain.to(h.device)
            y = torch.zeros_like(h)
            for i, e in enumerate(self.experts):
                rows = (domain == i).nonzero().squeeze(1)
                if rows.numel():  # an expert without rows is not in the graph
                    y = y.index_add(0, rows, e(h.index_select(0, rows)))
        else:  # every expert on every row
            coef = nn.functional.one_hot(domain, EXPERTS).to(h.device, h.dtype)
            y = sum(coef[:, i, None] * e(h) for i, e in enumerate(self.experts))
        return self.head(h + y)


def make_dataset(size, d_in, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, d_in, generator=g)
    # skewed domains: the last expert is rare, so some ranks have none of its rows in a step
    domain = torch.multinomial(torch.tensor([0.5, 0.3, 0.197, 0.003]), size, replacement=True, generator=g)
    proj = torch.randn(EXPERTS, d_in, classes, generator=g)
    y = torch.einsum("nd,ndc->nc", x, proj[domain]).argmax(1)
    return TensorDataset(x, domain, y)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def train(args, device, d_in=64, classes=10):
    """The three variants in lockstep (same batches, each its own DDP model and optimizer)."""
    world = dist.get_world_size()
    data = make_dataset(args.steps_per_epoch * args.batch_size * world, d_in, classes)
    torch.manual_seed(0)  # identical initial weights on every rank and for every variant
    state = Experts(d_in, args.dim, classes, "masked").state_dict()
    models, opts = {}, {}
    for v in VARIANTS:
        module = Experts(d_in, args.dim, classes, v)
        module.load_state_dict(state)
        models[v] = DDP(module.to(device), device_ids=[device.index] if device.type == "cuda" else None,
                        find_unused_parameters=v == "ifelse")  # (a) needs it: a rank may have no rows of an expert
        opts[v] = torch.optim.SGD(models[v].parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # shuffle on the sampler, not the loader
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    times = {v: [] for v in VARIANTS}
    first_grads, absent, steps = {}, 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # another shuffle every epoch, the same on every rank
        totals = {v: torch.zeros(2, device=device) for v in VARIANTS}
        for x, domain, y in loader:
            x, y = x.to(device), y.to(device)
            absent += int(torch.bincount(domain, minlength=EXPERTS).eq(0).sum())
            steps += 1
            for v in VARIANTS[steps % 3:] + VARIANTS[: steps % 3]:  # rotate who goes first
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opts[v].zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(models[v](x, domain), y)
                loss.backward()
                if v not in first_grads:
                    first_grads[v] = flat(torch.zeros_like(p) if p.grad is None else p.grad for p in models[v].parameters())
                opts[v].step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[v].append(time.perf_counter() - t0)
                totals[v] += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        for v in VARIANTS:
            dist.all_reduce(sent(totals[v]))  # the loss over all ranks, for logging
        say(f"  epoch {epoch}: loss " + ", ".join(f"{v} {totals[v][0].item() / totals[v][1].item():.4f}" for v in VARIANTS))
    absent_all = torch.tensor(absent, device=device)
    dist.all_reduce(sent(absent_all))
    out = {"absent": int(absent_all), "slots": EXPERTS * world * steps}
    for v in VARIANTS:
        params = flat(models[v].parameters())
        first = params.clone()
        dist.broadcast(sent(first), src=0)
        ms = torch.tensor(statistics.median(times[v][2:] or times[v]) * 1e3, device=device)
        dist.all_reduce(sent(ms), op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        out[v] = {"ms": ms.item(), "params": params, "replicas_equal": all(everyone(bool(torch.equal(params, first)))),
                  "first_grads": first_grads[v]}
    return out


def main():
    args, device = setup()
    world = dist.get_world_size()
    say(f"maskedbranch demo: {world} ranks, {dist.get_backend()} on {device.type}",
        "", "== 1. Reference case (docs/design.md), DDP with find_unused_parameters=False ==", "before: plain if/else")
    reproduced = reference_before(device)
    say("after: MaskedBranch([layer1, layer2]) with an int gate per rank")
    after = reference_after(device)

    say("", f"== 2. Training: {EXPERTS} experts ({args.dim} -> {4 * args.dim} -> {args.dim}), one per row by domain, "
            f"global batch {args.batch_size} x {world} = {args.batch_size * world}, {args.epochs} epochs ==")
    res = train(args, device)
    say("", f"(expert slots with no rows on a rank, over all ranks and steps: {res['absent']} of {res['slots']})", "",
        f"{'variant':46s} {'step ms':>8s} {'/ masked':>9s}  {'replicas':>8s}  {'|params - (a)|':>14s}  {'|grads - (a)| step 1':>20s}")
    ref = res["ifelse"]
    for v in VARIANTS:
        r = res[v]
        d_params = (r["params"] - ref["params"]).abs().max()
        d_grads = (r["first_grads"] - ref["first_grads"]).abs().max()
        dist.all_reduce(sent(d_params), op=dist.ReduceOp.MAX)
        dist.all_reduce(sent(d_grads), op=dist.ReduceOp.MAX)
        r["d_params"], r["d_grads"] = d_params.item(), d_grads.item()
        say(f"{NAMES[v]:46s} {r['ms']:8.1f} {r['ms'] / res['masked']['ms']:8.2f}x  "
            f"{'equal' if r['replicas_equal'] else 'DIFFER':>8s}  {r['d_params']:14.1e}  {r['d_grads']:20.1e}")
    say("", speed_comparison(res["masked"]["ms"], res["ifelse"]["ms"]))
    # float32: the variants sum in different orders, so (a) and MaskedBranch agree to rounding
    trains_as_ifelse = res["masked"]["d_grads"] < 1e-5 and res["masked"]["d_params"] < 1e-3
    replicas = res["masked"]["replicas_equal"]
    ok = reproduced and after and trains_as_ifelse and replicas
    say("",
        f"before: plain if/else fails as described: {verdict(reproduced)}",
        f"after: MaskedBranch gives the averaged gradients on every rank: {verdict(after)}",
        f"MaskedBranch trains as (a) if/else + find_unused_parameters=True: {verdict(trains_as_ifelse)}",
        f"MaskedBranch replicas identical after training: {verdict(replicas)}",
        "", f"DEMO {verdict(ok)}")
    leave()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
