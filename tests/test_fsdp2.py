"""MaskedBranch under FSDP2 (torch.distributed.fsdp.fully_shard) with routing that differs across
ranks: real processes (torch.multiprocessing spawn), gloo on the CPU.

* ``MaskedBranch(materialize_grads=True)`` trains exactly like DDP (gradients, after FSDP2's
  reduce-scatter and gathered with ``full_tensor()``, equal DDP's averaged ones; parameters after
  SGD steps equal DDP's), sharding the root only or the MaskedBranch and the root.
* ``ResidualDropPath(materialize_grads=True)`` blocks, each its own FSDP2 unit, with ranks
  dropping independently, and a timm ViT converted with
  ``maskedbranch.integrations.timm.patch(model, materialize_grads=True)`` (against DDP running
  timm's own model with the same masks), equal DDP too.
* What does not work, each in its own job guarded by a deadline (the processes are killed, the
  suite never hangs): the plain if/else model (the parameters of a branch a rank skipped get no
  gradient there, so FSDP2's reduce-scatter pairs different gradients across ranks - or, with the
  branches sharded on their own, the all-gathers of different branches - which hangs, errors or,
  when the shapes happen to agree, silently averages the wrong numbers), and MaskedBranch with
  its default ``materialize_grads=False`` (undefined gradients: FSDP2 reduces only defined ones).
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
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    fully_shard = None

import maskedbranch as mb

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        fully_shard is None or not (dist.is_available() and dist.is_gloo_available()),
        reason="needs torch.distributed with gloo and FSDP2 (fully_shard)",
    ),
]

WORLD = 3
N = 3  # branches
ROWS = 6  # per rank and step
D = 8
STEPS = 5
JOB_TIMEOUT_S = 150  # the main job (all scenarios)
FAIL_TIMEOUT_S = 60  # each job expected to fail


def make_branch():
    return nn.Sequential(nn.Linear(D, 12), nn.GELU(), nn.Linear(12, D))


class Net(nn.Module):
    """pre -> MaskedBranch (or if/else) -> residual -> head."""

    def __init__(self, mode="masked", materialize=True):
        super().__init__()
        self.pre = nn.Linear(6, D)
        if mode == "masked":
            self.mb = mb.MaskedBranch([make_branch() for _ in range(N)], materialize_grads=materialize)
        else:  # the if/else model keeps its branches in a plain ModuleList
            self.mb = nn.Module()
            self.mb.branches = nn.ModuleList([make_branch() for _ in range(N)])
        self.head = nn.Linear(D, 3)
        self.mode = mode

    def forward(self, x, gate):
        h = torch.tanh(self.pre(x))
        if self.mode == "masked":
            y = self.mb(h, gate)
        else:
            y = self.mb.branches[gate](h) if gate >= 0 else 0
        return self.head(h + y)


def batch(step, rank, kind):
    """Data and a gate that differ per rank and step; some steps leave a branch dead on every
    rank, some leave a rank with no live row at all."""
    g = torch.Generator().manual_seed(step * 101 + rank)
    x = torch.randn(ROWS, 6, generator=g)
    target = torch.randn(ROWS, 3, generator=g)
    if kind == "mixed":
        kind = ("ids", "mask", "weights", "int")[step % 4]
    all_dead = (step + rank) % 5 == 3
    if kind == "int":  # one branch per rank: what the if/else model does
        gate = -1 if all_dead else (step + rank) % N
    elif kind == "ids":
        gate = torch.randint(-1, N - (step % 2), (ROWS,), generator=g)
        if all_dead:
            gate.fill_(-1)
    else:
        gate = torch.rand(ROWS, N, generator=g) < 0.4
        if all_dead:
            gate.fill_(False)
        if kind == "weights":
            gate = torch.rand(ROWS, N, generator=g) * gate
    return x, target, gate


def loss_fn(out, target):
    return (out - target).pow(2).mean()


def local_grads(model):
    return {k: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()) for k, p in model.named_parameters()}


def full_grads(model):
    """Gradients of an FSDP2 model as full tensors (a collective: every rank calls it in the same
    order). A missing gradient is reported, not gathered."""
    out, missing = {}, []
    for k, p in model.named_parameters():
        if p.grad is None:
            missing.append(k)
            continue
        g = p.grad
        out[k] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out, missing


def oracle_grads(model, step, kind, world):
    """The average over ranks of each rank's own gradients (what DDP computes), in one process."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    for r in range(world):
        x, t, gate = batch(step, r, kind)
        (loss_fn(ref(x, gate), t) / world).backward()
    return local_grads(ref)


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


