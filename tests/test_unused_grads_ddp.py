"""Resetting unused gradients to None in a 2-rank gloo job (maskedbranch/_reducer.py): usage is
reduced after each forward of the data-parallel wrapper, never in ``optimizer.step()``, and only
for the model it serves. Each case trains several steps against the if/else model under
``DistributedDataParallel(find_unused_parameters=True)`` (parameters and gradients equal, None
included), with routing that differs per rank and per step:

* ZeroRedundancyOptimizer (its inner optimizer holds different parameters on each rank);
* ``zero_grad(set_to_none=False)`` (zero tensors stay zero tensors, as with if/else);
* two DDP models with two optimizers (a GAN's generator and discriminator);
* an EMA copy of the model that is not data-parallel, updated and evaluated every step;
* a frozen branch; a parameter shared by a branch and the trunk, with two DDP roots alive;
* a rank-local model in the distributed job (rank 0 trains it alone: no collective, if/else);
* hand-written averaging and an explicit handle (``unused_grads_to_none``);
* DDP's Join (uneven inputs), refused with a message;
* activation checkpointing of every routed layer, reentrant and not, with AdamW;
* ``no_sync`` accumulation where a branch runs on one rank only, in the ``no_sync`` micro-batch,
  with another model's optimizer stepped before this model's first forward, and after it;
* multi-task heads of different output sizes under an int gate (the task differs per rank).

The one-process cases are in tests/test_unused_grads.py.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from maskedbranch import MaskedBranch, unused_grads_to_none

from harness import results_of, run_ranks, run_scenarios, state_diff, training_state
from unused_grads_model import D, N, ROWS, Net, grads_none, loss_of, sgd

WORLD = 2
STEPS = 4


def gates_for(step, rank):
    g = torch.Generator().manual_seed(step * 131 + rank * 7 + 1)
    ids = torch.randint(-1, N - 1, (ROWS,), generator=g)  # the last branch never runs
    return [ids, (step + rank) % 2]  # layer 1: branch 2 unused, branches 0 and 1 per rank


def pair(group, materialize=None, **ddp):
    """The masked model under DDP (find_unused_parameters=False) and the if/else model under
    DDP(find_unused_parameters=True), with the same weights."""
    torch.manual_seed(6)
    masked, ifelse = Net(materialize=materialize).double(), Net(masked=False).double()
    ifelse.load_state_dict(masked.state_dict())
    return DDP(masked, process_group=group, **ddp), DDP(ifelse, process_group=group, find_unused_parameters=True, **ddp)


def compare(models, opts, rank, steps=STEPS, set_to_none=True, between=None, gates=gates_for):
    worst, none_mismatch = 0.0, []
    for step in range(steps):
        for m, opt in zip(models, opts):
            opt.zero_grad(set_to_none=set_to_none)
            loss_of(m, step, gates(step, rank), rank).backward()
            opt.step()
            if between is not None:
                between(m)
        w, nm = state_diff(training_state(models[0].module), training_state(models[1].module))
        worst, none_mismatch = max(worst, w), none_mismatch + [(step, k) for k in nm]
    return {"worst": worst, "none_mismatch": none_mismatch}


def zero(rank, group):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    models = pair(group)
    opts = [ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, process_group=group,
                                    lr=0.01, weight_decay=0.1) for m in models]
    return compare(models, opts, rank)


def set_to_none_false(rank, group):
    """Layer 1's branch 2 runs once, on rank 0 at step 0, then never: it keeps a zero tensor."""
    models = pair(group)
    opts = [sgd(m.parameters()) for m in models]

    def gates(step, rank):
        ids, k = gates_for(step, rank)
        return [ids, 2 if step == rank == 0 else k]

    out = compare(models, opts, rank, set_to_none=False, gates=gates)
    # a branch used once keeps a zero tensor when no rank uses it any more (if/else: untouched)
    out["zeros_kept"] = any(p.grad is not None and not p.grad.any() for p in models[0].parameters())
    return out


class Critic(nn.Module):
    def __init__(self, masked):
        super().__init__()
        torch.manual_seed(9)
        experts = [nn.Linear(2, 1) for _ in range(N)]
        self.experts = MaskedBranch(experts) if masked else nn.ModuleList(experts)
        self.masked = masked

    def forward(self, y, k):
        return self.experts(y, k) if self.masked else self.experts[k](y)


