"""Unused-gradient pruning when ``optimizer.step`` is given a closure (LBFGS, Lightning's automatic
optimization): the closure runs the forward and backward inside ``step``, after the step
pre-hooks, so the pruning must run after the closure. Checked against if/else with AdamW and
weight decay (a pruned gradient is skipped; a zero one would decay the weights):

* one process, the explicit ``unused_grads_to_none`` handle, with and without a closure;
* two gloo ranks routing to different experts, the default (automatic) pruning under
  DDP(find_unused_parameters=False), against if/else under find_unused_parameters=True.
"""
import pytest
import torch
from torch import nn

import harness
import maskedbranch as mb

N = 3


class Net(nn.Module):
    def __init__(self, masked, materialize=None):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 8)
        experts = [nn.Linear(8, 8) for _ in range(N)]
        self.experts = mb.MaskedBranch(experts, materialize_grads=materialize) if masked else nn.ModuleList(experts)
        self.masked = masked

    def forward(self, x, gate):
        h = self.pre(x)
        return (self.experts(h, gate) if self.masked else self.experts[gate](h)).pow(2).mean()


def train(model, gates, closure, wrap=lambda m: m, explicit=False):
    """AdamW steps, one per gate: the final state, and how many gradients each step pruned (with
    ``explicit``, through an ``unused_grads_to_none`` handle)."""
    wrapped = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    handle = mb.unused_grads_to_none(opt, model) if explicit else None
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    pruned = []
    for gate in gates:
        def step():
            opt.zero_grad(set_to_none=True)
            loss = wrapped(x, gate)
            loss.backward()
            return loss

        if closure:
            opt.step(step)
        else:
            step()
            opt.step()
        pruned.append(handle.last_reset if handle else None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, pruned


GATES = [0, 1, 0]


@pytest.mark.parametrize("closure", [False, True], ids=["step", "closure"])
def test_explicit_handle_prunes_after_the_closure(closure):
    want, _ = train(Net(masked=False), GATES, closure)
    unpruned, _ = train(Net(masked=True, materialize=True), GATES, closure)  # zeros for the idle experts
    assert not torch.equal(unpruned["experts.2.weight"], want["experts.2.weight"])  # weight decay moved them
    got, pruned = train(Net(masked=True, materialize=True), GATES, closure, explicit=True)
    assert pruned == [2 * (N - 1)] * len(GATES)  # weight and bias of the two idle experts
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def _scenario(masked, fup):
    def run(rank, group):
        gates = [(s + rank) % N for s in range(4)]  # the ranks route differently; one expert idle each step
        wrap = lambda m: nn.parallel.DistributedDataParallel(m, process_group=group, find_unused_parameters=fup)  # noqa: E731
        return train(Net(masked), gates, closure=True, wrap=wrap)[0]

    return run


def _worker(rank, world, init_file, out_dir):
    scenarios = {"ifelse": _scenario(masked=False, fup=True), "masked": _scenario(masked=True, fup=False)}
    harness.run_scenarios(rank, world, init_file, out_dir, scenarios)


@pytest.mark.distributed
def test_ddp_with_a_closure_equals_ifelse():
    ranks = harness.run_ranks(_worker, 2, timeout_s=120, what="the closure job")
    want = harness.results_of(ranks, "ifelse")
    got = harness.results_of(ranks, "masked")
    for r in range(2):
        for k, v in want[r].items():
            torch.testing.assert_close(got[r][k], v, rtol=0, atol=0, msg=f"rank {r} {k}")
