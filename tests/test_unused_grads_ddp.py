"""The step-time pruning (maskedbranch/unused_grads.py) in a 2-rank gloo job: hand-written
averaging without DDP (the default hook, default group), the explicit handle under DDP, and a
parameter shared between a branch and the rest of the model. The one-process cases are in
tests/test_unused_grads.py.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from maskedbranch import MaskedBranch, unused_grads_to_none

from harness import results_of, run_ranks, run_scenarios, state_diff, training_state
from unused_grads_model import D, N, ROWS, Net, grads_none, loss_of, sgd

WORLD = 2


def gates_for(step, rank):
    g = torch.Generator().manual_seed(step * 131 + rank * 7 + 1)
    ids = torch.randint(-1, N - 1, (ROWS,), generator=g)  # the last branch never runs
    return [ids, (step + rank) % 2]  # layer 1: branch 2 unused, branches 0 and 1 per rank


def without_ddp(rank, group):
    """Hand-written averaging, no DDP: the default hook reduces over the default group."""
    torch.manual_seed(5)
    model = Net(materialize=None).double()  # automatic: zeros outside DDP
    opt = sgd(model.parameters())
    mismatches = []
    for step in range(4):
        opt.zero_grad()
        loss_of(model, step, gates_for(step, rank), rank).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= WORLD
        opt.step()
        used = set()
        for r in range(WORLD):
            for li, gate in enumerate(gates_for(step, r)):
                used.update((li, i) for i in ([gate] if isinstance(gate, int) else gate.tolist()) if i >= 0)
        for li, layer in enumerate(model.layers):
            for i, branch in enumerate(layer):
                if all(grads_none(branch)) == ((li, i) in used):
                    mismatches.append((step, li, i))
    return {"mismatches": mismatches, "params": [p.detach().clone() for p in model.parameters()]}


def explicit_under_ddp(rank, group):
    """materialize_grads=True (zeros, no automatic pruning) with the explicit handle on a DDP
    model equals if/else under DDP(find_unused_parameters=True)."""
    torch.manual_seed(6)
    masked, ifelse = Net(materialize=True).double(), Net(masked=False).double()
    ifelse.load_state_dict(masked.state_dict())
    models = [DDP(masked, process_group=group), DDP(ifelse, process_group=group, find_unused_parameters=True)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=1e-2) for m in models]
    handle = unused_grads_to_none(opts[0], models[0])
    worst, none_mismatch, pruned = 0.0, [], []
    for step in range(4):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            loss_of(m, step, gates_for(step, rank), rank).backward()
            opt.step()
        pruned.append(handle.last_pruned)
        w, nm = state_diff(training_state(masked), training_state(ifelse))
        worst, none_mismatch = max(worst, w), none_mismatch + nm
    return {"worst": worst, "none_mismatch": none_mismatch, "pruned": pruned}


def shared_without_ddp(rank, group):
    """A parameter shared between a branch and the trunk, hand-written averaging: naming the
    model keeps it (without DDP there is no other way to see the trunk)."""
    torch.manual_seed(7)
    trunk, branches = nn.Linear(D, D), [nn.Linear(D, D) for _ in range(N)]
    branches[2].weight = trunk.weight
    model = nn.ModuleDict({"trunk": trunk, "mb": MaskedBranch(branches, materialize_grads=True)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    unused_grads_to_none(opt, model, process_group=group)
    model["mb"](model["trunk"](torch.ones(2, D)), rank).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
    opt.step()
    return {"trunk": trunk.weight.grad is not None, "bias2": branches[2].bias.grad is None}


def shared_under_ddp(rank, group):
    """The same sharing under DDP, automatic setting: DDP tells the model, the trunk's weight
    is kept while the unused branch's own bias is pruned."""
    torch.manual_seed(7)
    trunk, branches = nn.Linear(D, D), [nn.Linear(D, D) for _ in range(N)]
    branches[2].weight = trunk.weight

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk, self.mb = trunk, MaskedBranch(branches)

        def forward(self, x, gate):
            return self.mb(self.trunk(x), gate)

    model = DDP(M(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, D), rank).sum().backward()
    opt.step()
    return {"trunk": trunk.weight.grad is not None, "bias2": branches[2].bias.grad is None}


CASES = {
    "without_ddp": without_ddp,
    "explicit_under_ddp": explicit_under_ddp,
    "shared_without_ddp": shared_without_ddp,
    "shared_under_ddp": shared_under_ddp,
}


def _worker(rank, world, init_file, out_dir):
    run_scenarios(rank, world, init_file, out_dir, CASES)


@pytest.fixture(scope="module")
def ranks():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    return run_ranks(_worker, WORLD, 180, "the pruning job")


@pytest.mark.distributed
def test_without_ddp_prunes_what_no_rank_used(ranks):
    results = results_of(ranks, "without_ddp")
    for r, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {r}: (step, layer, branch) pruned wrongly: {res['mismatches']}"
        for p, q in zip(res["params"], results[0]["params"]):
            assert torch.equal(p, q), f"rank {r}: replicas diverged"


@pytest.mark.distributed
def test_explicit_handle_under_ddp(ranks):
    results = results_of(ranks, "explicit_under_ddp")
    for r, res in enumerate(results):
        assert res["worst"] < 1e-10 and not res["none_mismatch"], (r, res["worst"], res["none_mismatch"])
        assert sum(res["pruned"]) > 0 and res["pruned"] == results[0]["pruned"], res["pruned"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["shared_without_ddp", "shared_under_ddp"])
def test_parameter_shared_with_the_trunk_is_kept(ranks, case):
    for r, res in enumerate(results_of(ranks, case)):
        assert res == {"trunk": True, "bias2": True}, f"rank {r}: {res}"