def gan(rank, group):
    """A generator (two routed layers) and a critic (one routed layer), each its own DDP model
    and optimizer; the critic steps first, on detached samples, then the generator."""
    gens = pair(group)
    critics = [DDP(Critic(True).double(), process_group=group),
               DDP(Critic(False).double(), process_group=group, find_unused_parameters=True)]
    critics[1].module.load_state_dict(critics[0].module.state_dict())
    g_opts = [sgd(m.parameters()) for m in gens]
    c_opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in critics]
    worst, none_mismatch = 0.0, []
    for step in range(STEPS):
        k = (step + rank) % N
        for gen, critic, g_opt, c_opt in zip(gens, critics, g_opts, c_opts):
            from unused_grads_model import data

            x, _ = data(step, rank)
            fake = gen(x, gates_for(step, rank))
            c_opt.zero_grad()
            critic(fake.detach(), k).mean().backward()
            c_opt.step()
            g_opt.zero_grad()
            (-critic(fake, (k + 1) % N).mean()).backward()
            g_opt.step()
        for a, b in ((gens[0], gens[1]), (critics[0], critics[1])):
            w, nm = state_diff(training_state(a.module), training_state(b.module))
            worst, none_mismatch = max(worst, w), none_mismatch + [(step, k) for k in nm]
    return {"worst": worst, "none_mismatch": none_mismatch}


def ema(rank, group):
    """An EMA copy, not data-parallel, evaluated under no_grad and updated after every step."""
    models = pair(group)
    copies = [copy.deepcopy(m.module) for m in models]
    opts = [sgd(m.parameters()) for m in models]

    def update(model):
        target = copies[0] if model is models[0] else copies[1]
        with torch.no_grad():
            for e, p in zip(target.parameters(), model.module.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            from unused_grads_model import data

            target(data(0, rank)[0], [torch.zeros(ROWS, dtype=torch.long), 1])

    out = compare(models, opts, rank, between=update)
    out["ema"] = max(float((a - b).abs().max()) for a, b in zip(copies[0].parameters(), copies[1].parameters()))
    return out


def frozen_branch(rank, group):
    models = pair(group)
    for m in models:
        for p in m.module.layers[0][1].parameters():
            p.requires_grad_(False)
    models = [DDP(m.module, process_group=group, find_unused_parameters=fup)
              for m, fup in zip(models, (False, True))]
    opts = [sgd([p for p in m.parameters() if p.requires_grad]) for m in models]
    return compare(models, opts, rank)


def shared_two_roots(rank, group):
    """A parameter shared by a branch and the trunk, in one of two DDP models alive at once:
    the trunk keeps it (never reset) while the unused branch's own bias is reset."""
    trunk, branches = nn.Linear(D, D), [nn.Linear(D, D) for _ in range(N)]
    branches[2].weight = trunk.weight

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk, self.mb = trunk, MaskedBranch(branches)

        def forward(self, x, gate):
            return self.mb(self.trunk(x), gate)

    model = DDP(M(), process_group=group)
    other = DDP(Critic(True), process_group=group)  # a second root, in the same process
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1, momentum=0.9)
    model(torch.ones(2, D), rank).sum().backward()
    other(torch.ones(2, 2), rank).sum().backward()
    opt.step()
    return {"trunk": trunk.weight.grad is not None, "bias2": branches[2].bias.grad is None,
            "other_unused": other.module.experts[2].weight.grad is None}


def rank_local(rank, group):
    """Rank 0 trains a small routed model of its own while rank 1 waits at a barrier: no
    collective may run, and it trains as if/else in one process (no gradient for dead branches)."""
    result = None
    if rank == 0:
        torch.manual_seed(3)
        masked, ifelse = Net(materialize=None).double(), Net(masked=False).double()
        ifelse.load_state_dict(masked.state_dict())
        opts = [sgd(m.parameters()) for m in (masked, ifelse)]
        worst, nm = 0.0, []
        for step in range(STEPS):
            for m, opt in zip((masked, ifelse), opts):
                opt.zero_grad()
                loss_of(m, step, gates_for(step, 0)).backward()
                opt.step()
            w, n = state_diff(training_state(masked), training_state(ifelse))
            worst, nm = max(worst, w), nm + n
        result = {"worst": worst, "none_mismatch": nm, "dead_none": all(grads_none(masked.layers[0][2]))}
    dist.barrier(group=group)
    return result