# ----------------------------------------------------------------------------------------------
# Scenarios, run on every rank.


def scenario_fsdp2_vs_ddp(rank, world, shard, kind="mixed"):
    torch.manual_seed(0)  # identical initial weights on every rank
    model = Net("masked", materialize=True)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), process_group=dist.new_group(backend="gloo"))
    oracle_model = copy.deepcopy(model)
    if shard == "nested":
        fully_shard(model.mb)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    worst_ddp = worst_oracle = 0.0
    missing_any = []
    for step in range(STEPS):
        x, t, gate = batch(step, rank, kind)
        expected = oracle_grads(oracle_model, step, kind, world)
        opt.zero_grad(set_to_none=True)
        ddp_opt.zero_grad(set_to_none=True)
        loss_fn(model(x, gate), t).backward()
        loss_fn(ddp(x, gate), t).backward()
        got, missing = full_grads(model)
        missing_any += missing
        want = local_grads(ddp.module)
        worst_ddp = max(worst_ddp, max_diff(got, {k: want[k] for k in got}))
        worst_oracle = max(worst_oracle, max_diff(got, {k: expected[k] for k in got}))
        opt.step()
        ddp_opt.step()
        # keep the oracle's weights in step with DDP's
        oracle_model.load_state_dict(ddp.module.state_dict())
    params = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for k, p in model.named_parameters()}
    ddp_params = {k: p.detach().clone() for k, p in ddp.module.named_parameters()}
    return {
        "worst_ddp": worst_ddp,
        "worst_oracle": worst_oracle,
        "missing": missing_any,
        "params_vs_ddp": max_diff(params, ddp_params),
    }


class ResidualNet(nn.Module):
    """pre -> three ResidualDropPath blocks -> head (or timm-style blocks from a factory)."""

    def __init__(self, mode, materialize=True):
        super().__init__()
        self.pre = nn.Linear(6, D)
        self.blocks = nn.ModuleList(
            mb.ResidualDropPath(make_branch(), p, mode=mode, materialize_grads=materialize) for p in (0.5, 0.6, 0.4)
        )
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.pre(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def _residual_vs_ddp(rank, world, model, make_input, blocks, reference=None, steps=STEPS):
    """FSDP2 (each block its own unit, then the root) against DDP of ``reference`` (default: a
    copy), the same masks on both (the default generator seeded identically before each forward,
    differently per rank)."""
    reference = copy.deepcopy(model) if reference is None else reference
    ddp = nn.parallel.DistributedDataParallel(reference, process_group=dist.new_group(backend="gloo"))
    for blk in blocks(model):
        fully_shard(blk)
    fully_shard(model)
    ran = []  # per step and block: did the branch run on this rank?
    calls = [0] * len(blocks(model))

    def counter(i):
        def hook(module, args, out):
            calls[i] += 1

        return hook

    for i, blk in enumerate(blocks(model)):
        (blk.branch if hasattr(blk, "branch") else blk.mlp).register_forward_hook(counter(i))
    worst, missing_any = 0.0, []
    for step in range(steps):
        x, target = make_input(step, rank)
        model.zero_grad(set_to_none=True)
        ddp.zero_grad(set_to_none=True)
        before = list(calls)
        torch.manual_seed(1000 * step + rank)
        out = model(x)
        ran.append([int(c > b) for c, b in zip(calls, before)])
        loss_fn(out, target).backward()
        torch.manual_seed(1000 * step + rank)
        loss_fn(ddp(x), target).backward()
        got, missing = full_grads(model)
        missing_any += missing
        want = local_grads(ddp.module)
        worst = max(worst, max_diff(got, {k: want[k] for k in got}))
    return {"worst_ddp": worst, "missing": missing_any, "ran": ran}


def scenario_residual(rank, world, mode):
    torch.manual_seed(0)
    model = ResidualNet(mode)

    def make_input(step, rank):
        g = torch.Generator().manual_seed(step * 101 + rank)
        return torch.randn(3, 6, generator=g), torch.randn(3, 3, generator=g)

    return _residual_vs_ddp(rank, world, model, make_input, lambda m: list(m.blocks))


def scenario_timm(rank, world):
    import timm

    from maskedbranch.integrations import timm as mb_timm

    torch.manual_seed(0)
    original = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=16, num_heads=2,
        depth=2, num_classes=3, drop_path_rate=0.6,
    )
    model = copy.deepcopy(original)
    mb_timm.patch(model, materialize_grads=True)

    def make_input(step, rank):
        g = torch.Generator().manual_seed(step * 101 + rank)
        return torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 3, generator=g)

    # DDP runs timm's own (unpatched) model: FSDP2 with the patch must equal it
    model.train(), original.train()
    return _residual_vs_ddp(rank, world, model, make_input, lambda m: list(m.blocks), reference=original, steps=3)


