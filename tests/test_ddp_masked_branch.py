"""MaskedBranch and masked_branch under DistributedDataParallel, real processes (4 ranks, gloo).

One spawn runs every scenario (each in its own process group). Training scenarios train the
MaskedBranch model with no flag and, side by side, the code it replaces: the same model with
plain if/else routing (``reference.masked_branch_ifelse`` over an ``nn.ModuleList``) under
``DistributedDataParallel(find_unused_parameters=True)``. Routing differs per rank and step and
includes branches that no rank uses and ranks where no row reaches any branch; the optimizers
have momentum and weight decay (SGD, AdamW), so a zero gradient where if/else has None would
show. After every step the parameters and gradients (None included) must equal the reference's,
and the replicas must stay identical.
"""
import contextlib
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from maskedbranch import MaskedBranch, _compat, masked_branch, reference

from harness import leave_job, results_of, run_ranks, state_diff, training_state

WORLD = 4
N = 3  # branches per routed layer
ROWS = 8  # per rank and step
D = 6
TIMEOUT_S = 300

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
]


# ----------------------------------------------------------------------------------------------
# The model, in both forms.


def make_branch(bn=False):
    return nn.Sequential(nn.Linear(D, 10), *([nn.BatchNorm1d(10)] if bn else []), nn.GELU(), nn.Linear(10, D))


class Net(nn.Module):
    """pre -> ``choices`` (MaskedBranch, any gate kind) -> ``experts`` (masked_branch, ids) ->
    head. ``masked=False``: the if/else model it replaces (``nn.ModuleList`` s, same keys).
    ``soft``: a learned router turns a keep mask into softmax weights on a top-2 mask."""

    def __init__(self, masked=True, bn=False, soft=False):
        super().__init__()
        self.masked = masked
        self.pre = nn.Linear(4, D)
        self.router = nn.Linear(D, N) if soft else None
        branches = [make_branch(bn) for _ in range(N)]
        self.choices = MaskedBranch(branches) if masked else nn.ModuleList(branches)
        self.experts = nn.ModuleList(make_branch() for _ in range(N))
        self.head = nn.Linear(D, 2)

    def route(self, branches, h, gate):
        if self.masked:
            return masked_branch(branches, h, gate) if isinstance(branches, list) else branches(h, gate)
        y = reference.masked_branch_ifelse(list(branches), h, gate)
        return 0 if y is None else y

    def forward(self, x, gate, ids):
        h = torch.tanh(self.pre(x))
        if self.router is not None:
            probs = self.router(h).softmax(1)
            with torch.no_grad():
                top2 = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, probs.topk(2, dim=1).indices, True)
            gate = probs * (top2 & gate[:, None])
        h = h + self.route(self.choices, h, gate)
        h = h + self.route(list(self.experts), h, ids)
        return self.head(h)


def pair(seed, **kwargs):
    """The MaskedBranch model and the if/else model, with identical weights."""
    torch.manual_seed(seed)  # identical initial weights on every rank
    masked = Net(True, **kwargs).double()
    ifelse = Net(False, **kwargs).double()
    ifelse.load_state_dict(masked.state_dict())  # the keys are the ModuleList's
    return masked, ifelse


def batch(index, rank, kind, bn=False, accumulate=1):
    """Data and gates that differ per rank and micro-batch. Odd steps leave the last branch of
    ``choices`` unused on every rank, steps 2 mod 3 branch 0 of ``experts``; now and then a
    rank routes no row at all."""
    g = torch.Generator().manual_seed(index * 101 + rank * 7 + 3)
    step = index // accumulate
    x = torch.randn(ROWS, 4, generator=g, dtype=torch.float64)
    target = torch.randn(ROWS, 2, generator=g, dtype=torch.float64)
    if kind == "mixed":
        kind = ("int", "ids", "mask", "weights")[index % 4]
    top = N - (step % 2)
    all_dead = (index + rank) % 5 == 3
    if kind == "int":
        gate = -1 if all_dead else int(torch.randint(0, top, (), generator=g))
    elif kind == "ids":
        gate = torch.randint(-1, top, (ROWS,), generator=g)
        if bn:  # BatchNorm needs 0 or at least 2 rows per branch
            for i in range(N):
                if int((gate == i).sum()) == 1:
                    gate[gate == i] = -1
        if all_dead:
            gate.fill_(-1)
    elif kind in ("mask", "weights"):
        gate = torch.rand(ROWS, N, generator=g) < 0.45
        gate[:, top:] = False
        if all_dead:
            gate.fill_(False)
        if kind == "weights":
            gate = torch.rand(ROWS, N, generator=g, dtype=torch.float64) * gate
    else:  # "soft": the keep mask the router's weights are multiplied by
        gate = torch.rand(ROWS, generator=g) < 0.8
        if all_dead:
            gate.fill_(False)
    ids = torch.randint(1 if step % 3 == 2 else -1, N, (ROWS,), generator=g)
    if (index + 2 * rank) % 7 == 5:
        ids.fill_(-1)
    return x, target, gate, ids


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ----------------------------------------------------------------------------------------------
# Scenarios, run on every rank.


