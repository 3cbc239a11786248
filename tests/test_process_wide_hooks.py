"""What maskedbranch installs process-wide, and when.

A model that trains in one process, eagerly, under no wrapper installs nothing that other models
and optimizers of the process then run: no optimizer step pre-hook, no module registration hook.
The step pre-hook comes when something needs it (a wrapper given a reducer, a routing module compiled, a
routing module made in a distributed job); a model built before ``init_process_group`` gets its
DDP's reducer made at the first forward and trains as if/else with ``find_unused_parameters=True``.

The one-process checks run in a fresh interpreter each: other tests' modules keep the hook alive.
"""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import leave_job, run_ranks, state_diff, training_state

PRELUDE = """
import torch
from torch import nn
import maskedbranch as mb
from maskedbranch import _reducer, unused_grads

def installed():
    return unused_grads._hook.handle is not None, unused_grads._hook.ddp_watch is not None

def train(model, steps=3, gate=lambda s: s % 2):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for s in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3), gate(s)).sum().backward()
        opt.step()
    return opt
"""


def _run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_one_process_eager_training_installs_nothing():
    out = _run("""
        experts = mb.MaskedBranch([nn.Linear(3, 3) for _ in range(3)])
        blocks = mb.ResidualDropPath(nn.Linear(3, 3), 0.5)
        print(installed())
        train(experts)
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad(); blocks(torch.randn(4, 3)).sum().backward(); opt.step()
        mb.masked_branch(list(experts), torch.randn(4, 3), torch.tensor([0, 1, -1, 0])).sum().backward()
        print(installed())
        # if/else's gradients: branch 2 never ran, so it has none
        print(experts[2].weight.grad is None)
    """)
    assert out.split() == ["(False,", "False)", "(False,", "False)", "True"], out


def test_a_wrapper_or_a_compiled_graph_installs_the_step_hook():
    out = _run("""
        model = mb.MaskedBranch([nn.Linear(3, 3) for _ in range(3)])
        print(installed())
        compiled = torch.compile(model, backend="eager")
        train(compiled, steps=2, gate=lambda s: torch.tensor([s % 3, -1, 1, 0]))
        print(installed())
        # the compiled graph ran branch 2 on no row in step 0 (zeros), and on rows in step 1
        other = mb.MaskedBranch([nn.Linear(3, 3) for _ in range(2)])
        model2 = nn.Sequential()
        model2.add_module("b", other)
        unused_grads.uninstall()
        print(installed())
        opt = torch.optim.SGD(other.parameters(), lr=0.1)
        handle = mb.unused_grads_to_none(opt, model2)
        print(installed())
    """)
    assert out.split() == ["(False,", "False)", "(True,", "True)", "(False,", "True)", "(True,", "True)"], out


def test_the_compiled_local_reset_still_runs():
    """A compiled one-process model gives a dead branch zeros in its graph; the step hook, which
    the compile installed, sets them back to None before the step, as if/else leaves them."""
    out = _run("""
        torch.manual_seed(0)
        model = mb.MaskedBranch([nn.Linear(3, 3) for _ in range(3)])
        compiled = torch.compile(model, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled(torch.randn(4, 3), torch.tensor([0, 1, 1, 0])).sum().backward()
        print(model[2].weight.grad is not None)   # zeros from the graph
        opt.step()
        print(model[2].weight.grad is None)       # reset before the step
    """)
    assert out.split() == ["True", "True"], out


# ----------------------------------------------------------------------------------------------
# Real ranks: the model is built before init_process_group.

WORLD = 2


class Net(nn.Module):
    def __init__(self, masked):
        super().__init__()
        import maskedbranch as mb

        self.pre = nn.Linear(4, 6)
        branches = [nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)) for _ in range(3)]
        self.choices = mb.MaskedBranch(branches) if masked else nn.ModuleList(branches)
        self.masked = masked
        self.head = nn.Linear(6, 2)

    def forward(self, x, k):
        h = torch.tanh(self.pre(x))
        if self.masked:
            h = h + self.choices(h, k)
        elif k >= 0:
            h = h + self.choices[k](h)
        return self.head(h)


def _worker(rank, world, init_file, out_dir):
    from datetime import timedelta

    from maskedbranch import _warn, unused_grads

    torch.set_num_threads(1)
    torch.manual_seed(5)  # identical initial weights on every rank
    masked = Net(True).double()
    ifelse = Net(False).double()
    ifelse.load_state_dict(masked.state_dict())
    before_init = (unused_grads._hook.handle is not None, unused_grads._hook.ddp_watch is not None)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    models = {"masked": DDP(masked), "ifelse": DDP(ifelse, find_unused_parameters=True)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01) for k, m in models.items()}
    worst, mismatch, none_grads, said = 0.0, [], 0, []
    for step in range(6):
        g = torch.Generator().manual_seed(step * 13 + rank)
        x = torch.randn(5, 4, generator=g, dtype=torch.float64)
        k = (rank + step) % 2 if step % 3 else -1  # branch 2 never runs; step 0 runs none on any rank
        for name, model in models.items():
            opts[name].zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(x, k).square().mean().backward()
            said += [str(w.message) for w in caught if "init_process_group" in str(w.message)]
            opts[name].step()
        w, nm = state_diff(training_state(masked), training_state(ifelse))
        worst, mismatch = max(worst, w), mismatch + [(step, n) for n in nm]
        none_grads += sum(p.grad is None for p in ifelse.parameters())
    # A model made in the job: its DDP's construction is seen, nothing is said.
    _warn.given.discard("unowned")
    torch.manual_seed(5)
    after = DDP(Net(True).double())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after(torch.ones(5, 4, dtype=torch.float64), rank % 2).sum().backward()
    said_after = [str(w.message) for w in caught if "init_process_group" in str(w.message)]
    torch.save({"before_init": before_init, "worst": worst, "mismatch": mismatch, "none_grads": none_grads,
                "said": said, "said_after": said_after}, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_job()


@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_a_model_built_before_init_process_group_trains_as_ifelse():
    for r, res in enumerate(run_ranks(_worker, WORLD, 120, "the DDP job")):
        assert res["before_init"] == (False, False), f"rank {r}: installed before any process group: {res['before_init']}"
        assert res["worst"] < 1e-12, f"rank {r}: differs from if/else by {res['worst']}"
        assert not res["mismatch"], f"rank {r}: None gradients differ from if/else at {res['mismatch'][:5]}"
        assert res["none_grads"] > 0, "no parameter went unused on every rank: the case tests no reset"
        # the cost of a DDP built before the job is said once, with the way out
        assert len(res["said"]) == 1 and "configure_model" in res["said"][0], f"rank {r}: {res['said']}"
        assert not res["said_after"], f"rank {r}: warned about a model made in the job: {res['said_after']}"
