"""MaskedBranch under DistributedDataParallel with real processes (4 ranks, gloo, CPU).

One spawn runs every scenario (each in its own process group, so a failing one cannot disturb
the next); the ranks save what they saw and the tests below compare it across ranks and against
references: the plain if/else model (which must fail), if/else with find_unused_parameters=True,
the dense 0/1-coefficient model, and a single-process oracle that averages the per-rank if/else
gradients.
"""
import copy
import inspect
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from maskedbranch import MaskedBranch, reference

from rank_jobs import results_of, run_ranks

WORLD = 4
N = 3  # branches
ROWS = 16  # per rank and step
D = 8
TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


# ----------------------------------------------------------------------------------------------
# Models.


def make_branch(bn=False):
    layers = [nn.Linear(D, 12)] + ([nn.BatchNorm1d(12)] if bn else []) + [nn.GELU(), nn.Linear(12, D)]
    return nn.Sequential(*layers)


class Net(nn.Module):
    """pre -> MaskedBranch (or if/else, or dense 0/1) -> residual -> head. With ``soft=True`` a
    learned router gives the gate: softmax weights on a top-2 mask, times a per-row keep mask."""

    def __init__(self, bn=False, soft=False, materialize=False):
        super().__init__()
        self.pre = nn.Linear(6, D)
        self.router = nn.Linear(D, N) if soft else None
        self.mb = MaskedBranch([make_branch(bn) for _ in range(N)], materialize_grads=materialize)
        self.head = nn.Linear(D, 3)
        self.mode = "masked"

    def forward(self, x, gate):
        h = torch.tanh(self.pre(x))
        if self.router is not None:  # gate: a bool [B] keep mask
            probs = self.router(h).softmax(1)
            with torch.no_grad():
                top2 = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, probs.topk(2, dim=1).indices, True)
            gate = probs * (top2 & gate[:, None])
        branches = list(self.mb.branches)
        if self.mode == "masked":
            y = self.mb(h, gate)
        elif self.mode == "ifelse":
            if isinstance(gate, int):
                y = branches[gate](h) if gate >= 0 else None
            else:
                y = reference.masked_branch_ifelse(branches, h, gate)
            y = 0 if y is None else y
        else:  # dense 0/1 coefficients: every branch runs on every row
            if isinstance(gate, int):
                coef = torch.zeros(h.shape[0], N, dtype=h.dtype)
                if gate >= 0:
                    coef[:, gate] = 1
                gate = coef
            y = reference.masked_branch_dense(branches, h, gate)
        return self.head(h + y)


def set_mode(model, mode):
    (model.module if isinstance(model, DDP) else model).mode = mode
    return model


def batch(step, rank, kind, seed=0, bn=False):
    """Data and a gate that differ per rank and per step (every kind includes dead rows, steps
    where a branch is dead on every rank, and steps where no row on a rank reaches any branch)."""
    g = torch.Generator().manual_seed(seed * 100003 + step * 101 + rank)
    x = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
    target = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    if kind == "mixed":
        kind = ("int", "ids", "mask", "weights")[step % 4]
    all_dead = (step + rank) % 7 == 3
    if kind == "int":
        gate = int(torch.randint(-1, N, (), generator=g)) if not all_dead else -1
    elif kind == "ids":
        gate = torch.randint(-1, N - (step % 2), (ROWS,), generator=g)  # odd steps: last branch dead
        if bn:  # BatchNorm needs 0 or >= 2 rows per branch
            for i in range(N):
                if int((gate == i).sum()) == 1:
                    gate[gate == i] = -1
        if all_dead:
            gate.fill_(-1)
    elif kind in ("mask", "weights"):
        gate = torch.rand(ROWS, N, generator=g) < 0.4
        if all_dead:
            gate.fill_(False)
        if kind == "weights":
            gate = torch.rand(ROWS, N, generator=g, dtype=torch.float64) * gate
    elif kind == "soft":
        gate = torch.rand(ROWS, generator=g) < 0.8
        if all_dead:
            gate.fill_(False)
    return x, target, gate


def loss_fn(out, target):
    return (out - target).pow(2).mean()


def grads_of(model):
    return {k: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()) for k, p in model.named_parameters()}


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def oracle_grads(model, step, kind, world, accumulate=1, bn=False):
    """Single-process reference: the average over ranks of the if/else gradients."""
    ref = set_mode(copy.deepcopy(model.module), "ifelse")
    ref._forward_pre_hooks.clear()  # the copy must not record snapshots
    ref.zero_grad(set_to_none=True)
    for micro in range(accumulate):
        for r in range(world):
            x, t, gate = batch(step * accumulate + micro, r, kind, bn=bn)
            (loss_fn(ref(x, gate), t) / world).backward()
    return grads_of(ref)


# ----------------------------------------------------------------------------------------------
# Scenarios, run on every rank.