def train(rank, group, opt_name, steps=8, kind="mixed", accumulate=1, bn=False, soft=False, fallback=False,
          no_callback=False, **ddp_kwargs):
    """MaskedBranch with no flag under DDP(**ddp_kwargs) against if/else under
    DDP(find_unused_parameters=True), step by step. ``no_callback``: DDP built without
    ``_compat.queue_backward_callback`` (every parameter stays DDP's, dead ones tied)."""
    masked, ifelse = pair(11, bn=bn, soft=soft)
    sync = {"broadcast_buffers": True} if bn else {}
    _compat._force_fallback["callback"] = no_callback
    try:
        models = {
            "masked": DDP(masked, process_group=group, **ddp_kwargs, **sync),
            "ifelse": DDP(ifelse, process_group=group, find_unused_parameters=True, **sync),
        }
    finally:
        _compat._force_fallback["callback"] = False
    owned = sorted(n for n in models["masked"].parameters_to_ignore if not n.startswith("."))
    expected = [] if no_callback else sorted(n for n, _ in masked.named_parameters() if n.startswith("choices."))
    assert owned == expected, (owned, expected)
    opts = {k: make_optimizer(opt_name, m.parameters()) for k, m in models.items()}
    worst, none_mismatch, none_grads, history = 0.0, [], 0, []
    _compat._force_fallback["ddp"] = fallback
    try:
        for step in range(steps):
            for k, model in models.items():
                opts[k].zero_grad(set_to_none=True)
                for micro in range(accumulate):
                    x, t, gate, ids = batch(step * accumulate + micro, rank, "ids" if bn else kind, bn, accumulate)
                    quiet = model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
                    with quiet:
                        (model(x, gate, ids) - t).square().mean().backward()
                opts[k].step()
            w, nm = state_diff(training_state(masked), training_state(ifelse))
            if bn:
                w = max([w] + [float((a - b).abs().max()) for a, b in zip(masked.buffers(), ifelse.buffers()) if a.is_floating_point()])
            worst = max(worst, w)
            none_mismatch += [(step, name) for name in nm]
            none_grads += sum(p.grad is None for p in ifelse.parameters())
            history.append(flat(masked))
    finally:
        _compat._force_fallback["ddp"] = False
    return {"worst": worst, "none_mismatch": none_mismatch, "none_grads": none_grads, "history": history}


SETTINGS = {
    "default": {},
    "find_unused_parameters": dict(find_unused_parameters=True),
    "static_graph": dict(static_graph=True),
    "gradient_as_bucket_view": dict(gradient_as_bucket_view=True),
    "no_sync": dict(accumulate=2),
    "no_active_ddp_fallback": dict(fallback=True),  # _compat.active_ddp() without the private attribute
    "no_queue_callback_fallback": dict(no_callback=True),
}
TRAININGS = {f"{name}-{opt}": dict(opt_name=opt, **kw) for name, kw in SETTINGS.items() for opt in ("sgd", "adamw")}
TRAININGS["soft-router"] = dict(opt_name="sgd", kind="soft", soft=True)
TRAININGS["batchnorm"] = dict(opt_name="sgd", bn=True)


