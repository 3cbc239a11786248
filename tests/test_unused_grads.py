"""unused_grads_to_none: parameters of branches that no rank ran get a None gradient before the
optimizer step, so that training equals if/else routing with find_unused_parameters=True (momentum,
Adam moments and weight decay leave such parameters alone).

Single-process checks of which parameters are pruned, then a 4-rank gloo job that trains the same
model three ways and compares parameters and optimizer state after every step.
"""
import copy
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from maskedbranch import MaskedBranch, ResidualDropPath, reference, unused_grads_to_none

from rank_jobs import results_of, run_ranks

WORLD = 4
N = 3
D = 6
ROWS = 8
TIMEOUT_S = 240


def mlp():
    return nn.Sequential(nn.Linear(D, 10), nn.Tanh(), nn.Linear(10, D))


class Net(nn.Module):
    """Two routed layers between a trunk and a head; ``mode`` "masked" or "ifelse"."""

    def __init__(self, materialize=False):
        super().__init__()
        self.pre = nn.Linear(4, D)
        self.layers = nn.ModuleList(
            MaskedBranch([mlp() for _ in range(N)], materialize_grads=materialize) for _ in range(2)
        )
        self.head = nn.Linear(D, 2)
        self.mode = "masked"

    def forward(self, x, gates):
        h = torch.tanh(self.pre(x))
        for layer, gate in zip(self.layers, gates):
            if self.mode == "masked":
                y = layer(h, gate)
            else:
                y = reference.masked_branch_ifelse(list(layer.branches), h, gate)
            h = h + (0 if y is None else y)
        return self.head(h)


def gates_for(step, rank, kind):
    g = torch.Generator().manual_seed(step * 131 + rank * 7 + 1)
    if kind == "int":  # often the same branch on every rank: some branches go unused globally
        return [int(torch.randint(-1, N, (), generator=g)) if (step + rank) % 3 else step % N for _ in range(2)]
    ids = torch.randint(-1, N - 1, (ROWS,), generator=g)  # the last branch never runs
    if step % 4 == 0:
        ids[:] = 0 if rank % 2 else 1
    return [ids, ids.flip(0)]


def data(step, rank):
    g = torch.Generator().manual_seed(10_000 + step * 17 + rank)
    return torch.randn(ROWS, 4, generator=g, dtype=torch.float64), torch.randn(ROWS, 2, generator=g, dtype=torch.float64)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=1e-2)


def max_param_diff(a, b):
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def state_keys(model, opt):
    names = {id(p): k for k, p in model.named_parameters()}
    return sorted(names[id(p)] for p in opt.state)


# ----------------------------------------------------------------------------------------------
# One process.


def test_dead_branches_pruned_and_state_untouched():
    torch.manual_seed(0)
    model = Net(materialize=True).double()
    opt = make_optimizer("sgd", model.parameters())
    hook = unused_grads_to_none(opt, model)
    x, t = data(0, 0)
    (model(x, [0, 2]) - t).square().mean().backward()
    # materialize_grads: every parameter has a gradient before the step ...
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    # ... the unused branches' were set to None, so the optimizer kept no state for them
    assert hook.last_pruned == 2 * 2 * 4  # 2 layers x 2 unused branches x 4 tensors
    for li, used in ((0, 0), (1, 2)):
        for i, branch in enumerate(model.layers[li].branches):
            for p in branch.parameters():
                assert (p.grad is not None) == (i == used)
                assert (p in opt.state) == (i == used)
    assert model.pre.weight.grad is not None and model.head.weight.grad is not None


def test_matches_ifelse_in_one_process():
    """Without DDP: masked + hook equals the if/else model step by step, with momentum."""
    torch.manual_seed(1)
    masked = Net(materialize=True).double()
    ifelse = copy.deepcopy(masked)
    ifelse.mode = "ifelse"
    opts = {k: make_optimizer("adamw", m.parameters()) for k, m in (("m", masked), ("i", ifelse))}
    unused_grads_to_none(opts["m"], masked)
    for step in range(12):
        x, t = data(step, 0)
        gates = gates_for(step, 0, "int")
        for k, m in (("m", masked), ("i", ifelse)):
            opts[k].zero_grad()
            (m(x, gates) - t).square().mean().backward()
            opts[k].step()
        assert max_param_diff(masked, ifelse) < 1e-12
    assert state_keys(masked, opts["m"]) == state_keys(ifelse, opts["i"])


