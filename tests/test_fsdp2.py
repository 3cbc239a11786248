"""MaskedBranch, masked_branch and ResidualDropPath under FSDP2 (``fully_shard``) with routing
that differs across ranks: real processes (spawn), gloo on the CPU, no flag.

What "the code it replaces" is here: FSDP2 cannot run the if/else model (each rank's backward
reduce-scatters the gradients it has, so ranks that skipped different branches pair different
parameters: it hangs, errors or silently averages the wrong numbers; a branch that is its own
unit all-gathers in its forward, which a skipping rank never calls). What the user's if/else
model trains like under data parallelism is DDP with ``find_unused_parameters=True``: averaged
gradients, and None for parameters no rank used, which the optimizer then skips. That is the
reference: the FSDP2 model must equal it after every step (full parameters and gradients, None
included), sharding the root only or the routed module as its own unit. The models FSDP2 *can*
run are compared too: the dense 0/1-coefficient model (and, where torch has
``set_reduce_scatter_unused_params``, the if/else model with it) give the same gradients for
the parameters some rank used, and zeros, not None, for the others (momentum and weight decay
then move those), which is why they are not the reference.

What must fail, each in its own job with a deadline (killed, never hanging the suite): the if/else
model sharded at the root or per branch; ``materialize_grads=False`` must raise at the first step
naming FSDP2; a branch that is its own FSDP2 unit is refused.
"""
import copy
import os
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # torch < 2.6
    fully_shard = FSDPModule = None

import maskedbranch as mb

from harness import ReferenceResidual, state_diff, training_state

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(
        fully_shard is None or not (dist.is_available() and dist.is_gloo_available()),
        reason="needs torch.distributed with gloo and FSDP2 (fully_shard)",
    ),
    # torch 2.6's FSDP2 all-gather needs a device stream ("'Stream' object has no attribute
    # 'record_event'" on CPU tensors): FSDP2 runs on CPUs from torch 2.7
    pytest.mark.skipif(torch.__version__ < "2.7", reason="FSDP2 runs on CPUs from torch 2.7"),
]

WORLD = 3
N = 3
ROWS = 6
D = 6
STEPS = 4
JOB_TIMEOUT_S = 240
FAIL_TIMEOUT_S = 60


def make_branch():
    return nn.Sequential(nn.Linear(D, 8), nn.GELU(), nn.Linear(8, D))


class Net(nn.Module):
    """pre -> choices (MaskedBranch) -> experts (masked_branch, ids) -> head. ``mode``: "masked",
    "ifelse" (nn.ModuleLists, same keys) or "dense" (every branch on every row, 0/1 weights)."""

    def __init__(self, mode="masked", materialize=None):
        super().__init__()
        self.mode = mode
        self.pre = nn.Linear(4, D)
        branches = [make_branch() for _ in range(N)]
        self.choices = mb.MaskedBranch(branches, materialize_grads=materialize) if mode == "masked" else nn.ModuleList(branches)
        self.experts = nn.ModuleList(make_branch() for _ in range(N))
        self.head = nn.Linear(D, 2)

    def route(self, branches, h, gate):
        if self.mode == "masked":
            return branches(h, gate) if isinstance(branches, mb.MaskedBranch) else mb.masked_branch(list(branches), h, gate)
        if self.mode == "dense":
            if isinstance(gate, int):
                gate = torch.zeros(h.shape[0], N, dtype=h.dtype).index_fill_(1, torch.tensor([gate]), 1) if gate >= 0 else torch.zeros(h.shape[0], N, dtype=h.dtype)
            return mb.reference.masked_branch_dense(list(branches), h, gate)
        y = mb.reference.masked_branch_ifelse(list(branches), h, gate)
        return 0 if y is None else y

    def forward(self, x, gate, ids):
        h = torch.tanh(self.pre(x))
        h = h + self.route(self.choices, h, gate)
        h = h + self.route(self.experts, h, ids)
        return self.head(h)


def batch(step, rank, kind="mixed"):
    g = torch.Generator().manual_seed(step * 101 + rank)
    x, target = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)
    if kind == "mixed":
        kind = ("ids", "mask", "weights", "int")[step % 4]
    top = N - (step % 2)  # odd steps: the last branch of choices unused on every rank
    all_dead = (step + rank) % 5 == 3
    if kind == "int":
        gate = -1 if all_dead else (step + rank) % top
    elif kind == "ids":
        gate = torch.full((ROWS,), -1) if all_dead else torch.randint(-1, top, (ROWS,), generator=g)
    else:
        gate = (torch.rand(ROWS, N, generator=g) < 0.5) & (torch.arange(N) < top) & (not all_dead)
        if kind == "weights":
            gate = torch.rand(ROWS, N, generator=g) * gate
    ids = torch.randint(1 if step % 2 == 0 else -1, N, (ROWS,), generator=g)  # even steps: expert 0 unused
    return x, target, gate, ids


