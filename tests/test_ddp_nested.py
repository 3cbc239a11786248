"""Routing modules inside other routing modules' branches, under DDP with real ranks (2, gloo).

An outer MaskedBranch whose branches hold inner MaskedBranches (experts inside LayerDrop layers,
a supernet of mixtures): when an outer branch runs, its inner module decides which of its own
parameters ran. Trained against the if/else code under ``find_unused_parameters=True``: the
parameters no rank used keep ``None`` gradients (AdamW's weight decay leaves them alone), the
others equal, step by step.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import leave_job, run_ranks, state_diff, training_state

WORLD, D, STEPS = 2, 5, 5

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
]


class Inner(nn.Module):
    def __init__(self, masked):
        super().__init__()
        import maskedbranch as mb

        experts = [nn.Linear(D, D) for _ in range(3)]
        self.masked = masked
        self.experts = mb.MaskedBranch(experts) if masked else nn.ModuleList(experts)
        self.pre = nn.Linear(D, D)

    def forward(self, x, k):
        h = torch.tanh(self.pre(x))
        if self.masked:
            return h + self.experts(h, k)
        return h + self.experts[k](h) if k >= 0 else h


class Net(nn.Module):
    def __init__(self, masked):
        super().__init__()
        import maskedbranch as mb

        layers = [Inner(masked) for _ in range(2)]
        self.masked = masked
        self.layers = mb.MaskedBranch(layers) if masked else nn.ModuleList(layers)
        self.head = nn.Linear(D, 1)

    def forward(self, x, outer, inner):
        if self.masked:
            y = self.layers(x, outer, inner)
        else:
            y = self.layers[outer](x, inner) if outer >= 0 else torch.zeros_like(x)
        return self.head(x + y)


def _worker(rank, world, init_file, out_dir):
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    torch.manual_seed(3)
    masked, ifelse = Net(True).double(), Net(False).double()
    ifelse.load_state_dict(masked.state_dict())
    models = {"masked": DDP(masked), "ifelse": DDP(ifelse, find_unused_parameters=True)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for k, m in models.items()}
    worst, mismatch, none_grads = 0.0, [], 0
    for step in range(STEPS):
        x = torch.randn(4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 7 + rank))
        outer = (step + rank) % 2  # both layers run somewhere in every step
        inner = (step + rank) % 2  # expert 2 of every layer never runs
        for name, model in models.items():
            opts[name].zero_grad()
            model(x, outer, inner).square().mean().backward()
            opts[name].step()
        w, nm = state_diff(training_state(masked), training_state(ifelse))
        worst, mismatch = max(worst, w), mismatch + [(step, n) for n in nm]
        none_grads += sum(p.grad is None for p in ifelse.parameters())
    torch.save({"worst": worst, "mismatch": mismatch, "none_grads": none_grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_job()


def test_nested_routing_trains_as_ifelse_with_find_unused_parameters():
    for r, res in enumerate(run_ranks(_worker, WORLD, 120, "the DDP job")):
        assert not res["mismatch"], f"rank {r}: None gradients differ from if/else at {res['mismatch'][:5]}"
        assert res["worst"] < 1e-12, f"rank {r}: differs from if/else by {res['worst']}"
        assert res["none_grads"] > 0, "no parameter went unused on every rank: the case tests no reset"