def scenario_reference_masked(rank, world, group):
    """DESIGN.md's reference case with MaskedBranch, find_unused_parameters=False."""
    out = {}
    for name, materialize, gate_kind in [
        ("int", False, "int"),
        ("ids", False, "ids"),
        ("int-materialize", True, "int"),
    ]:
        layer1, layer2, unused = (nn.Linear(1, 1, bias=False) for _ in range(3))
        for layer in (layer1, layer2, unused):
            nn.init.ones_(layer.weight)
        model = DDP(MaskedBranch([layer1, layer2, unused], materialize_grads=materialize), process_group=group)
        seen = []
        for _ in range(3):
            x = torch.ones(rank + 1, 1)
            k = 0 if rank % 2 == 1 else 1  # odd ranks: layer1, even ranks: layer2
            gate = k if gate_kind == "int" else torch.full((rank + 1,), k)
            y = model(x, gate)
            (0.5 * y**2).sum().backward()
            seen.append(
                (layer1.weight.grad.item(), layer2.weight.grad.item(),
                 None if unused.weight.grad is None else unused.weight.grad.item())
            )
            model.zero_grad(set_to_none=True)
        out[name] = seen
    return out


def scenario_reference_ifelse(rank, world, group):
    """The plain if/else model with find_unused_parameters=False: wrong, then an error."""

    class IfElse(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Linear(1, 1, bias=False)
            self.layer2 = nn.Linear(1, 1, bias=False)
            nn.init.ones_(self.layer1.weight)
            nn.init.ones_(self.layer2.weight)

        def forward(self, x, use_layer1):
            return self.layer1(x) if use_layer1 else self.layer2(x)

    model = DDP(IfElse(), process_group=group)
    x = torch.ones(rank + 1, 1)
    y = model(x, rank % 2 == 1)
    (0.5 * y**2).sum().backward()
    g = model.module
    first = tuple(None if p.weight.grad is None else p.weight.grad.item() for p in (g.layer1, g.layer2))
    error = None
    try:
        y = model(x, rank % 2 == 1)
        (0.5 * y**2).sum().backward()
    except RuntimeError as e:
        error = str(e)
    return {"first": first, "error": error}


def scenario_random_training(rank, world, group):
    """Random routing per rank and step, 50+ SGD steps; masked vs if/else(find_unused=True) vs dense."""
    out = {}
    steps = 52
    for kind in ("int", "ids", "weights", "soft"):
        torch.manual_seed(1234)  # identical initial weights on every rank
        base = Net(soft=kind == "soft").double()
        models = {
            "masked": DDP(set_mode(copy.deepcopy(base), "masked"), process_group=group),
            "ifelse": DDP(set_mode(copy.deepcopy(base), "ifelse"), process_group=group, find_unused_parameters=True),
            "dense": DDP(set_mode(copy.deepcopy(base), "dense"), process_group=group),
        }
        # Plain SGD: with momentum, a parameter no rank used keeps moving with a zero gradient
        # (MaskedBranch, dense) but not with None (if/else + find_unused_parameters=True).
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
        worst = {"ifelse": 0.0, "dense": 0.0}
        for step in range(steps):
            x, t, gate = batch(step, rank, kind)
            grads = {}
            for k, m in models.items():
                opts[k].zero_grad(set_to_none=True)
                loss_fn(m(x, gate), t).backward()
                grads[k] = grads_of(m.module)
                opts[k].step()
            for k in worst:
                worst[k] = max(worst[k], max_diff(grads["masked"], grads[k]))
        out[kind] = {
            "worst": worst,
            "params": {k: p.detach().clone() for k, p in models["masked"].module.named_parameters()},
            "vs_dense": max_diff(
                dict(models["masked"].module.named_parameters()), dict(models["dense"].module.named_parameters())
            ),
        }
    return out


def _train_with_options(rank, world, group, steps, kind="mixed", bn=False, materialize=False, accumulate=1, **ddp_kwargs):
    torch.manual_seed(99)
    model = DDP(Net(bn=bn, materialize=materialize).double(), process_group=group, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    worst = 0.0
    snapshots = []
    if bn:  # what each rank's BatchNorm buffers hold when the module's forward starts
        model.module.register_forward_pre_hook(
            lambda mod, args: snapshots.append([b.detach().clone() for b in mod.mb.buffers()])
        )
    for step in range(steps):
        expected = oracle_grads(model, step, kind, world, accumulate=accumulate, bn=bn)
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            x, t, gate = batch(step * accumulate + micro, rank, kind, bn=bn)
            if micro < accumulate - 1:
                with model.no_sync():
                    loss_fn(model(x, gate), t).backward()
            else:
                loss_fn(model(x, gate), t).backward()
        got = grads_of(model.module)
        worst = max(worst, max_diff(got, expected))
        none_grads = [k for k, p in model.module.named_parameters() if p.grad is None]
        opt.step()
    params = {k: p.detach().clone() for k, p in model.module.named_parameters()}
    return {"worst": worst, "params": params, "none_grads": none_grads, "snapshots": snapshots}


def scenario_options(rank, world, group):
    out = {}
    out["bucket_view"] = _train_with_options(rank, world, group, 12, gradient_as_bucket_view=True)
    # static_graph learns the used parameters in its first iteration, counting only defined
    # gradients: with undefined anchors, a branch no rank uses in iteration 1 would be left out
    # for good, so static_graph=True goes with materialize_grads=True.
    out["static_graph"] = _train_with_options(rank, world, group, 12, static_graph=True, materialize=True)
    out["static_graph_undefined"] = _train_with_options(rank, world, group, 8, kind="mask", static_graph=True)
    out["no_sync"] = _train_with_options(rank, world, group, 8, accumulate=3)
    out["no_sync_bucket_view"] = _train_with_options(rank, world, group, 6, accumulate=2, gradient_as_bucket_view=True)
    # broadcast_buffers (named forward_sync_buffers since torch 2.13)
    sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
    out["batchnorm"] = _train_with_options(rank, world, group, 10, kind="ids", bn=True, **{sync: True})
    return out


SCENARIOS = [
    scenario_reference_masked,
    scenario_reference_ifelse,
    scenario_random_training,
    scenario_options,
]


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    results = {}
    for fn in SCENARIOS:
        group = dist.new_group(backend="gloo")
        t0 = time.perf_counter()
        try:
            results[fn.__name__] = ("ok", fn(rank, world, group))
        except Exception:  # recorded, reported by the test that reads it
            results[fn.__name__] = ("error", traceback.format_exc())
        results[fn.__name__ + ".seconds"] = time.perf_counter() - t0
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    """Per-rank results of every scenario, from one 4-process gloo job."""
    return run_ranks(_worker, WORLD, TIMEOUT_S, "the DDP job")


result = results_of


# ----------------------------------------------------------------------------------------------
# The tests.


def test_reference_case_masked(ranks):
    for r, res in enumerate(result(ranks, "scenario_reference_masked")):
        for name, seen in res.items():
            for it, (g1, g2, g_unused) in enumerate(seen):
                assert (g1, g2) == (1.5, 1.0), f"rank {r}, {name}, iteration {it}: {(g1, g2)}"
                # used by no rank: a zero gradient, not None (DDP zero-filled and reduced it)
                assert g_unused == 0.0, f"rank {r}, {name}, iteration {it}: unused grad {g_unused}"


def test_reference_case_ifelse_fails(ranks):
    for r, res in enumerate(result(ranks, "scenario_reference_ifelse")):
        # first iteration: not averaged, each rank keeps its own gradient (2, 4 / 1, 3)
        expected = (float(r + 1), None) if r % 2 == 1 else (None, float(r + 1))
        assert res["first"] == expected, f"rank {r}: {res['first']}"
        # second iteration: DDP's error
        assert res["error"] is not None and "Expected to have finished reduction" in res["error"]


@pytest.mark.parametrize("kind", ["int", "ids", "weights", "soft"])
def test_random_routing_training(ranks, kind):
    per_rank = [res[kind] for res in result(ranks, "scenario_random_training")]
    for r, res in enumerate(per_rank):
        assert res["worst"]["ifelse"] < 1e-10, f"rank {r}: vs if/else + find_unused_parameters=True"
        assert res["worst"]["dense"] < 1e-10, f"rank {r}: vs dense 0/1 coefficients"
        assert res["vs_dense"] < 1e-9, f"rank {r}: parameters drifted from the dense model"
    for r in range(1, WORLD):
        for k, p in per_rank[0]["params"].items():
            assert torch.equal(p, per_rank[r]["params"][k]), f"rank {r}: {k} differs from rank 0"


@pytest.mark.parametrize(
    "option", ["bucket_view", "static_graph", "static_graph_undefined", "no_sync", "no_sync_bucket_view", "batchnorm"]
)
def test_ddp_options(ranks, option):
    per_rank = [res[option] for res in result(ranks, "scenario_options")]
    for r, res in enumerate(per_rank):
        assert res["worst"] < 1e-10, f"rank {r}: gradients differ from the averaged if/else ones by {res['worst']}"
        assert not res["none_grads"], f"rank {r}: parameters without a gradient: {res['none_grads']}"
    for r in range(1, WORLD):
        for k, p in per_rank[0]["params"].items():
            assert torch.equal(p, per_rank[r]["params"][k]), f"rank {r}: {k} differs from rank 0"
    if option == "batchnorm":  # broadcast_buffers: every forward starts from rank 0's buffers
        for r in range(1, WORLD):
            for a, b in zip(per_rank[0]["snapshots"], per_rank[r]["snapshots"]):
                assert all(torch.equal(u, v) for u, v in zip(a, b))
        moved = [s for s in per_rank[0]["snapshots"][-1] if s.dtype == torch.float64]
        assert any(torch.count_nonzero(s) for s in moved)  # the running statistics did move


def test_job_time(ranks):
    seconds = {k: v for k, v in ranks[0].items() if k.endswith(".seconds")}
    assert sum(seconds.values()) < TIMEOUT_S, seconds