def test_no_grad_calls_do_not_count():
    model = Net(materialize=True).double()
    opt = make_optimizer("sgd", model.parameters())
    hook = unused_grads_to_none(opt, model)
    x, t = data(0, 0)
    (model(x, [0, 0]) - t).square().mean().backward()
    with torch.no_grad():
        model(x, [1, 1])  # an evaluation between backward and step
    opt.step()
    assert hook.last_pruned == 2 * 2 * 4
    assert model.layers[0].branches[1][0].weight.grad is None


def test_bits_accumulate_until_the_step():
    """Gradient accumulation: a branch used by any micro-batch since the last step is kept."""
    model = Net(materialize=True).double()
    opt = make_optimizer("sgd", model.parameters())
    hook = unused_grads_to_none(opt, model)
    x, t = data(0, 0)
    for gates in ([0, 0], [1, 0]):
        (model(x, gates) - t).square().mean().backward()
    opt.step()
    assert hook.last_pruned == (1 + 2) * 4  # layer 0: branch 2; layer 1: branches 1 and 2
    opt.zero_grad()
    (model(x, [2, 2]) - t).square().mean().backward()
    opt.step()  # the bits were reset by the previous step
    assert hook.last_pruned == 2 * 2 * 4


def test_branch_inserted_without_registration():
    """ModuleList.insert registers nothing, so the hook's layout stays the old one: the new
    branch is never pruned, and its bit must not shift the other layers' bits."""
    model = Net(materialize=True).double()
    new = mlp().double()  # built first: building a module registers its children
    opt = make_optimizer("sgd", model.parameters())
    unused_grads_to_none(opt, model)
    x, t = data(0, 0)
    (model(x, [0, 0]) - t).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model.layers[0].branches.insert(N, new)
    (model(x, [N, 0]) - t).square().mean().backward()
    opt.step()
    assert all(p.grad is not None for p in new.parameters())
    for i, branch in enumerate(model.layers[1].branches):
        assert all((p.grad is not None) == (i == 0) for p in branch.parameters())


def test_shared_parameters():
    trunk = nn.Linear(D, D)
    a, b, c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
    b.weight = a.weight  # shared by branches 0 and 1
    c.weight = trunk.weight  # shared with the trunk: never pruned

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = trunk
            self.mb = MaskedBranch([a, b, c], materialize_grads=True)

        def forward(self, x, gate):
            return self.mb(self.trunk(x), gate)

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    unused_grads_to_none(opt, model)
    x = torch.randn(3, D)
    model(x, 1).sum().backward()
    opt.step()
    assert a.weight.grad is not None  # used through branch 1
    assert a.bias.grad is None and c.bias.grad is None
    assert c.weight.grad is not None  # the trunk's weight
    opt.zero_grad()
    model(x, 2).sum().backward()
    opt.step()
    assert a.weight.grad is None and a.bias.grad is None and b.bias.grad is None


def test_nested_and_residual_drop_path():
    inner = MaskedBranch([mlp(), mlp()], materialize_grads=True)
    outer = MaskedBranch([nn.Sequential(inner), mlp()], materialize_grads=True)
    gen = torch.Generator().manual_seed(0)
    rdp = ResidualDropPath(mlp(), drop_prob=0.999, mode="batch", generator=gen, materialize_grads=True)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer, self.rdp = outer, rdp

        def forward(self, x, k, j):
            # k = 0: the inner layer is called directly (outer records nothing for branch 0)
            return self.rdp(self.outer(x, k) if k != 0 else inner(x, j))

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = unused_grads_to_none(opt, model)
    x = torch.randn(4, D)
    model(x, 1, 0).sum().backward()
    opt.step()
    assert all(p.grad is None for p in outer.branches[0].parameters())  # inner: not called
    assert all(p.grad is not None for p in outer.branches[1].parameters())
    assert all(p.grad is None for p in rdp.parameters())  # dropped
    assert hook.last_pruned == 2 * 4 + 4
    opt.zero_grad()
    model(x, 0, 1).sum().backward()
    opt.step()
    # inner branch 1 ran (its outer unit did not record it, but one unit of each parameter ran)
    assert all(p.grad is not None for p in inner.branches[1].parameters())
    assert all(p.grad is None for p in inner.branches[0].parameters())
    assert all(p.grad is None for p in outer.branches[1].parameters())
    # pruned: inner branch 0 and the dropped residual branch; outer branch 1 was not in the
    # graph at all (outer was not called), so its gradients were None already
    assert hook.last_pruned == 4 + 4