def scenario_main(rank, world, with_timm=False):
    out = {}
    for shard in ("root", "nested"):
        out[shard] = scenario_fsdp2_vs_ddp(rank, world, shard)
    out["int"] = scenario_fsdp2_vs_ddp(rank, world, "root", kind="int")
    for mode in ("batch", "row"):
        out[f"residual_{mode}"] = scenario_residual(rank, world, mode)
    if with_timm:
        out["timm"] = scenario_timm(rank, world)
    out["refusal"] = scenario_refusal(rank, world)  # last: it leaves an FSDP2 forward unfinished
    return out


def scenario_broken(rank, world, mode, shard, materialize):
    """One of the set-ups that must not pass: returns the worst difference from the oracle."""
    torch.manual_seed(0)
    model = Net(mode, materialize=materialize)
    oracle_model = copy.deepcopy(model)
    if shard == "branches":
        for b in model.mb.branches:
            fully_shard(b)
    fully_shard(model)
    worst, missing_any = 0.0, []
    for step in range(3):
        x, t, gate = batch(step, rank, "int")
        expected = oracle_grads(oracle_model, step, "int", world)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x, gate), t).backward()
        got, missing = full_grads(model)  # gathers only the defined ones: may itself mismatch
        missing_any += missing
        worst = max(worst, max_diff(got, {k: expected[k] for k in got}) if got else 0.0)
        # a gradient missing on this rank is wrong too (DDP would have averaged it)
        for k in missing:
            worst = max(worst, float(expected[k].abs().max()))
    return {"worst": worst, "missing": missing_any}


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


def _timm_usable():
    try:
        import timm  # noqa: F401

        from maskedbranch.integrations import timm as _  # noqa: F401
    except Exception:  # noqa: BLE001 - timm is optional
        return False
    return True


HAS_TIMM = _timm_usable()


@pytest.fixture(scope="module")
def main_job():
    results, timed_out = launch("scenario_main", WORLD, JOB_TIMEOUT_S, with_timm=HAS_TIMM)
    assert not timed_out, f"the FSDP2 job did not finish within {JOB_TIMEOUT_S} s: {results}"
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}:\n{res[1] if res else 'no result'}"
    return [res[1] for res in results]


