"""ResidualDropPath and drop_add_residual under DistributedDataParallel, real processes (4 ranks,
gloo): they train exactly as the code they replace, whatever the DDP setting.

* By default (``materialize_grads=True``) the code replaced is timm's ``x + drop_path(branch(x))``:
  every branch's parameters get a gradient, zeros where every row was dropped, which plain DDP
  averages and the optimizer then steps (momentum, weight decay), as for timm.
* With ``materialize_grads=None`` it is the block that skips its branch when dropped
  (``x + branch(x) / keep_prob`` on the kept rows, ``x`` where none is), which DDP needs
  ``find_unused_parameters=True`` for: a branch dropped on every rank gets no gradient at all,
  and the optimizer leaves it alone.

One model holds both kinds of blocks (and drop_add_residual with ``None``); the reference holds
the replaced blocks, under DDP(find_unused_parameters=True). Every rank draws its own masks (the
reference replays the same draws), so on many steps a branch runs on some ranks and not on
others, and on some steps on none.
"""
import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import maskedbranch as mb

from harness import ReferenceResidual, results_of, run_ranks, run_scenarios, state_diff, training_state

WORLD = 4
STEPS = 6
WIDTH = 8
BLOCKS = ((0.5, True), (0.97, None), (0.9, True))  # ResidualDropPath (drop_prob, materialize_grads)
# then one drop_add_residual block at 0.6, materialize_grads=None
TIMEOUT_S = 240

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
]


def make_branch():
    return nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def generator(seed):
    return torch.Generator().manual_seed(seed)


class Net(nn.Module):
    def __init__(self, mode, seed, masked):
        super().__init__()
        self.masked, self.mode = masked, mode
        self.inp = nn.Linear(5, WIDTH)
        self.blocks = nn.ModuleList(
            (mb.ResidualDropPath(make_branch(), p, mode=mode, generator=generator(seed + i), **({} if m else {"materialize_grads": m}))
             if masked else ReferenceResidual(make_branch(), p, mode, generator(seed + i), dense=m is True))
            for i, (p, m) in enumerate(BLOCKS)
        )
        self.last = make_branch()  # through drop_add_residual (the functional form)
        self.last_generator = generator(seed + 99)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if self.masked:
            h = mb.drop_add_residual(h, self.last, 0.6, self.training, mode=self.mode, generator=self.last_generator, materialize_grads=None)
        else:
            h = ReferenceResidual(self.last, 0.6, self.mode, self.last_generator, dense=False)(h)
        return self.head(h).mean(1)


def make_optimizers(model):
    """Two optimizers with momentum and weight decay, each over some routed blocks."""
    m = model.module
    first = [*m.inp.parameters(), *m.blocks[0].parameters(), *m.blocks[2].parameters()]
    taken = {id(p) for p in first}
    return [
        torch.optim.SGD(first, lr=0.05, momentum=0.9, weight_decay=0.01),
        torch.optim.AdamW([p for p in m.parameters() if id(p) not in taken], lr=0.01, weight_decay=0.01),
    ]


def train(rank, group, mode, identical=False, accumulate=1, **ddp_kwargs):
    torch.manual_seed(0)  # identical initial weights on every rank
    seed = 1234 if identical else 1234 + 7919 * rank
    masked = Net(mode, seed, True).double()
    ifelse = Net(mode, seed, False).double()
    ifelse.load_state_dict(masked.state_dict())  # same keys: blocks.0.branch.1.weight, ...
    models = {
        "masked": DDP(masked, process_group=group, **ddp_kwargs),
        "ifelse": DDP(ifelse, process_group=group, find_unused_parameters=True),
    }
    opts = {k: make_optimizers(m) for k, m in models.items()}
    data = generator(100 + rank)  # different data on every rank
    calls = [0] * len(BLOCKS)  # forward calls of each ResidualDropPath's branch on this rank
    for i, block in enumerate(masked.blocks):
        block.branch.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    worst, none_mismatch, none_grads, ran, history = 0.0, [], 0, [], []
    for step in range(STEPS):
        batches = [(torch.randn(3, 4, 5, generator=data, dtype=torch.float64), torch.randn(3, 1, generator=data, dtype=torch.float64))
                   for _ in range(accumulate)]
        before = list(calls)
        for k, model in models.items():
            model.zero_grad(set_to_none=True)
            for micro, (x, t) in enumerate(batches):
                quiet = model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
                with quiet:
                    (model(x) - t).square().mean().backward()
            for opt in opts[k]:
                opt.step()
        ran.append([int(c > b) for c, b in zip(calls, before)])
        w, nm = state_diff(training_state(masked), training_state(ifelse))
        worst = max(worst, w)
        none_mismatch += [(step, name) for name in nm]
        none_grads += sum(p.grad is None for p in ifelse.parameters())
        history.append(torch.cat([p.detach().reshape(-1) for p in masked.parameters()]))
    return {"worst": worst, "none_mismatch": none_mismatch, "none_grads": none_grads, "ran": ran, "history": history}


SETTINGS = {
    "default": {},
    "find_unused_parameters": dict(find_unused_parameters=True),
    "static_graph": dict(static_graph=True),
    "gradient_as_bucket_view": dict(gradient_as_bucket_view=True),
    "no_sync": dict(accumulate=2),
}
CASES = {f"{mode}-{name}": dict(mode=mode, **kw) for mode in ("row", "batch") for name, kw in SETTINGS.items()}
CASES["batch-identical-draws"] = dict(mode="batch", identical=True)


def _worker(rank, world, init_file, out_dir):
    run_scenarios(rank, world, init_file, out_dir, {name: functools.partial(train, **case) for name, case in CASES.items()})


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, WORLD, TIMEOUT_S, "the DDP job")


@pytest.mark.parametrize("case", list(CASES))
def test_trains_as_the_replaced_blocks(ranks, case):
    per_rank = results_of(ranks, case)
    for r, res in enumerate(per_rank):
        assert res["worst"] < 1e-10, f"rank {r}: parameters or gradients differ from the reference by {res['worst']}"
        assert not res["none_mismatch"], f"rank {r}: None gradients differ from the reference at {res['none_mismatch'][:5]}"
    for r in range(1, WORLD):
        for step, (a, b) in enumerate(zip(per_rank[0]["history"], per_rank[r]["history"])):
            assert torch.equal(a, b), f"rank {r}: parameters differ from rank 0's after step {step}"
    # the run exercised what it should: blocks skipped on every rank at once (the skipping
    # reference then left their gradients None), and ranks disagreeing about a block (independent
    # draws) or never
    assert all(res["none_grads"] > 0 for res in per_rank), "no skipping block was dropped on every rank at once"
    ran = torch.tensor([res["ran"] for res in per_rank])  # [rank, step, block]
    assert bool((ran.amax(0) == 0).any()), "no block was skipped on every rank at once"
    disagree = int((ran.amin(0) != ran.amax(0)).sum())
    if CASES[case].get("identical"):
        assert disagree == 0, f"identical draws, yet the ranks disagreed {disagree} times"
    else:
        assert disagree > 0, "the ranks never disagreed about running a block"