def scenario_reference(rank, world, group):
    """The reference case of docs/design.md: two bias-free Linear(1, 1) layers with weight 1 (and one
    that no rank uses); rank r feeds r + 1 ones to layer1 when odd, layer2 when even."""
    out = {}
    for name in ("int", "ids", "int-step"):
        layers = [nn.Linear(1, 1, bias=False) for _ in range(3)]
        for layer in layers:
            nn.init.ones_(layer.weight)
        model = DDP(MaskedBranch(layers), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        seen = []
        for _ in range(3):
            k = 0 if rank % 2 == 1 else 1
            x = torch.ones(rank + 1, 1)
            y = model(x, k if name != "ids" else torch.full((rank + 1,), k))
            (0.5 * y**2).sum().backward()
            if name == "int-step":
                opt.step()  # the unused layer's gradient is set to None first: no momentum, no decay
            grads = tuple(None if l.weight.grad is None else l.weight.grad.item() for l in layers)
            seen.append((grads, layers[2].weight.item()))
            opt.zero_grad(set_to_none=True)
        out[name] = seen
    return out


class Routed(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.pre, self.choices, self.head = nn.Linear(4, D), MaskedBranch([make_branch() for _ in range(n)]), nn.Linear(D, 2)

    def forward(self, x, k):
        return self.head(self.choices(torch.tanh(self.pre(x)), k))


def scenario_owned(rank, world, group):
    """The routed parameters leave DDP's buckets: initialized differently on each rank, they are
    broadcast from rank 0 at DDP's construction; no forward ties them; a branch no rank runs
    keeps a None gradient (before any step); a branch one rank runs gets the average."""
    from maskedbranch import _autograd

    torch.manual_seed(100 + rank)
    net = Routed()
    model = DDP(net, process_group=group)
    ties, tie_outputs = [], _autograd.tie_outputs
    _autograd.tie_outputs = lambda *a, **k: ties.append(1) or tie_outputs(*a, **k)
    try:
        x = torch.full((2, 4), float(rank + 1))
        model(x, 0 if rank == 0 else 1).sum().backward()
    finally:
        _autograd.tie_outputs = tie_outputs
    grads = [None if p.grad is None else p.grad.clone() for p in net.choices.parameters()]
    return {"params": flat(net), "ignored": sorted(model.parameters_to_ignore), "ties": len(ties), "grads": grads,
            "names": [n for n, _ in net.choices.named_parameters()]}


def scenario_branch_called_directly(rank, world, group):
    """Branches of a routing module called directly (``choices[k](h)``): DDP left their parameters
    to maskedbranch, which sees no record of them running; every rank raises in the next step's
    backward (as DDP raises at the next forward for parameters it holds): the step's gradients
    were not averaged for them."""
    torch.manual_seed(0)
    net = Routed()
    model = DDP(net, process_group=group)
    net.forward = lambda x, k: net.head(net.choices[k](torch.tanh(net.pre(x))))
    errors = []
    for step in range(3):
        try:
            model(torch.ones(2, 4), rank % 2).sum().backward()
        except RuntimeError as e:
            errors.append((step, str(e)))
    return errors


def scenario_comm_hook_refused(rank, world, group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DDP(Routed(), process_group=group)
    model.register_comm_hook(group, default_hooks.allreduce_hook)
    try:
        model(torch.ones(2, 4), rank % 2).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


class IfElse(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
        nn.init.ones_(self.layer1.weight)
        nn.init.ones_(self.layer2.weight)

    def forward(self, x, use_layer1):
        return self.layer1(x) if use_layer1 else self.layer2(x)


def scenario_reference_ifelse(rank, world, group):
    """The plain if/else model with find_unused_parameters=False: wrong, then an error."""
    model = DDP(IfElse(), process_group=group)
    x = torch.ones(rank + 1, 1)
    (0.5 * model(x, rank % 2 == 1) ** 2).sum().backward()
    first = tuple(None if l.weight.grad is None else l.weight.grad.item() for l in (model.module.layer1, model.module.layer2))
    try:
        (0.5 * model(x, rank % 2 == 1) ** 2).sum().backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"first": first, "error": error}


def scenario_static_graph_refuses_undefined(rank, world, group):
    model = DDP(MaskedBranch([nn.Linear(2, 2) for _ in range(2)], materialize_grads=False), process_group=group, static_graph=True)
    try:
        model(torch.ones(3, 2), rank % 2).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    jobs = [(fn.__name__, fn) for fn in (scenario_reference, scenario_reference_ifelse, scenario_static_graph_refuses_undefined,
                                         scenario_owned, scenario_branch_called_directly, scenario_comm_hook_refused)]
    jobs += [(name, lambda r, w, g, kw=kw: train(r, g, **kw)) for name, kw in TRAININGS.items()]
    results = {}
    for name, fn in jobs:
        group = dist.new_group(backend="gloo")
        t0 = time.perf_counter()
        try:
            results[name] = ("ok", fn(rank, world, group))
        except Exception:  # recorded, reported by the test that reads it
            results[name] = ("error", traceback.format_exc())
        results[name + ".seconds"] = time.perf_counter() - t0
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_job()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, WORLD, TIMEOUT_S, "the DDP job")


# ----------------------------------------------------------------------------------------------
# The tests.


def expected_reference(world):
    """Averaged gradients of the reference case: rank r contributes r + 1 to layer1 (odd r) or
    layer2 (even r); DDP divides by the world size."""
    return (sum(r + 1 for r in range(world) if r % 2) / world, sum(r + 1 for r in range(world) if not r % 2) / world)


def test_reference_case(ranks):
    assert expected_reference(4) == (1.5, 1.0)
    for r, res in enumerate(results_of(ranks, "scenario_reference")):
        for name, seen in res.items():
            for it, ((g1, g2, unused), w_unused) in enumerate(seen):
                if it == 0 or name != "int-step":  # (the step moves the weights)
                    assert (g1, g2) == expected_reference(WORLD), f"rank {r}, {name}, iteration {it}: {(g1, g2)}"
                if name == "int-step":  # pruned before the step, as if/else + find_unused_parameters=True
                    assert unused is None and w_unused == 1.0, f"rank {r}, iteration {it}: {unused}, {w_unused}"
                else:  # no optimizer step: left out of DDP's buckets, it keeps None, as with if/else
                    assert unused is None, f"rank {r}, {name}, iteration {it}: {unused}"


def test_reference_case_ifelse_fails(ranks):
    for r, res in enumerate(results_of(ranks, "scenario_reference_ifelse")):
        # first iteration: not averaged, each rank keeps its own gradient (2, 4 / 1, 3)
        expected = (float(r + 1), None) if r % 2 == 1 else (None, float(r + 1))
        assert res["first"] == expected, f"rank {r}: {res['first']}"
        assert res["error"] is not None and "Expected to have finished reduction" in res["error"]


def test_static_graph_refuses_undefined_gradients(ranks):
    for msg in results_of(ranks, "scenario_static_graph_refuses_undefined"):
        assert "materialize_grads=False under DistributedDataParallel(static_graph=True)" in msg, msg


def test_routed_parameters_leave_ddps_buckets(ranks):
    per_rank = results_of(ranks, "scenario_owned")
    names = per_rank[0]["names"]
    assert per_rank[0]["ignored"] == sorted({f"choices.{n}" for n in names}), per_rank[0]["ignored"]
    for r, res in enumerate(per_rank):
        assert torch.equal(res["params"], per_rank[0]["params"]), f"rank {r}: not broadcast from rank 0"
        assert res["ties"] == 0, f"rank {r}: the wrapper tied {res['ties']} times"
        for n, g in zip(names, res["grads"]):
            if n.startswith("2."):  # branch 2: no rank ran it, as if/else
                assert g is None, f"rank {r}: {n} got a gradient"
            else:  # averaged: the same on every rank, nonzero
                assert g is not None and torch.equal(g, per_rank[0]["grads"][names.index(n)]), f"rank {r}: {n}"
                assert bool(g.abs().sum() > 0), f"rank {r}: {n}"


def test_branches_called_directly_raise_on_every_rank(ranks):
    for r, errors in enumerate(results_of(ranks, "scenario_branch_called_directly")):
        assert errors and errors[0][0] == 1, f"rank {r}: {errors}"  # (later steps: DDP's own error follows)
        msg = errors[0][1]
        assert "no routing module ran them" in msg and "layer[k](x)" in msg, msg
        if r % 2 == 0:  # this rank's own parameters are named (rank 0's ran branch 0, rank 1's branch 1)
            assert "choices.0.0.weight" in msg, msg


def test_comm_hook_refused_where_routed_parameters_are_averaged_apart(ranks):
    for msg in results_of(ranks, "scenario_comm_hook_refused"):
        assert "communication hook" in msg and "materialize_grads=True" in msg, msg


@pytest.mark.parametrize("name", list(TRAININGS))
def test_trains_as_ifelse_with_find_unused_parameters(ranks, name):
    per_rank = results_of(ranks, name)
    for r, res in enumerate(per_rank):
        assert res["worst"] < 1e-10, f"rank {r}: parameters or gradients differ from if/else by {res['worst']}"
        assert not res["none_mismatch"], f"rank {r}: None gradients differ from if/else at {res['none_mismatch'][:5]}"
        assert res["none_grads"] > 0, "no parameter went unused on every rank: the case tests no pruning"
    for r in range(1, WORLD):
        for step, (a, b) in enumerate(zip(per_rank[0]["history"], per_rank[r]["history"])):
            assert torch.equal(a, b), f"rank {r}: parameters differ from rank 0's after step {step}"


def test_job_time(ranks):
    seconds = {k: round(v, 1) for k, v in ranks[0].items() if k.endswith(".seconds")}
    assert sum(seconds.values()) < TIMEOUT_S, seconds