@pytest.mark.parametrize("case", ["root", "nested", "int"])
def test_fsdp2_materialized_equals_ddp(main_job, case):
    for r, res in enumerate(main_job):
        got = res[case]
        assert not got["missing"], f"rank {r}: FSDP2 parameters without a gradient: {got['missing']}"
        assert got["worst_ddp"] < 1e-6, f"rank {r}: gradients differ from DDP's by {got['worst_ddp']}"
        assert got["worst_oracle"] < 1e-6, f"rank {r}: gradients differ from the average by {got['worst_oracle']}"
        assert got["params_vs_ddp"] < 1e-6, f"rank {r}: parameters drifted from DDP's by {got['params_vs_ddp']}"


@pytest.mark.parametrize("mode", ["batch", "row"])
def test_fsdp2_residual_drop_path_materialized_equals_ddp(main_job, mode):
    """ResidualDropPath(materialize_grads=True), each block its own FSDP2 unit, ranks dropping
    independently: the gradients equal DDP's."""
    for r, res in enumerate(main_job):
        got = res[f"residual_{mode}"]
        assert not got["missing"], f"rank {r}: parameters without a gradient: {got['missing']}"
        assert got["worst_ddp"] < 1e-6, f"rank {r}: gradients differ from DDP's by {got['worst_ddp']}"
    ran = torch.tensor([res[f"residual_{mode}"]["ran"] for res in main_job])  # [rank, step, block]
    assert bool((ran.amin(0) != ran.amax(0)).any()), "the ranks never disagreed about running a branch"


@pytest.mark.skipif(not HAS_TIMM, reason="timm is not usable here")
def test_fsdp2_timm_patched_equals_ddp_of_timm(main_job):
    """A timm ViT patched with materialize_grads=True under FSDP2 (each block a unit) equals DDP
    running timm's own model with the same masks."""
    for r, res in enumerate(main_job):
        got = res["timm"]
        assert not got["missing"], f"rank {r}: parameters without a gradient: {got['missing']}"
        assert got["worst_ddp"] < 1e-5, f"rank {r}: gradients differ from DDP's by {got['worst_ddp']}"


def describe_failure(results, timed_out):
    """'hang', 'error' or 'wrong' when the job failed as it should; None when it passed."""
    if timed_out or any(res is None for res in results):
        return "hang"
    if any(res[0] in ("error", "died") for res in results):
        return "error"
    if any(res[1]["worst"] > 1e-4 or res[1]["missing"] for res in results):
        return "wrong"
    return None


@pytest.mark.parametrize(
    "mode,shard,materialize",
    [
        ("ifelse", "root", False),  # the branches inside the root's FSDP2 group
        ("ifelse", "branches", False),  # each branch its own FSDP2 unit (all-gather in its forward)
        ("masked", "root", False),  # MaskedBranch with undefined gradients for dead branches
    ],
    ids=["ifelse-root", "ifelse-branches", "masked-undefined-grads"],
)
def test_fsdp2_broken_setups_fail(mode, shard, materialize):
    results, timed_out = launch(
        "scenario_broken", 2, FAIL_TIMEOUT_S, op_timeout_s=10, linger_s=0, mode=mode, shard=shard, materialize=materialize
    )
    outcome = describe_failure(results, timed_out)
    detail = [res if res is None or res[0] != "ok" else ("ok", res[1]["worst"]) for res in results]
    print(f"{mode}/{shard}/materialize={materialize}: {outcome}: {str(detail)[-600:]}")
    assert outcome is not None, f"expected a hang, an error or wrong gradients, got correct results: {results}"


def test_masked_branch_refuses_sharded_branches(main_job):
    """A branch that is its own FSDP2 unit all-gathers in its forward: skipped on one rank, the
    collective would hang the others, so MaskedBranch refuses it (on every rank alike)."""
    for r, res in enumerate(main_job):
        msg = res["refusal"]
        assert "runs collectives" in msg or "DTensor" in msg, f"rank {r}: {msg}"


def scenario_refusal(rank, world):
    model = Net("masked")
    for b in model.mb.branches:
        fully_shard(b)
    fully_shard(model)
    try:
        model(*batch(0, rank, "ids")[::2])
    except ValueError as e:
        return str(e)
    return "not refused"