def hand_written(rank, group):
    """Hand-written averaging, no DDP: the model is named to unused_grads_to_none, its forward
    (run by every rank) reduces the usage, and the routing ties with zeros."""
    torch.manual_seed(5)
    model = Net().double()
    opt = sgd(model.parameters())
    handle = unused_grads_to_none(opt, model, process_group=group)
    mismatches, reset = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step, gates_for(step, rank), rank).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= WORLD
        opt.step()
        reset.append(handle.last_reset)
        used = set()
        for r in range(WORLD):
            for li, gate in enumerate(gates_for(step, r)):
                used.update((li, i) for i in ([gate] if isinstance(gate, int) else gate.tolist()) if i >= 0)
        for li, layer in enumerate(model.layers):
            for i, branch in enumerate(layer):
                if all(grads_none(branch)) == ((li, i) in used):
                    mismatches.append((step, li, i))
    return {"mismatches": mismatches, "reset": reset, "params": [p.detach().clone() for p in model.parameters()]}


def explicit_under_ddp(rank, group):
    """materialize_grads=True (zeros, no automatic reset) with the explicit handle on a DDP
    model equals if/else under DDP(find_unused_parameters=True)."""
    models = pair(group, materialize=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=1e-2) for m in models]
    unused_grads_to_none(opts[0], models[0])  # the optimizer's hook holds the handle
    return compare(models, opts, rank)


def join_refused(rank, group):
    from torch.distributed.algorithms.join import Join

    model, _ = pair(group)
    try:
        with Join([model]):
            loss_of(model, 0, gates_for(0, rank), rank).backward()
        return "no error"
    except RuntimeError as e:
        return str(e)


def static_unused(rank, group):
    """A parameter outside every routing module that the forward never uses: maskedbranch says
    which at the first step, before DDP's generic error at the second forward."""

    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.spare = Net(materialize=None).double(), nn.Linear(2, 2).double()

        def forward(self, x, gates):
            return self.net(x, gates)

    model = DDP(WithSpare(), process_group=group)
    opt = sgd(model.parameters())
    try:
        loss_of(model, 0, gates_for(0, rank), rank).backward()
        opt.step()
        return "no error"
    except RuntimeError as e:
        return str(e)


class CheckpointedNet(nn.Module):
    """3 routed layers of ``Linear(8, 8)`` branches, each layer checkpointed (``ckpt``: "reentrant",
    "non-reentrant", or None for the plain model)."""

    def __init__(self, masked, ckpt):
        super().__init__()
        torch.manual_seed(21)
        self.masked, self.ckpt = masked, ckpt
        self.pre = nn.Linear(4, 8)
        self.layers = nn.ModuleList((MaskedBranch if masked else nn.ModuleList)([nn.Linear(8, 8) for _ in range(N)])
                                    for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x, path):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.pre(x))
        for layer, k in zip(self.layers, path):
            run = (lambda t, layer=layer, k=k: torch.tanh(layer(t, k))) if self.masked else (
                lambda t, layer=layer, k=k: torch.tanh(layer[k](t)))
            if self.ckpt is None:
                h = h + run(h)
            else:
                h = h + checkpoint(run, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(h)


def checkpointed(ckpt):
    def case(rank, group):
        """Every rank its own path through 3 checkpointed routed layers, 5 steps of AdamW,
        against the same if/else model without checkpointing under find_unused_parameters=True
        (which fails with reentrant checkpointing and per-rank routing)."""
        masked = DDP(CheckpointedNet(True, ckpt).double(), process_group=group)
        ifelse = DDP(CheckpointedNet(False, None).double(), process_group=group, find_unused_parameters=True)
        models = [masked, ifelse]
        opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in models]
        worst, none_mismatch, grads = 0.0, [], []
        for step in range(5):
            g = torch.Generator().manual_seed(step * 7 + rank)
            x, t = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)
            path = torch.randint(0, N, (3,), generator=g).tolist()
            for m, opt in zip(models, opts):
                opt.zero_grad()
                (m(x, path) - t).square().mean().backward()
                opt.step()
            w, nm = state_diff(training_state(masked.module), training_state(ifelse.module))
            worst, none_mismatch = max(worst, w), none_mismatch + [(step, k) for k in nm]
            grads.append([None if p.grad is None else p.grad.clone() for p in masked.parameters()])
        return {"worst": worst, "none_mismatch": none_mismatch, "grads": grads}

    return case