def optimizers(model):
    """SGD (momentum, weight decay) over pre and choices, AdamW over the rest."""
    first = [*model.pre.parameters(), *model.choices.parameters()]
    taken = {id(p) for p in first}
    return [
        torch.optim.SGD(first, lr=0.05, momentum=0.9, weight_decay=0.01),
        torch.optim.AdamW([p for p in model.parameters() if id(p) not in taken], lr=0.01, weight_decay=0.01),
    ]


def step_all(model, opts, x, t, gate, ids):
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    (model(x, gate, ids) - t).square().mean().backward()
    for opt in opts:
        opt.step()


# ----------------------------------------------------------------------------------------------
# Scenarios, run on every rank.


def scenario_vs_ddp_ifelse(rank, world, shard, kind="mixed"):
    """FSDP2 (masked, no flag) against DDP(find_unused_parameters=True) of the if/else model,
    and the gradients of the FSDP2-runnable references (dense; if/else with
    set_reduce_scatter_unused_params where torch has it)."""
    torch.manual_seed(0)  # identical initial weights on every rank
    model = Net("masked")
    state = model.state_dict()
    ifelse = Net("ifelse")
    ifelse.load_state_dict(state)
    ddp = nn.parallel.DistributedDataParallel(ifelse, process_group=dist.new_group(backend="gloo"), find_unused_parameters=True)
    others = {}
    if shard == "root" and kind == "mixed":  # once is enough
        others["dense"] = Net("dense")
        if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
            others["ifelse_unused_zeros"] = Net("ifelse")
    for m in others.values():
        m.load_state_dict(state)
        fully_shard(m)
    if "ifelse_unused_zeros" in others:
        others["ifelse_unused_zeros"].set_reduce_scatter_unused_params(True)
    if shard == "nested":
        fully_shard(model.choices)
    fully_shard(model)
    opts, ddp_opts = optimizers(model), optimizers(ifelse)
    worst, none_mismatch, vs_others, zeros_for_unused = 0.0, [], {k: 0.0 for k in others}, {k: 0 for k in others}
    for step in range(STEPS):
        x, t, gate, ids = batch(step, rank, kind)
        for m in others.values():  # the gradients at the masked model's weights before its step
            m.load_state_dict(model.state_dict())  # (DTensors sharded alike)
            m.zero_grad(set_to_none=True)
            (m(x, gate, ids) - t).square().mean().backward()
        step_all(model, opts, x, t, gate, ids)
        step_all(ddp, ddp_opts, x, t, gate, ids)
        got, want = training_state(model), training_state(ifelse)
        w, nm = state_diff(got, want)
        worst, none_mismatch = max(worst, w), none_mismatch + [(step, k) for k in nm]
        for k, m in others.items():
            theirs = training_state(m)
            for name, (_, g) in got.items():
                h = theirs[name][1]
                if g is not None:
                    vs_others[k] = max(vs_others[k], float((g - h).abs().max()))
                elif h is not None and not bool(h.count_nonzero()):
                    zeros_for_unused[k] += 1
    return {"worst": worst, "none_mismatch": none_mismatch, "vs_others": vs_others, "zeros_for_unused": zeros_for_unused}


