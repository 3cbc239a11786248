"""torch.compile: MaskedBranch, DropPath and ResidualDropPath give the outputs and gradients of
eager mode, and graph breaks stay within bounds (counted with torch._dynamo.explain):

* none for MaskedBranch with an int gate and for DropPath;
* at most one per routed call otherwise (MaskedBranch with a tensor gate, ResidualDropPath in
  training): the routing plan's per-branch row counts are read on the host, which is
  data-dependent Python control flow (which branches run, how the packed buffer splits) -
  exactly one break, where the counts leave the graph.

No global dynamo / inductor setting is changed. Equality runs on the "aot_eager" backend (Dynamo +
AOTAutograd with the registered fake kernels and autograd formulas, the ops running eagerly:
random draws use the same default generator as eager mode, so the masks are identical); one test
compiles with inductor (slow on a CPU: about half a minute).

torch._dynamo.explain does not count a break that comes before the first traced operation of a
function (ResidualDropPath's row mode starts with its one break, a torch.compiler.disable'd host
helper, so explain reports 0 there); the bounds hold either way.
"""
import copy
import shutil
import sys

import pytest
import torch
from torch import nn

import maskedbranch as mb

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "compile") or sys.version_info >= (3, 14), reason="needs torch.compile (Dynamo)"
)

D = 8
B = 10

def branch():
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


def explain(fn, *args):
    torch._dynamo.reset()
    e = torch._dynamo.explain(fn)(*args)
    reasons = [r.reason.splitlines()[0] for r in e.break_reasons]
    return e.graph_count, e.graph_break_count, reasons


def gate_cases():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, 3, generator=g) < 0.5
    return {
        "ids": torch.randint(-1, 3, (B,), generator=g),
        "ids_one_branch_dead": torch.randint(0, 2, (B,), generator=g),
        "mask": mask,
        "weights": torch.rand(B, 3, generator=g) * mask,
        "all_dead_tensor": torch.full((B,), -1),
    }


# ----------------------------------------------------------------------------------------------
# Graph breaks.


@pytest.mark.parametrize("k", [0, 2, -1])
def test_breaks_masked_branch_int_gate(k):
    torch.manual_seed(0)
    module = mb.MaskedBranch([branch() for _ in range(3)])
    x = torch.randn(B, D, requires_grad=True)
    module(x, k)  # the first call also checks the dead branches on meta tensors (eager only)
    graphs, breaks, reasons = explain(module, x, k)
    assert (graphs, breaks) == (1, 0), reasons
    graphs, breaks, reasons = explain(lambda x: mb.masked_branch(list(module.branches), x, k), x)
    assert (graphs, breaks) == (1, 0), reasons


@pytest.mark.parametrize("kind", list(gate_cases()))
def test_breaks_masked_branch_routed(kind):
    torch.manual_seed(0)
    module = mb.MaskedBranch([branch() for _ in range(3)])
    x = torch.randn(B, D, requires_grad=True)
    gate = gate_cases()[kind]
    module(x, gate)
    graphs, breaks, reasons = explain(module, x, gate)
    assert breaks <= 1, reasons
    for r in reasons:  # the one break is where the per-branch counts leave the graph
        assert "Data dependent" in r or "Dynamic shape" in r or "item()" in r, r


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_breaks_drop_path_eval_and_identity(mode):
    x = torch.randn(B, D)
    for module in (mb.DropPath(0.3, mode=mode).eval(), mb.DropPath(0.0, mode=mode).train()):
        graphs, breaks, reasons = explain(module, x)  # the identity: no graph at all
        assert graphs <= 1 and breaks <= 0, reasons
    graphs, breaks, reasons = explain(mb.ResidualDropPath(branch(), 0.3, mode=mode).eval(), x)
    assert (graphs, breaks) == (1, 0), reasons


def test_breaks_drop_path_row_unscaled():
    x = torch.randn(B, D)
    graphs, breaks, reasons = explain(mb.DropPath(0.3, scale_by_keep=False).train(), x)
    assert breaks == 0, reasons


def test_breaks_drop_path_row():
    x = torch.randn(B, D)
    graphs, breaks, reasons = explain(mb.DropPath(0.3).train(), x)
    assert breaks == 0, reasons