def test_remove_and_bad_inputs():
    model = Net(materialize=True)
    opt = make_optimizer("sgd", model.parameters())
    hook = unused_grads_to_none(opt, model)
    hook.remove()
    x, _ = data(0, 0)
    model(x.float(), [0, 0]).sum().backward()
    opt.step()
    assert model.layers[0].branches[1][0].weight.grad is not None  # not pruned any more
    with pytest.raises(TypeError, match="optimizer"):
        unused_grads_to_none(model, model)
    with pytest.raises(TypeError, match="model"):
        unused_grads_to_none(opt, [model])
    with pytest.raises(ValueError, match="model: contains no MaskedBranch"):
        unused_grads_to_none(opt, nn.Linear(2, 2))


class LoggedGrad(nn.Parameter):
    """A parameter subclass that sees assignments to .grad (as a subclass might track them)."""

    def __setattr__(self, name, value):
        if name == "grad":
            self.assigned = value
        super().__setattr__(name, value)


def test_grads_to_none_clears_and_counts():
    from maskedbranch import _C

    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    c = LoggedGrad(torch.ones(2))
    a.grad, c.grad = torch.ones(2), torch.ones(2)
    assert _C.grads_to_none([a, b, c]) == 2
    assert a.grad is None and b.grad is None and c.grad is None
    assert c.assigned is None  # the subclass's own assignment ran
    assert _C.grads_to_none(()) == 0
    with pytest.raises(TypeError, match=r"params\[1\]"):
        _C.grads_to_none([a, 3])


# ----------------------------------------------------------------------------------------------
# Four ranks: masked + hook (find_unused_parameters=False) against if/else with
# find_unused_parameters=True, and masked without the hook (which must differ).


def train(rank, group, kind, opt_name, steps=16, accumulate=1, **ddp_kwargs):
    torch.manual_seed(1234)
    base = Net().double()
    models = {"hook": copy.deepcopy(base), "ifelse": copy.deepcopy(base), "plain": copy.deepcopy(base)}
    models["ifelse"].mode = "ifelse"
    ddps = {
        k: DDP(m, process_group=group, find_unused_parameters=(k == "ifelse"), **ddp_kwargs) for k, m in models.items()
    }
    opts = {k: make_optimizer(opt_name, m.parameters()) for k, m in models.items()}
    hook = unused_grads_to_none(opts["hook"], ddps["hook"])
    worst, worst_plain, pruned = 0.0, 0.0, []
    for step in range(steps):
        for k, ddp in ddps.items():
            opts[k].zero_grad()
            for micro in range(accumulate):
                x, t = data(step * accumulate + micro, rank)
                gates = gates_for(step * accumulate + micro, rank, kind)
                if micro < accumulate - 1:
                    with ddp.no_sync():
                        (ddp(x, gates) - t).square().mean().backward()
                else:
                    (ddp(x, gates) - t).square().mean().backward()
            opts[k].step()
        pruned.append(hook.last_pruned)
        worst = max(worst, max_param_diff(models["hook"], models["ifelse"]))
        worst_plain = max(worst_plain, max_param_diff(models["plain"], models["ifelse"]))
    return {
        "worst": worst,
        "worst_plain": worst_plain,
        "pruned": pruned,
        "state_equal": state_keys(models["hook"], opts["hook"]) == state_keys(models["ifelse"], opts["ifelse"]),
        "params": [p.detach().clone() for p in models["hook"].parameters()],
    }


def used_anywhere(step, world, kind):
    """(layer, branch) pairs that some rank routes rows to at this step."""
    used = set()
    for r in range(world):
        for layer, gate in enumerate(gates_for(step, r, kind)):
            ids = [gate] if isinstance(gate, int) else gate.tolist()
            used.update((layer, i) for i in ids if i >= 0)
    return used