def no_sync_first(other_first):
    def case(rank, group):
        """Two micro-batches, the first under no_sync; layer 0's branch 2 runs on rank 1 only, in
        the no_sync micro-batch. ``other_first``: another model's optimizer steps before this DDP
        model's first forward (a multi-task job's other head, a GAN's critic)."""
        other = Net(materialize=None).double()
        other_opt = sgd(other.parameters())
        models = pair(group)
        opts = [sgd(m.parameters()) for m in models]
        if other_first:
            loss_of(other, 0, gates_for(0, rank), rank).backward()
            other_opt.step()
        worst, none_mismatch = 0.0, []
        for step in range(STEPS):
            for m, opt in zip(models, opts):
                opt.zero_grad()
                with m.no_sync():
                    first = [torch.full((ROWS,), 2 if rank == 1 and step == 0 else rank, dtype=torch.long), 0]
                    loss_of(m, step, first, rank).backward()
                loss_of(m, step + 100, [torch.zeros(ROWS, dtype=torch.long), 1], rank).backward()
                opt.step()
            if not other_first:
                other_opt.zero_grad()
                loss_of(other, step, gates_for(step, rank), rank).backward()
                other_opt.step()
            w, nm = state_diff(training_state(models[0].module), training_state(models[1].module))
            worst, none_mismatch = max(worst, w), none_mismatch + [(step, k) for k in nm]
        return {"worst": worst, "none_mismatch": none_mismatch, "params": [p.detach().clone() for p in models[0].parameters()]}

    return case


class Heads(nn.Module):
    """A shared trunk and one head per task, of its own width (2, 3, 5 outputs)."""

    def __init__(self, masked):
        super().__init__()
        torch.manual_seed(13)
        self.masked = masked
        self.trunk = nn.Linear(4, 6)
        heads = [nn.Linear(6, w) for w in (2, 3, 5)]
        self.heads = MaskedBranch(heads) if masked else nn.ModuleList(heads)

    def forward(self, x, task):
        h = torch.tanh(self.trunk(x))
        return self.heads(h, task) if self.masked else self.heads[task](h)


def heads(rank, group):
    """Multi-task heads of different widths under an int gate, the task differing per rank and
    step: trains as if/else under find_unused_parameters=True (AdamW)."""
    models = [DDP(Heads(True).double(), process_group=group),
              DDP(Heads(False).double(), process_group=group, find_unused_parameters=True)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in models]
    worst, none_mismatch = 0.0, []
    for step in range(5):
        task = 0 if step == 4 else (step + rank) % 2  # head 2 never runs
        g = torch.Generator().manual_seed(step * 3 + rank)
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            m(x, task).square().mean().backward()
            opt.step()
        w, nm = state_diff(training_state(models[0].module), training_state(models[1].module))
        worst, none_mismatch = max(worst, w), none_mismatch + [(step, k) for k in nm]
    return {"worst": worst, "none_mismatch": none_mismatch}


def per_call_path(rank, group):
    """Int-gate calls under DDP in a training loop (AdamW, 6 steps): the chosen branch is called
    directly (no routing path), each module decides once for the wrapper, and the dead branches'
    parameters are tied by the wrapper (DDP's reduction finishes every step)."""
    from maskedbranch import _route, _unit, _reducer

    counts = {"route": 0, "decide": 0}
    route, decide = _route.route, _reducer.decide

    def counted_route(*args, **kwargs):
        counts["route"] += 1
        return route(*args, **kwargs)

    def counted_decide(*args, **kwargs):
        counts["decide"] += 1
        return decide(*args, **kwargs)

    _route.route, _unit.DATA_PARALLEL.decide = counted_route, counted_decide
    try:
        model, ifelse = (m for m in (DDP(Heads(True).double(), process_group=group),
                                     DDP(Heads(False).double(), process_group=group, find_unused_parameters=True)))
        opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ifelse)]
        for step in range(6):
            x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            for m, opt in zip((model, ifelse), opts):
                opt.zero_grad()
                m(x, (step + rank) % 3).square().mean().backward()
                opt.step()
        tyings = {m._unit.tying.name for m in model.modules() if hasattr(m, "_unit")}
        w, nm = state_diff(training_state(model.module), training_state(ifelse.module))
    finally:
        _route.route, _unit.DATA_PARALLEL.decide = route, staticmethod(decide)
    return {**counts, "tyings": sorted(tyings), "worst": w, "none_mismatch": nm}