class ResidualNet(nn.Module):
    def __init__(self, mode, masked, seed):
        super().__init__()
        self.pre = nn.Linear(4, D)
        # (drop_prob, materialize_grads): the default (timm's dense formula) and None (the block
        # that skips its branch; pruned when every rank dropped it)
        self.blocks = nn.ModuleList(
            mb.ResidualDropPath(make_branch(), p, mode=mode, generator=torch.Generator().manual_seed(seed + i), **({} if m else {"materialize_grads": m}))
            if masked else ReferenceResidual(make_branch(), p, mode, torch.Generator().manual_seed(seed + i), dense=m is True)
            for i, (p, m) in enumerate(((0.5, True), (0.95, None), (0.7, True)))
        )
        self.head = nn.Linear(D, 2)

    def forward(self, x, *_):
        h = self.pre(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def scenario_residual(rank, world, mode):
    """ResidualDropPath blocks, each its own FSDP2 unit, ranks drawing independently, against
    the blocks they replace under DDP(find_unused_parameters=True) with the same draws."""
    torch.manual_seed(0)
    model = ResidualNet(mode, True, 50 + 10 * rank)
    ifelse = ResidualNet(mode, False, 50 + 10 * rank)
    ifelse.load_state_dict(model.state_dict())
    ddp = nn.parallel.DistributedDataParallel(ifelse, process_group=dist.new_group(backend="gloo"), find_unused_parameters=True)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opts, ddp_opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01) for m in (model, ifelse)]
    worst, none_mismatch, none_grads = 0.0, [], 0
    for step in range(STEPS):
        x, t, _, _ = batch(step, rank)
        x, t = x[:3], t[:3]  # few rows: "row" mode drops every row of a rank now and then
        step_all(model, [opts], x, t, None, None)
        step_all(ddp, [ddp_opts], x, t, None, None)
        w, nm = state_diff(training_state(model), training_state(ifelse))
        worst, none_mismatch = max(worst, w), none_mismatch + [(step, k) for k in nm]
        none_grads += sum(p.grad is None for p in ifelse.parameters())
    return {"worst": worst, "none_mismatch": none_mismatch, "none_grads": none_grads}


def scenario_undefined_grads_refused(rank, world):
    torch.manual_seed(0)
    model = Net("masked", materialize=False)
    fully_shard(model)
    opts = optimizers(model)
    try:
        step_all(model, opts, *batch(0, rank, "int"))
    except RuntimeError as e:
        return str(e)
    return "no error"


def scenario_refusal(rank, world):
    model = Net("masked")
    for b in model.choices:
        fully_shard(b)
    fully_shard(model)
    x, _, gate, ids = batch(0, rank, "ids")
    try:
        model(x, gate, ids)
    except ValueError as e:
        return str(e)
    return "not refused"


def scenario_main(rank, world):
    out = {}
    for shard in ("root", "nested"):
        out[shard] = scenario_vs_ddp_ifelse(rank, world, shard)
    out["int"] = scenario_vs_ddp_ifelse(rank, world, "root", kind="int")
    for mode in ("batch", "row"):
        out[f"residual_{mode}"] = scenario_residual(rank, world, mode)
    out["undefined"] = scenario_undefined_grads_refused(rank, world)
    out["refusal"] = scenario_refusal(rank, world)  # last: it leaves an FSDP2 forward unfinished
    return out


def scenario_broken(rank, world, shard):
    """The if/else model under FSDP2 (the branches in the root's unit, or each branch its own
    unit): returns the worst difference from the averaged if/else gradients."""
    torch.manual_seed(0)
    model = Net("ifelse")
    oracle = copy.deepcopy(model)
    if shard == "branches":
        for b in model.choices:
            fully_shard(b)
    fully_shard(model)
    worst, missing = 0.0, []
    for step in range(3):
        x, t, gate, ids = batch(step, rank, "int")
        oracle.zero_grad(set_to_none=True)
        for r in range(world):  # the average of every rank's own gradients, in one process
            xr, tr, gr, ir = batch(step, r, "int")
            ((oracle(xr, gr, ir) - tr).square().mean() / world).backward()
        model.zero_grad(set_to_none=True)
        (model(x, gate, ids) - t).square().mean().backward()
        got = training_state(model)  # gathers the defined gradients only: may itself mismatch
        for k, p in oracle.named_parameters():
            g = got[k][1]
            if g is None:
                missing.append(k)
                g = torch.zeros_like(p)
            worst = max(worst, float((g - (p.grad if p.grad is not None else 0)).abs().max()))
    return {"worst": worst, "missing": missing}


# ----------------------------------------------------------------------------------------------
# Launching, with a deadline.


def _worker(rank, world, init_file, out_dir, scenario, kwargs, op_timeout_s):
    torch.set_num_threads(1)
    result = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=timedelta(seconds=op_timeout_s),
        )
        result = ("ok", globals()[scenario](rank, world, **kwargs))
    except Exception:  # reported by the test that reads it
        result = ("error", traceback.format_exc())
    # written before any teardown, which may itself hang after a broken collective
    torch.save(result, os.path.join(out_dir, f"rank{rank}.tmp"))
    os.replace(os.path.join(out_dir, f"rank{rank}.tmp"), os.path.join(out_dir, f"rank{rank}.pt"))
    if result[0] == "ok":
        dist.barrier()
        dist.destroy_process_group()