def train_without_ddp(rank, group, kind, steps=6):
    """No DDP wrapper (e.g. hand-written averaging): the step hook reduces the bits itself."""
    torch.manual_seed(5)
    model = Net(materialize=True).double()
    opt = make_optimizer("sgd", model.parameters())
    unused_grads_to_none(opt, model, process_group=group)
    world = dist.get_world_size(group)
    mismatches = []
    for step in range(steps):
        opt.zero_grad()
        x, t = data(step, rank)
        (model(x, gates_for(step, rank, kind)) - t).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
        opt.step()
        used = used_anywhere(step, world, kind)
        for li, layer in enumerate(model.layers):
            for i, branch in enumerate(layer.branches):
                pruned = branch[0].weight.grad is None
                if pruned == ((li, i) in used):
                    mismatches.append((step, li, i, pruned))
    return {"mismatches": mismatches, "params": [p.detach().clone() for p in model.parameters()]}


def forwards_without_backward(rank, group, n=40):
    """Forwards with autograd on but no backward (evaluation without torch.no_grad): the pending
    reductions stay bounded, count as use, and the next step prunes alike on every rank."""
    torch.manual_seed(9)
    model = Net().double()
    ddp = DDP(model, process_group=group)
    opt = make_optimizer("sgd", model.parameters())
    hook = unused_grads_to_none(opt, ddp)
    longest = 0
    for i in range(n):
        x, _ = data(100 + i, rank)
        ddp(x, [0, 0])  # only branch 0 of each layer runs
        longest = max(longest, len(hook._pending))
    x, t = data(1, rank)
    (ddp(x, [0, 0]) - t).square().mean().backward()
    opt.step()
    return {
        "longest": longest,
        "pruned": hook.last_pruned,
        "params": [p.detach().clone() for p in model.parameters()],
    }


CASES = {
    "int-sgd": dict(kind="int", opt_name="sgd"),
    "ids-adamw": dict(kind="ids", opt_name="adamw"),
    "int-adamw-bucket-view": dict(kind="int", opt_name="adamw", gradient_as_bucket_view=True),
    "ids-sgd-no-sync": dict(kind="ids", opt_name="sgd", accumulate=2),
}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    results = {}
    jobs = [(name, lambda group, case=case: train(rank, group, **case)) for name, case in CASES.items()]
    jobs.append(("no-ddp", lambda group: train_without_ddp(rank, group, "ids")))
    jobs.append(("no-backward", lambda group: forwards_without_backward(rank, group)))
    for name, job in jobs:
        group = dist.new_group(backend="gloo")
        try:
            results[name] = ("ok", job(group))
        except Exception:  # reported by the test that reads it
            results[name] = ("error", traceback.format_exc())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    return run_ranks(_worker, WORLD, TIMEOUT_S, "the DDP job")


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_matches_ifelse_find_unused(ranks, case):
    results = results_of(ranks, case)
    for r, res in enumerate(results):
        assert res["worst"] < 1e-10, f"rank {r}: masked + hook differs from if/else by {res['worst']}"
        assert res["state_equal"], f"rank {r}: the optimizer kept state for other parameters than if/else"
        assert sum(res["pruned"]) > 0, "no step had a branch that no rank used: the case tests nothing"
        # without the hook, momentum / Adam moments move the unused branches: training differs
        assert res["worst_plain"] > 1e-6
        assert res["pruned"] == results[0]["pruned"], "ranks disagree on what was unused"
        for p, q in zip(res["params"], results[0]["params"]):
            assert torch.equal(p, q), f"rank {r}: replicas diverged"


def test_without_ddp_prunes_what_no_rank_used(ranks):
    results = results_of(ranks, "no-ddp")
    for r, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {r}: (step, layer, branch, pruned) wrong: {res['mismatches']}"
        for p, q in zip(res["params"], results[0]["params"]):
            assert torch.equal(p, q), f"rank {r}: replicas diverged"


def test_forwards_without_backward_keep_pending_bounded(ranks):
    results = results_of(ranks, "no-backward")
    for r, res in enumerate(results):
        assert res["longest"] <= 17, f"rank {r}: {res['longest']} reductions pending"
        assert res["pruned"] == 2 * 2 * 4, f"rank {r}: pruned {res['pruned']} (branches 1 and 2 of both layers)"
        for p, q in zip(res["params"], results[0]["params"]):
            assert torch.equal(p, q), f"rank {r}: replicas diverged"