CASES = {
    "zero": zero, "set_to_none_false": set_to_none_false, "gan": gan, "ema": ema, "frozen_branch": frozen_branch,
    "shared_two_roots": shared_two_roots, "rank_local": rank_local, "hand_written": hand_written,
    "explicit_under_ddp": explicit_under_ddp, "join_refused": join_refused, "static_unused": static_unused,
    "ckpt_reentrant": checkpointed("reentrant"), "ckpt_non_reentrant": checkpointed("non-reentrant"),
    "no_sync_other_first": no_sync_first(True), "no_sync_other_after": no_sync_first(False), "heads": heads,
    "per_call_path": per_call_path,
}


def _worker(rank, world, init_file, out_dir):
    run_scenarios(rank, world, init_file, out_dir, CASES)


@pytest.fixture(scope="module")
def ranks():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    return run_ranks(_worker, WORLD, 300, "the reset job")


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", ["zero", "set_to_none_false", "gan", "ema", "frozen_branch", "explicit_under_ddp",
                                  "ckpt_reentrant", "ckpt_non_reentrant", "no_sync_other_first", "no_sync_other_after",
                                  "heads"])
def test_trains_as_ifelse_with_find_unused_parameters(ranks, case):
    for r, res in enumerate(results_of(ranks, case)):
        assert res["worst"] < 1e-10 and not res["none_mismatch"], (r, res["worst"], res["none_mismatch"][:5])
    if case == "set_to_none_false":
        assert all(res["zeros_kept"] for res in results_of(ranks, case))
    if case == "ema":
        assert all(res["ema"] < 1e-10 for res in results_of(ranks, case))


def test_shared_parameter_kept_with_two_roots(ranks):
    for r, res in enumerate(results_of(ranks, "shared_two_roots")):
        assert res == {"trunk": True, "bias2": True, "other_unused": True}, f"rank {r}: {res}"


def test_rank_local_model_trains_as_ifelse_without_collectives(ranks):
    res = results_of(ranks, "rank_local")[0]
    assert res["worst"] < 1e-12 and not res["none_mismatch"] and res["dead_none"], res


def test_hand_written_averaging_with_an_explicit_handle(ranks):
    results = results_of(ranks, "hand_written")
    for r, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {r}: (step, layer, branch) reset wrongly: {res['mismatches']}"
        assert sum(res["reset"]) > 0 and res["reset"] == results[0]["reset"]
        for p, q in zip(res["params"], results[0]["params"]):
            assert torch.equal(p, q), f"rank {r}: replicas diverged"


def test_join_is_refused_with_a_message(ranks):
    for res in results_of(ranks, "join_refused"):
        assert "Join (uneven inputs)" in res and "materialize_grads=True" in res, res


def test_unused_parameter_outside_routing_is_named_at_the_first_step(ranks):
    for res in results_of(ranks, "static_unused"):
        assert res.startswith("maskedbranch: spare.weight, spare.bias took no part in this backward"), res
        assert "find_unused_parameters=True" in res


@pytest.mark.parametrize("case", ["ckpt_reentrant", "ckpt_non_reentrant"])
def test_checkpointed_gradients_are_averaged(ranks, case):
    """The gradients of every step are the same on both ranks (averaged, not each rank's own)."""
    a, b = results_of(ranks, case)
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        for i, (x, y) in enumerate(zip(ga, gb)):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"step {step}, parameter {i}"


@pytest.mark.parametrize("case", ["no_sync_other_first", "no_sync_other_after"])
def test_no_sync_replicas_stay_equal(ranks, case):
    a, b = results_of(ranks, case)
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))


def test_int_gate_under_ddp_calls_the_branch_and_decides_once(ranks):
    for r, res in enumerate(results_of(ranks, "per_call_path")):
        assert res["route"] == 0 and res["decide"] == 1 and res["tyings"] == ["AT_WRAPPER"], (r, res)
        assert res["worst"] < 1e-10 and not res["none_mismatch"], (r, res)