def test_breaks_drop_path_batch():
    x = torch.randn(B, D)
    graphs, breaks, reasons = explain(mb.DropPath(0.3, mode="batch").train(), x)
    assert breaks == 0, reasons


def test_breaks_residual_drop_path_batch():
    x = torch.randn(B, D)
    graphs, breaks, reasons = explain(mb.ResidualDropPath(branch(), 0.3, mode="batch").train(), x)
    assert breaks <= 1, reasons


@pytest.mark.parametrize("scale_by_keep", [True, False])
def test_breaks_residual_drop_path_row(scale_by_keep):
    x = torch.randn(B, D)
    graphs, breaks, reasons = explain(mb.ResidualDropPath(branch(), 0.3, scale_by_keep=scale_by_keep).train(), x)
    assert breaks <= 1, reasons


# ----------------------------------------------------------------------------------------------
# Outputs and gradients equal eager mode.


def grads_of(module):
    return {k: p.grad for k, p in module.named_parameters()}


def assert_same_grads(got, want, **tol):
    for k in want:
        assert (got[k] is None) == (want[k] is None), k
        if want[k] is not None:
            torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{k}: {m}", **tol)


def step(module, x, *args, seed=0):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    args = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.manual_seed(seed)
    out = module(x, *args)
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * w).sum().backward()
    extra = [a.grad for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return out.detach(), x.grad, grads_of(module), extra


TIGHT = dict(rtol=1e-6, atol=1e-6)


def assert_same_step(got, want, module, tol):
    """A compiled step (output, x's gradient, parameter and gate gradients) equals the eager one."""
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert_same_grads(grads_of(module), want[2], **tol)
    assert len(got[3]) == len(want[3])
    for a, b in zip(got[3], want[3]):  # the gate weights' gradient, where there is one
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("materialize", [False, True])
def test_masked_branch_compiled_equals_eager(materialize):
    torch.manual_seed(0)
    eager = mb.MaskedBranch([branch() for _ in range(3)], materialize_grads=materialize)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend="aot_eager")
    x = torch.randn(B, D)
    gates = [1, *gate_cases().values(), -1, 0, gate_cases()["ids"].flip(0)]
    for gate in gates:
        want = step(eager, x, gate)
        assert_same_step(step(compiled, x, gate), want, compiled_module, TIGHT)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_drop_path_compiled_equals_eager(mode):
    torch.manual_seed(0)
    lin = nn.Linear(D, D)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin
            self.dp = mb.DropPath(0.5, mode=mode)

        def forward(self, x):
            return x + self.dp(self.lin(x))

    eager = Block().train()
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend="aot_eager")
    x = torch.randn(B, D)
    for seed in range(4):
        want = step(eager, x, seed=seed)
        assert_same_step(step(compiled, x, seed=seed), want, compiled_module, TIGHT)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_residual_drop_path_compiled_equals_eager(mode):
    torch.manual_seed(0)
    eager = nn.Sequential(
        mb.ResidualDropPath(branch(), 0.5, mode=mode), mb.ResidualDropPath(branch(), 0.3, mode=mode)
    ).train()
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, backend="aot_eager")
    x = torch.randn(B, D)
    ran = []
    for seed in range(5):
        want = step(eager, x, seed=seed)
        assert_same_step(step(compiled, x, seed=seed), want, compiled_module, TIGHT)
        ran.append(tuple(p.grad is not None for p in compiled_module.parameters()))
    assert len(set(ran)) > 1 or mode == "row"  # batch mode: some steps skipped a branch


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_masked_branch_inductor():
    """One routed call through inductor (forward and backward kernels generated for the graph
    around the custom ops)."""
    torch.manual_seed(0)
    eager = mb.MaskedBranch([branch() for _ in range(3)])
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module)
    x = torch.randn(B, D)
    gate = gate_cases()["weights"]
    want = step(eager, x, gate)
    got = step(compiled, x, gate)
    assert_same_step(got, want, compiled_module, dict(rtol=1e-5, atol=1e-5))
    assert len(got[3]) == 1  # the weights gate's gradient