def launch(scenario, world, timeout, op_timeout_s=60, linger_s=15, **kwargs):
    """Runs ``scenario`` on ``world`` processes. Returns (per-rank results, None for a rank that
    wrote nothing before the deadline; whether the deadline passed). Never blocks past it."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _worker, args=(world, init_file, tmp, scenario, kwargs, op_timeout_s), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        timed_out = False
        try:
            while not all(os.path.exists(p) for p in paths):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                if all(not p.is_alive() for p in ctx.processes):
                    break
                time.sleep(0.5)
            if not timed_out:  # give the ranks a moment to tear down cleanly
                end = time.monotonic() + linger_s
                while any(p.is_alive() for p in ctx.processes) and time.monotonic() < end:
                    time.sleep(0.2)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
        results = [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]
        for r, p in enumerate(ctx.processes):
            if results[r] is None and not timed_out:
                results[r] = ("died", f"rank {r} exited with code {p.exitcode} without a result")
        return results, timed_out


# ----------------------------------------------------------------------------------------------
# The tests.


@pytest.fixture(scope="module")
def main_job():
    results, timed_out = launch("scenario_main", WORLD, JOB_TIMEOUT_S)
    assert not timed_out, f"the FSDP2 job did not finish within {JOB_TIMEOUT_S} s: {results}"
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}:\n{res[1] if res else 'no result'}"
    return [res[1] for res in results]


@pytest.mark.parametrize("case", ["root", "nested", "int"])
def test_fsdp2_trains_as_ddp_ifelse(main_job, case):
    for r, res in enumerate(main_job):
        got = res[case]
        assert got["worst"] < 1e-5, f"rank {r}: parameters or gradients differ from DDP's if/else by {got['worst']}"
        assert not got["none_mismatch"], f"rank {r}: None gradients differ from if/else at {got['none_mismatch'][:5]}"
        for k, diff in got["vs_others"].items():  # the models FSDP2 can run: same gradients where used ...
            assert diff < 1e-5, f"rank {r}: gradients differ from FSDP2's {k} model by {diff}"
            assert got["zeros_for_unused"][k] > 0, f"rank {r}: {k}: expected zeros where if/else has None"


@pytest.mark.parametrize("mode", ["batch", "row"])
def test_fsdp2_residual_drop_path_trains_as_the_replaced_blocks(main_job, mode):
    for r, res in enumerate(main_job):
        got = res[f"residual_{mode}"]
        assert got["worst"] < 1e-5, f"rank {r}: parameters or gradients differ by {got['worst']}"
        assert not got["none_mismatch"], f"rank {r}: None gradients differ at {got['none_mismatch'][:5]}"
        assert got["none_grads"] > 0, "no block was dropped on every rank at once: nothing to prune"


def test_fsdp2_refuses_undefined_gradients_at_the_first_step(main_job):
    for r, res in enumerate(main_job):
        assert "materialize_grads=False) under FSDP2" in res["undefined"], f"rank {r}: {res['undefined']}"


def test_masked_branch_refuses_sharded_branches(main_job):
    """A branch that is its own FSDP2 unit all-gathers in its forward: skipped on one rank, the
    collective would hang the others, so MaskedBranch refuses it (on every rank alike)."""
    for r, res in enumerate(main_job):
        msg = res["refusal"]
        assert "runs collectives" in msg or "DTensor" in msg, f"rank {r}: {msg}"


def describe_failure(results, timed_out):
    """'hang', 'error' or 'wrong' when the job failed as it should; None when it passed."""
    if timed_out or any(res is None for res in results):
        return "hang"
    if any(res[0] in ("error", "died") for res in results):
        return "error"
    if any(res[1]["worst"] > 1e-4 or res[1]["missing"] for res in results):
        return "wrong"
    return None


@pytest.mark.parametrize("shard", ["root", "branches"])
def test_fsdp2_ifelse_fails(shard):
    results, timed_out = launch("scenario_broken", 2, FAIL_TIMEOUT_S, op_timeout_s=10, linger_s=0, shard=shard)
    outcome = describe_failure(results, timed_out)
    detail = [res if res is None or res[0] != "ok" else ("ok", res[1]["worst"]) for res in results]
    print(f"if/else, FSDP2 units: {shard}: {outcome}: {str(detail)[-600:]}")
    assert outcome is not None, f"expected a hang, an error or wrong gradients, got correct results: {results}"
