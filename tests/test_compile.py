"""torch.compile: every routing module compiles whole (``fullgraph=True``) in training, and one
graph serves every routing pattern: fresh gates, masks and paths for many steps add no graph.

* Every gate kind of MaskedBranch (an int path, ids, masks, weights, a 0-d tensor, nothing live),
  masked_branch, ResidualDropPath and drop_add_residual in both modes (with and without
  scale_by_keep, ``kept="fixed"``) and DropPath, through a counting backend over aot_eager: the
  graphs compiled stop growing after the first steps (an int path: one more, when Dynamo makes
  it dynamic), no graph break, every step runs a compiled graph.
* Outputs equal eager mode's with the same seed (the residual forms draw from the same default
  CPU generator in both); gradients too, dead branches' zeros standing for eager's ``None``
  until the step: after each optimizer step (SGD with momentum and weight decay) parameters and
  gradients, ``None`` included, equal eager's.
* A supernet with a random path per step, trained under plain ``torch.compile``: two graphs in
  all, where the if/else supernet recompiles per path.
* Inductor on a few cases (torch >= 2.13, where CI runs it).

Torch before 2.13 does not turn on ``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``
under fullgraph: the tests set both there (docs/guides/compile.md), as a user would. The library
never changes Dynamo's configuration. The DDP cases are in tests/test_compile_ddp.py.
"""
import contextlib
import copy
import random
import shutil
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import maskedbranch as mb
from harness import Counting, assert_same_grads

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")

B, D, N = 12, 8, 3
TIGHT = dict(rtol=1e-6, atol=1e-6)
FLAGS_NEEDED = torch.__version__ < "2.13"
# whole-batch choices and int gates compiled as if/else (torch 2.6 cannot tell an export from a
# compile: the routed rows, one graph for every choice)
CHOICES = hasattr(torch.compiler, "is_exporting")
STEPS = 12
INDUCTOR = pytest.mark.skipif(
    torch.__version__ < "2.13" or (shutil.which("c++") is None and shutil.which("g++") is None),
    reason="inductor cases run on torch >= 2.13 with a C++ compiler",
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    counters.clear()
    flags = (
        torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)
        if FLAGS_NEEDED else contextlib.nullcontext()
    )
    with flags:
        yield
    torch.compiler.reset()


def mlp():
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


def gates(kind, step):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "ids":
        return torch.randint(-1, N, (B,), generator=g)
    if kind == "mask":
        return torch.rand(B, N, generator=g) < 0.5
    if kind == "weights":
        return torch.rand(B, N, generator=g) * (torch.rand(B, N, generator=g) < 0.5)
    if kind == "scalar":
        return torch.randint(-1, N, (), generator=g)
    if kind == "int":
        return int(torch.randint(-1, N, (), generator=g))
    if kind == "dead":
        return torch.full((B,), -1)
    raise ValueError(kind)


def run(fn, x, *args, seed=0, params=()):
    """Output, x's gradient and {name: grad} of ``params``, after reseeding the default
    generator (the same draws in eager and compiled calls)."""
    for _, p in params:
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = fn(x, *args)
    if out.requires_grad:  # (eager: nothing ran, nothing tied)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    grads = {name: p.grad for name, p in params}
    grads["x"] = x.grad
    return out.detach(), grads


def assert_steps(module, calls, steps=STEPS, backend=None, settle=2, fullgraph=True):
    """Compile a copy of ``module`` whole and run ``calls(step)`` (args after x) for ``steps``
    steps against eager ``module``: same outputs, same gradients (zeros for eager's None), no
    graph after step ``settle``, no graph break, a compiled graph run every step."""
    backend = backend or Counting()
    twin = copy.deepcopy(module)
    compiled = torch.compile(twin, backend=backend, fullgraph=fullgraph)
    x = torch.randn(B, D)
    graphs = []
    for step in range(steps):
        args = calls(step)
        want = run(module, x, *args, seed=step, params=list(module.named_parameters()))
        before = getattr(backend, "calls", None)
        got = run(compiled, x, *args, seed=step, params=list(twin.named_parameters()))
        torch.testing.assert_close(got[0], want[0], **TIGHT)
        assert_same_grads(got[1], want[1], none_is_zero=True, **TIGHT)
        if before is not None:
            assert backend.calls > before, f"step {step} ran no compiled graph"
            graphs.append(backend.compiled)
    assert not counters["graph_break"], dict(counters["graph_break"])
    if graphs:
        assert graphs[settle - 1] == graphs[-1], f"graphs after each step: {graphs}"
    return graphs


# ----------------------------------------------------------------------------------------------
# One graph for every routing pattern.


@pytest.mark.parametrize("kind", ["ids", "mask", "weights", "scalar", "dead"])
def test_tensor_gates_compile_whole(kind):
    torch.manual_seed(0)
    graphs = assert_steps(mb.MaskedBranch([mlp() for _ in range(N)]), lambda s: (gates(kind, s),))
    assert graphs[-1] == 1, graphs


class IfElse(nn.Module):
    """The if/else code a MaskedBranch with an int gate replaces (-1: zeros)."""

    def __init__(self, branches):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x, k):
        return self.branches[k](x) if k >= 0 else torch.zeros_like(x)


def ifelse_graphs(branches, ints, x=None) -> int:
    """How many graphs torch.compile makes for the if/else code over ``ints``, a gate per step."""
    backend = Counting()
    compiled = torch.compile(IfElse(copy.deepcopy(branches)), backend=backend, fullgraph=True)
    x = torch.randn(B, D) if x is None else x
    for k in ints:
        out = compiled(x, k)
        if out.requires_grad:
            out.sum().backward()
    torch.compiler.reset()
    return backend.compiled


def test_int_gate_compiles_as_if_else():
    """A Python int: the chosen branch inlined, a graph per choice exactly where if/else makes
    one (-1, no branch, included), the other branches not in the graph, no graph break."""
    torch.manual_seed(0)
    branches = [mlp() for _ in range(N)]
    ints = [gates("int", s) for s in range(STEPS)]
    want = ifelse_graphs(branches, ints)
    backend = Counting()
    graphs = assert_steps(mb.MaskedBranch(branches), lambda s: (ints[s],), backend=backend, settle=STEPS)
    if not CHOICES:  # the routed rows: the int becomes data once Dynamo makes it dynamic
        assert graphs[-1] <= 2, graphs
        return
    assert graphs[-1] == want, (graphs, want)
    assert not backend.has("maskedbranch.") and not backend.has("cond"), "routing ops in an int choice's graph"


@pytest.mark.skipif(not CHOICES, reason="torch 2.6: int gates take the routed rows, one graph")
def test_int_gates_near_the_recompile_limit_warn_once_naming_the_tensor_form():
    torch.manual_seed(0)
    layer = mb.MaskedBranch([nn.Linear(D, D) for _ in range(6)])
    compiled = torch.compile(layer, backend=Counting())  # plain: past the limit, eager mode
    x = torch.randn(B, D)
    limit = mb._compat.recompile_limit()
    with torch._dynamo.config.patch(**{"recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit": 4}):
        with pytest.warns(UserWarning, match=r"traced 3 graphs for its int gate.*0-d integer tensor gate") as caught:
            for k in (0, 1, 2, 3, 4, 5, 1):
                compiled(x, k)
    assert len([w for w in caught if "int gate" in str(w.message)]) == 1
    assert limit == mb._compat.recompile_limit()


@pytest.mark.parametrize("materialize", [None, True, False])
def test_explicit_settings_compile_whole(materialize):
    torch.manual_seed(0)
    assert_steps(mb.MaskedBranch([mlp() for _ in range(N)], materialize_grads=materialize), lambda s: (gates("ids", s),))


def test_functional_masked_branch_compiles_whole():
    torch.manual_seed(0)
    branches = nn.ModuleList(mlp() for _ in range(N))

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.branches = branches

        def forward(self, x, gate):
            return mb.masked_branch(list(self.branches), x, gate)

    assert_steps(Functional(), lambda s: (gates("mask", s),))


@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("scale_by_keep", [True, False])
def test_residual_drop_path_compiles_whole(mode, scale_by_keep):
    """The kept count changes every step; the draw comes from the default CPU generator, as in
    eager mode, so outputs are equal."""
    torch.manual_seed(0)
    block = mb.ResidualDropPath(mlp(), 0.5, mode=mode, scale_by_keep=scale_by_keep).train()
    graphs = assert_steps(block, lambda s: ())
    assert graphs[-1] == 1, graphs


def test_a_drop_path_graph_has_one_plan_and_one_row_count():
    """Each data-dependent size costs compile time in Dynamo, AOT autograd and inductor, which
    reason about every one of them. A compiled row-mode drop path makes its padded plan straight
    from its own draw (valid by construction: no plan of the gate to check it) and reads its
    branch's row count from the plan's size: one plan op and one unbacked size per call."""
    torch.manual_seed(0)
    backend = Counting()
    block = mb.ResidualDropPath(mlp(), 0.5).train()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        torch.compile(block, backend=backend, fullgraph=True)(torch.randn(B, D))
    assert backend.compiled == 1
    assert backend.code[0].count("maskedbranch.plan") == 1, backend.code[0]
    assert len(backend.unbacked[0]) == 1, backend.unbacked[0]


def test_the_data_parallel_seam_holds_plain_functions():
    """maskedbranch/_reducer.py and unused_grads.py plug their functions into the routing units'
    seam (``_unit.DATA_PARALLEL``) as plain functions: a staticmethod object stored on an
    instance is not callable before Python 3.10, and Dynamo cannot trace a call of one (a graph
    break in every compiled call that decides, as the transformers patch's layer loop does)."""
    from maskedbranch import _unit

    for name in ("decide", "created"):
        f = _unit.DATA_PARALLEL.__dict__[name]
        assert callable(f) and not isinstance(f, staticmethod), name


def test_drop_path_routes_per_row_arguments_with_the_kept_rows():
    """The compiled drop path's own routing (maskedbranch/_route.py, drop_rows) gives a per-row
    argument the kept rows, as eager mode does; other arguments pass through."""
    torch.manual_seed(0)

    class Conditioned(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.g = nn.Linear(D, D), nn.Linear(D, D)

        def branch(self, h, c, gain):
            return self.f(h) * torch.sigmoid(self.g(c)) * gain

        def forward(self, x, c):
            return mb.drop_add_residual(x, self.branch, 0.5, self.training, args=(c, 2.0))

    assert_steps(Conditioned().train(), lambda s: (torch.randn(B, D, generator=torch.Generator().manual_seed(s)),))


def test_row_drop_path_of_batch_norm_keeps_eager_statistics():
    """A branch with BatchNorm in a row-mode drop path: compiled, it runs on copies of its buffers,
    written back only when a row was kept (when none is, the branch still runs, on one padded
    row of weight zero, which must not move the statistics): after every step the running
    statistics equal eager mode's, including steps that dropped every row."""
    torch.manual_seed(0)
    eager = mb.ResidualDropPath(conv_bn(), 0.85).train()
    twin = copy.deepcopy(eager)
    backend = Counting()
    compiled = torch.compile(twin, backend=backend, fullgraph=True)
    x = torch.randn(B, 3, 4, 4)
    skipped = 0
    for step in range(STEPS):
        before = int(eager.branch[1].num_batches_tracked)
        want = run(eager, x, seed=step, params=list(eager.named_parameters()))
        got = run(compiled, x, seed=step, params=list(twin.named_parameters()))
        skipped += int(eager.branch[1].num_batches_tracked) == before
        torch.testing.assert_close(got[0], want[0], **TIGHT)
        assert_same_grads(got[1], want[1], none_is_zero=True, **TIGHT)
        for name, b in eager.named_buffers():
            torch.testing.assert_close(twin.get_buffer(name), b, **TIGHT, msg=f"step {step}, {name}")
    assert 0 < skipped < STEPS, skipped  # both kinds of step were met
    assert backend.compiled == 1 and not counters["graph_break"]


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_drop_add_residual_and_drop_path_compile_whole(mode):
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.lin = mlp(), nn.Linear(D, D)
            self.drop = mb.DropPath(0.3, mode=mode)

        def forward(self, x):
            h = mb.drop_add_residual(x, self.f, 0.4, self.training, mode=mode)
            return h + self.drop(self.lin(h)) + mb.drop_path(h, 0.2, self.training, mode=mode)

    assert_steps(Block().train(), lambda s: ())


def test_fixed_kept_count_has_static_shapes():
    """kept="fixed": the same rows count every step, chosen on x's device: no data-dependent
    size at all (no capture flag needed), one graph."""
    torch.manual_seed(0)
    block = mb.ResidualDropPath(mlp(), 0.5, kept="fixed").train()
    with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
        graphs = assert_steps(block, lambda s: ())
    assert graphs[-1] == 1, graphs


def test_eval_and_zero_drop_compile_whole():
    torch.manual_seed(0)
    assert_steps(mb.ResidualDropPath(mlp(), 0.5).eval(), lambda s: (), steps=3)
    assert_steps(mb.ResidualDropPath(mlp(), 0.0).train(), lambda s: (), steps=3)


# ----------------------------------------------------------------------------------------------
# Training: the gradients of dead branches are reset to None at the step, as eager leaves them.


class Routed(nn.Module):
    """A trunk, two routed layers and a residual drop path (auto setting), one branch of the
    first layer never used."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.a = mb.MaskedBranch([mlp() for _ in range(N)])
        self.b = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)])
        self.c = mb.ResidualDropPath(mlp(), 0.5, mode="batch", materialize_grads=None)

    def forward(self, x, ids, k):
        h = self.pre(x)
        h = h + self.a(h, ids)
        return self.c(h + self.b(h, k))


def test_compiled_training_equals_eager_step_by_step():
    torch.manual_seed(0)
    eager = Routed()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) for m in (eager, twin)]
    x = torch.randn(B, D)
    nones = 0
    for step in range(8):
        ids = torch.randint(-1, N - 1, (B,), generator=torch.Generator().manual_seed(step))  # branch 2: never
        k = step % N
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            model(x, ids, k).square().mean().backward()
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}, {name}: None in one run only"
            nones += p.grad is None
            torch.testing.assert_close(q, p, **TIGHT, msg=f"step {step}, {name}")
    assert nones > 0  # dead branches were skipped by the optimizer


def test_set_to_none_false_keeps_zero_tensors():
    """zero_grad(set_to_none=False): eager leaves a dead branch's zero tensor, so does the reset."""
    torch.manual_seed(0)
    eager = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)])
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) for m in (eager, twin)]
    x = torch.randn(B, D)
    for step in range(5):
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad(set_to_none=False)
            model(x, torch.full((B,), step % 2)).sum().backward()
            opt.step()
        for p, q in zip(eager.parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None)
            torch.testing.assert_close(q, p, **TIGHT)


def test_reset_follows_a_replaced_branch_and_a_new_parameter_group():
    """The reset before the step reads which parameters to look at once per optimizer, and again
    when a branch is replaced or the optimizer gains a parameter group: the new branch, never
    chosen, gets None as with if/else (its zeros from the graph are not kept)."""
    torch.manual_seed(0)
    eager = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)])
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, twin)]
    x, new = torch.randn(B, D), nn.Linear(D, D)
    for step in range(6):
        if step == 2:
            for m, opt in zip((eager, twin), opts):
                m[1] = copy.deepcopy(new)
                opt.add_param_group({"params": list(m[1].parameters())})
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad(set_to_none=True)
            model(x, torch.tensor(step % 2 * 2)).sum().backward()  # branches 0 and 2, never 1
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}, {name}: None in one run only"
            torch.testing.assert_close(q, p, **TIGHT, msg=f"step {step}, {name}")
    assert all(p.grad is None for p in twin[1].parameters())


def test_compiled_reset_of_shared_parameters_and_split_optimizers():
    """Two branches share a layer (its gradient comes from the one that ran: kept), one branch's
    parameters are split across two optimizers that step in turn (each resets its own): the
    compiled run's gradients and parameters equal eager if/else's at every step."""
    torch.manual_seed(0)

    def build():
        shared = nn.Linear(D, D)
        return mb.MaskedBranch([nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Linear(D, D)),
                                nn.Linear(D, D)])

    eager = build()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    pairs = []
    for m in (eager, twin):
        first = [m[1][1].weight, m[2].weight]
        rest = [p for p in m.parameters() if all(p is not q for q in first)]
        pairs.append((torch.optim.SGD(first, lr=0.1, momentum=0.9), torch.optim.AdamW(rest, lr=0.01)))
    x = torch.randn(B, D)
    for step in range(6):
        ids = torch.full((B,), (0, 2, 0, 1, 2, 0)[step])
        for model, opts in zip((eager, compiled), pairs):
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            model(x, ids).sum().backward()
            opts[step % 2].step()
        stepped = {id(p) for g in pairs[0][step % 2].param_groups for p in g["params"]}
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            if id(p) in stepped:  # (the other optimizer's gradients are reset at its own step)
                assert (p.grad is None) == (q.grad is None), f"step {step}, {name}: None in one run only"
            torch.testing.assert_close(q, p, **TIGHT, msg=f"step {step}, {name}")


@pytest.mark.skipif(not CHOICES, reason="torch 2.6: int gates take the routed rows")
def test_inlined_int_calls_and_tensor_calls_of_one_module_reset_as_if_else():
    """An int choice inlined holds the chosen branch only (the others keep None, as with if/else:
    nothing to reset); a 0-d tensor choice of the same module in the same step holds every
    branch (zeros for the others, set back to None at the step). -1 included; until a tensor
    call, the step has nothing to reset."""
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N + 1)])
            self.head = nn.Linear(D, D)

        def forward(self, x, k, t):
            h = self.head(x)
            h = h + self.layer(h, k)
            return h if t is None else h + self.layer(h, t)

    eager = Twice()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, twin)]
    x = torch.randn(B, D)
    calls = [(0, None), (-1, None), (1, 2), (-1, 0), (3, None), (2, 1), (-1, None), (0, 3)]
    for step, (k, t) in enumerate(calls):
        for model, opt, tensor in ((eager, opts[0], int), (compiled, opts[1], torch.tensor)):
            opt.zero_grad(set_to_none=True)
            model(x, k, None if t is None else tensor(t)).sum().backward()
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step} {calls[step]}, {name}: None in one run only"
            torch.testing.assert_close(q, p, **TIGHT, msg=f"step {step}, {name}")
        if step < 2:
            assert twin.layer._unit not in (mb._reducer.REDUCERS.local.local_units if mb._reducer.REDUCERS.local else ())


def test_a_second_compiled_model_joins_the_reset_of_one_optimizer():
    """One optimizer over two routed models; the second is compiled and run from step 2 on: the
    reset reads the positions of both from then on, as eager if/else's gradients say."""
    torch.manual_seed(0)
    eager = nn.ModuleList([mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)]) for _ in range(2)])
    twin = copy.deepcopy(eager)
    runs = [[eager[0], eager[1]], [torch.compile(twin[0], backend="aot_eager", fullgraph=True),
                                   torch.compile(twin[1], backend="aot_eager", fullgraph=True)]]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, twin)]
    x = torch.randn(B, D)
    for step in range(6):
        for (first, second), opt in zip(runs, opts):
            opt.zero_grad(set_to_none=True)
            out = first(x, torch.full((B,), step % N))
            if step >= 2:
                out = second(out, torch.full((B,), (step + 1) % N))
            out.sum().backward()
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}, {name}: None in one run only"
            torch.testing.assert_close(q, p, **TIGHT, msg=f"step {step}, {name}")


def test_a_compiled_model_deleted_between_steps_is_freed():
    """The reset's record of a compiled model that no wrapper runs holds its parameters until
    the model goes, not longer."""
    import gc
    import weakref

    model = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled(torch.randn(B, D), torch.zeros(B, dtype=torch.long)).sum().backward()
    opt.step()
    assert model[1].weight.grad is None
    ref = weakref.ref(model[1].weight)
    del model, compiled, opt
    torch._dynamo.reset()
    gc.collect()
    assert ref() is None


@pytest.mark.slow
def test_supernet_compiles_once_for_every_path():
    """12 x 4 would be the benchmark's; 3 x 3 here, under plain torch.compile with the two
    capture flags set (docs/guides/compile.md). The path is a forward argument of 0-d tensors:
    one graph serves every path. The if/else supernet specializes on each path, so it keeps
    recompiling until torch's recompile limit, and so do int paths, which compile as if/else."""
    torch.manual_seed(0)

    class Supernet(nn.Module):
        def __init__(self, masked):
            super().__init__()
            self.masked = masked
            make = mb.MaskedBranch if masked else nn.ModuleList
            self.layers = nn.ModuleList(make([nn.Linear(D, D) for _ in range(N)]) for _ in range(3))

        def forward(self, x, path):
            for layer, k in zip(self.layers, path):
                x = torch.relu(layer(x, k) if self.masked else layer[k](x))
            return x

    paths = [[random.Random(i).randrange(N) for _ in range(3)] for i in range(20)]
    counts = {}
    flags = torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)
    for form in ("tensor", "int", "if/else"):
        torch.compiler.reset()  # Dynamo's recompile limit counts per code object, across models
        backend = Counting()
        model = Supernet(form != "if/else")
        compiled = torch.compile(model, backend=backend)  # plain compile: the flags a user sets for it
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with flags, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the int paths' warning near the limit
            for path in paths:
                opt.zero_grad()
                compiled(torch.randn(B, D), [torch.tensor(k) for k in path] if form == "tensor" else path).sum().backward()
                opt.step()
        counts[form] = backend.compiled
    assert counts["tensor"] <= 2, counts
    if CHOICES:
        assert counts["int"] == counts["if/else"] > counts["tensor"], counts
    else:  # torch 2.6: the routed rows, data once Dynamo makes the ints dynamic
        assert counts["int"] <= 3, counts


# ----------------------------------------------------------------------------------------------
# Inductor, the library's own guarantees.


@INDUCTOR
def test_inductor_tensor_gate_and_residual():
    torch.manual_seed(0)
    loose = dict(rtol=1e-5, atol=1e-5)
    for module, calls in (
        (mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)]), lambda s: (gates("weights", s),)),
        (mb.ResidualDropPath(mlp(), 0.5).train(), lambda s: ()),
    ):
        torch.compiler.reset()
        twin = copy.deepcopy(module)
        compiled = torch.compile(twin, backend="inductor", fullgraph=True)
        x = torch.randn(B, D)
        for step in range(4):
            want = run(module, x, *calls(step), seed=step, params=list(module.named_parameters()))
            got = run(compiled, x, *calls(step), seed=step, params=list(twin.named_parameters()))
            torch.testing.assert_close(got[0], want[0], **loose)
            assert_same_grads(got[1], want[1], none_is_zero=True, **loose)
        assert not counters["graph_break"]


def test_dynamo_configuration_is_left_alone():
    names = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")
    before = {n: getattr(torch._dynamo.config, n) for n in names}
    module = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)])
    torch.compile(module, backend="aot_eager", fullgraph=True)(torch.randn(B, D), gates("ids", 0))
    assert {n: getattr(torch._dynamo.config, n) for n in names} == before


@pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch 2.6 recompiles the frame that runs a branch once more after the routing's cache is rebuilt "
    "(a guard on the branch input's requires_grad), a cost of one graph, not a wrong result",
)
def test_compiling_elsewhere_does_not_recompile_routed_frames():
    torch.manual_seed(0)
    routed = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)])
    block = mb.ResidualDropPath(nn.Linear(D, D), 0.5).train()
    backend = Counting()
    model = torch.compile(lambda x: block(routed(x, 1)) + routed(x, gates("ids", 0)), backend=backend)
    x = torch.randn(B, D)
    for _ in range(2):
        model(x)
    before = backend.compiled
    torch.compile(nn.Sequential(nn.Linear(D, D), nn.ReLU()), backend="eager")(x)  # elsewhere
    nn.Linear(D, D)  # a registration anywhere
    model(x)
    assert backend.compiled == before


def test_routed_rows_under_cpu_layout_optimization_warn_what_to_set():
    """CPU inductor's layout optimization breaks convolutions on routed rows (a data-dependent row
    count: PyTorch's fake convolution then gives contiguous strides, the real one channels_last),
    and the failure blames a fake kernel. The gather's fake kernel, run while inductor lowers such a
    graph, names the option to set; not for static counts, 3-D rows, nor without the optimization. (End to end: tests/test_timm_compile.py.)"""
    import warnings

    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from maskedbranch import _ops

    class Lowering:  # the one attribute of inductor's graph handler that the check reads
        def __init__(self, layout_opt):
            self.layout_opt = layout_opt

    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        rows = torch.empty(5, dtype=torch.int64)
        images = torch.empty(8, 16, 4, 4)
        tokens = torch.empty(8, 16, 4)
        count = shape_env.create_unbacked_symint()

        def warned(x, counts, layout_opt):
            with V.set_graph_handler(Lowering(layout_opt)), warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                out = _ops._gather_fake(x, rows, None, counts)
            assert out[0].shape[1:] == x.shape[1:]
            return [w for w in seen if issubclass(w.category, _ops.RoutedConvLayoutWarning)]

        got = warned(images, [count], True)
        assert len(got) == 1
        msg = str(got[0].message)
        assert 'options={"layout_optimization": False}' in msg and "expected size ..., stride ..." in msg
        assert not warned(images, [count], False)  # the option set: nothing to say
        assert not warned(images, [5], True)       # a static count: inductor knows the layout
        assert not warned(tokens, [count], True)   # no 2-D convolution on 3-D rows
        from maskedbranch import _compat

        _compat._force_fallback["inductor"] = True  # the check reads a private handler: its fallback
        try:
            assert not warned(images, [count], True)
        finally:
            _compat._force_fallback["inductor"] = False


# ----------------------------------------------------------------------------------------------
# Drop rates that change between calls: the rate is data of the graph, never a constant of it.


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.6 specializes every float a graph reads (specialize_float): "
                    "each rate recompiles, as it would for any module attribute")
def test_drop_rate_schedule_adds_no_graph():
    """A schedule changes every block's rate each step: after the first change Dynamo makes the
    rate symbolic and the same graph serves every later rate (the rate reaches the draw as a
    tensor; as a ``float`` argument of the op it was specialized, one graph per rate)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[mb.ResidualDropPath(mlp(), 0.1 * (i + 1)) for i in range(3)]).train()
    twin = copy.deepcopy(model)

    def calls(step):
        for m in (model, twin):
            for i, block in enumerate(m):
                block.drop_prob = 0.05 * (i + 1) + 0.01 * step
        return ()

    backend = Counting()
    compiled = torch.compile(twin, backend=backend, fullgraph=True)
    x = torch.randn(B, D)
    graphs = []
    for step in range(6):
        calls(step)
        want = run(model, x, seed=step, params=list(model.named_parameters()))
        got = run(compiled, x, seed=step, params=list(twin.named_parameters()))
        torch.testing.assert_close(got[0], want[0], **TIGHT)
        assert_same_grads(got[1], want[1], none_is_zero=True, **TIGHT)
        graphs.append(backend.compiled)
    assert graphs[1] == graphs[-1] <= 2, graphs


@INDUCTOR
@pytest.mark.slow
def test_inductor_draws_with_each_calls_rate():
    """The rate as a frame argument (a function compiled once and called with several rates):
    Dynamo makes it a symbolic float at its second value. Given to the draw as a ``float``, it was
    specialized while tracing and inductor's compile caches served the code of one rate to the
    frames compiled for the others: compiled draws differed from eager's at the same seed."""
    torch.manual_seed(0)
    lin = nn.Linear(D, D)
    x = torch.randn(256, D)

    def step(x, p):
        return mb.drop_add_residual(x, lin, p, True)

    compiled = torch.compile(step, backend="inductor")
    for i, p in enumerate((0.1, 0.2, 0.3, 0.4)):
        torch.manual_seed(i)
        want = step(x, p)
        torch.manual_seed(i)
        got = compiled(x, p)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rate {p}")


# ----------------------------------------------------------------------------------------------
# Whole-batch choices (an int or 0-d gate, "batch" drop paths): only the chosen branch computes,
# in one graph for every choice, and BatchNorm statistics change as with if/else.

COND = torch.__version__ >= "2.13"  # torch.cond trains and carries buffers (maskedbranch/_choice.py)


def conv_bn(tanh=False, channels=3):
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                         nn.Tanh() if tanh else nn.ReLU())


def assert_trains_as_eager(eager, calls, steps=10, fullgraph=True, x=None):
    """Compile a copy of ``eager`` (a Counting backend), run ``calls(step)`` for ``steps`` steps of
    SGD with momentum: outputs, parameters (None gradients included) and every buffer equal
    eager's after each step; no graph break. Returns the backend."""
    backend = Counting()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend=backend, fullgraph=fullgraph)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, twin)]
    x = torch.randn(B, 3, 4, 4) if x is None else x
    for step in range(steps):
        args = calls(step)
        outs = []
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = model(x, *args)
            outs.append(out.detach())
            if out.requires_grad:
                (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            opt.step()
        torch.testing.assert_close(outs[1], outs[0], **TIGHT, msg=f"step {step}")
        for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}, {name}: None in one run only"
            torch.testing.assert_close(q, p, **TIGHT, msg=f"step {step}, {name}")
        for (name, b), c in zip(eager.named_buffers(), twin.buffers()):
            torch.testing.assert_close(c, b, **TIGHT, msg=f"step {step}, buffer {name}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    return backend


def choices(kind, step):
    k = [0, 2, -1, 1, 2, 2, 0, 1, -1, 0][step % 10]
    return (torch.tensor(k),) if kind == "tensor" else (k,)


@pytest.mark.parametrize("same", [True, False], ids=["stacked", "different"])
@pytest.mark.parametrize("kind", ["tensor", "int"])
def test_whole_batch_choice_with_batch_norm_equals_if_else(same, kind):
    """An int or 0-d gate over BatchNorm branches: the chosen branch's running statistics move,
    the others' stay (a zero-weighted padded row once updated every branch's, each step). A 0-d
    tensor: one graph for every choice, no routed rows where only the chosen branch runs
    (branches of one structure are stacked; others take a torch.cond each, torch >= 2.13). An
    int: the chosen branch inlined, as many graphs as if/else makes."""
    torch.manual_seed(0)
    module = mb.MaskedBranch([conv_bn(tanh=not same and i % 2) for i in range(N)])
    backend = assert_trains_as_eager(module, lambda s: choices(kind, s))
    if kind == "int" and not CHOICES:
        assert backend.compiled <= 2, backend.compiled  # torch 2.6: the routed rows
        return
    if kind == "int":
        want = ifelse_graphs(list(module), [choices(kind, s)[0] for s in range(10)], x=torch.randn(B, 3, 4, 4))
        assert backend.compiled == want, (backend.compiled, want)
        assert not backend.has("maskedbranch.") and not backend.has("cond")
        return
    assert backend.compiled == 1, backend.compiled
    if (same and CHOICES) or COND:
        assert not backend.has("maskedbranch.plan"), "the routed rows ran"
        assert backend.has("cond") == (not same)


@pytest.mark.skipif(not CHOICES, reason="torch 2.6: no whole-batch choices (the routed rows)")
def test_int_gate_selects_nothing_on_the_output():
    """Stacked branches under an int gate >= 0 (a supernet path): the branch's output is the
    layer's, with no select for -1 (which makes inductor save a mask per activation); a 0-d
    tensor gate, which may hold -1, keeps the select."""
    def table():
        torch.manual_seed(0)
        return mb.MaskedBranch([nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(N)])

    x = torch.randn(B, D)
    ints = assert_trains_as_eager(table(), lambda s: ([0, 2, 1, 2, 0][s % 5],), x=x, steps=5)
    assert ints.compiled == ifelse_graphs(list(table()), [0, 2, 1, 2, 0], x=x) and not ints.has("where"), ints.code
    tensors = assert_trains_as_eager(table(), lambda s: (torch.tensor([0, 2, -1][s % 3]),), x=x, steps=3)
    assert tensors.compiled == 1 and tensors.has("where")


def test_whole_batch_choice_of_identity_and_views():
    """A branch that returns its input, or a view of it, inside torch.cond (which refuses outputs
    that alias its inputs): given a copy."""
    torch.manual_seed(0)
    module = mb.MaskedBranch([nn.Identity(), nn.Flatten(0, 0), nn.Sequential(nn.Linear(D, D), nn.ReLU())])
    assert_trains_as_eager(module, lambda s: choices("tensor", s), x=torch.randn(B, D), steps=6)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_batch_drop_path_with_batch_norm_equals_eager(fullgraph):
    """mode="batch" drop paths around BatchNorm branches, under plain torch.compile as well: the
    branch runs or not (torch.cond, torch >= 2.13), its statistics move only when it ran, one
    graph, no break."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[mb.ResidualDropPath(conv_bn(), 0.5, mode="batch", materialize_grads=None)
                                          for _ in range(3)])

        def forward(self, x):
            return self.blocks(x)

    with torch._dynamo.config.patch(capture_scalar_outputs=not COND, capture_dynamic_output_shape_ops=not COND):
        backend = assert_trains_as_eager(Net().train(), lambda s: (), fullgraph=fullgraph)
    assert backend.compiled == 1
    if COND:
        assert backend.has("cond") and not backend.has("maskedbranch.plan")


def test_which_tables_are_stacked():
    """Stacked only when every branch runs the same code on tensors of the same kinds: the same
    class, plain attributes, parameters and buffers (names, shapes, dtypes), in every submodule,
    and no tensor shared between branches; anything else held by a module counts by identity."""
    import functools

    from maskedbranch import _choice

    class Act(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)

    lin = nn.Linear(D, D)
    assert _choice.stackable([conv_bn(), conv_bn(), conv_bn()])
    assert not _choice.stackable([conv_bn(), conv_bn(tanh=True)])  # another class inside
    assert not _choice.stackable([nn.Conv2d(3, 3, 3), nn.Conv2d(3, 3, 3, stride=2)])  # an attribute
    assert not _choice.stackable([nn.Linear(D, D), nn.Linear(D, D, bias=False)])  # a parameter
    assert not _choice.stackable([nn.Linear(D, D), nn.Linear(D, D).double()])  # a dtype
    assert not _choice.stackable([lin, lin])  # shared
    assert _choice.stackable([Act(torch.relu), Act(torch.relu)])
    assert not _choice.stackable([Act(torch.relu), Act(torch.tanh)])
    assert not _choice.stackable([Act(functools.partial(torch.relu)), Act(functools.partial(torch.relu))])
    hooked = nn.Linear(D, D)
    hooked.register_forward_hook(lambda *a: None)
    assert not _choice.stackable([hooked, nn.Linear(D, D)])


def test_whole_batch_choice_of_a_bad_id_fails():
    module = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)])
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="index|out of range|bounds"):
        compiled(torch.randn(B, D), torch.tensor(N))


# ----------------------------------------------------------------------------------------------
# Per-row gates: a branch that got no row runs on one zero-weighted row, and its buffers are left
# as they were.


def test_per_row_gates_leave_dead_branches_statistics_alone():
    torch.manual_seed(0)
    module = mb.MaskedBranch([conv_bn() for _ in range(N)])

    def calls(step):
        ids = torch.randint(0, N - 1, (B,), generator=torch.Generator().manual_seed(step))  # branch 2: never
        return (torch.zeros(B, dtype=torch.int64) if step % 3 == 0 else ids,)  # branch 1 dead too, at times

    backend = assert_trains_as_eager(module, calls, steps=9)
    assert backend.compiled == 1
    assert int(module[2][1].num_batches_tracked) == 0


def test_a_branch_named_like_the_residual_wrapper_is_run_as_itself():
    """The residual forms' wrapper is told from a user's branch by its class: a branch with
    attributes named like the wrapper's (``is_module``, ``branch``) still runs whole, with its
    statistics carried (left alone where it got no row)."""
    torch.manual_seed(0)
    branches = []
    for _ in range(N):
        m = conv_bn()
        m.is_module = False
        m.branch = nn.Identity()  # a submodule: the Sequential runs it last
        branches.append(m)
    module = mb.MaskedBranch(branches)

    def calls(step):
        return (torch.randint(0, N - 1, (B,), generator=torch.Generator().manual_seed(step)),)  # branch 2: never

    backend = assert_trains_as_eager(module, calls, steps=4)
    assert backend.compiled == 1
    assert int(module[2][1].num_batches_tracked) == 0


# ----------------------------------------------------------------------------------------------
# Plain torch.compile with Dynamo's default configuration: the drop paths add no graph break.

NO_FLAGS = dict(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_drop_paths_under_plain_compile_add_no_graph_break(mode):
    """Without the capture flags the row counts cannot enter a graph: the drop paths compute
    timm's dense formula with the same draw ("batch" mode: a torch.cond where torch >= 2.13),
    equal to eager mode at the same seed, in one graph, and say once which flags would skip the
    dropped rows' compute."""
    import warnings

    from maskedbranch import _warn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = mb.ResidualDropPath(mlp(), 0.3, mode=mode, materialize_grads=None)
            self.f = mlp()

        def forward(self, x):
            return mb.drop_add_residual(self.a(x), self.f, 0.5, self.training, mode=mode)

    _warn.given.discard("dense drop path")
    with torch._dynamo.config.patch(**NO_FLAGS), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # once anyway: two drop paths, traced more than once
        graphs = assert_steps(Block().train(), lambda s: (), fullgraph=False)
    assert graphs[-1] == 1, graphs
    said = [str(w.message) for w in seen if "capture_scalar_outputs" in str(w.message)]
    assert len(said) == (0 if mode == "batch" and COND else 1), said  # a cond skips for real
    assert all("capture_dynamic_output_shape_ops" in m for m in said)


def test_drop_paths_dense_form_through_the_fallback():
    """The trace's own answer on capturing is read from a private shape environment; its
    fallback reads the two flags, so under fullgraph without them the dense form runs: the same
    results and one graph."""
    from maskedbranch import _compat

    torch.manual_seed(0)
    _compat._force_fallback["capture"] = True
    try:
        with torch._dynamo.config.patch(**NO_FLAGS):
            graphs = assert_steps(mb.ResidualDropPath(mlp(), 0.5).train(), lambda s: ())
    finally:
        _compat._force_fallback["capture"] = False
    assert graphs[-1] == 1, graphs


def test_view_check_and_its_fallback():
    from maskedbranch import _compat, _signatures

    x = torch.empty(4, 3, device="meta")
    assert _compat.is_view_of(x, x) and _compat.is_view_of(x.view(12), x) and _compat.is_view_of(x[1:], x[:2])
    assert not _compat.is_view_of(x.clone(), x)
    branches = [nn.Identity(), nn.Linear(3, 3)]
    assert _signatures.signature_of(branches, (3,), torch.float32) == ((3,), torch.float32, (True, False))
    _compat._force_fallback["views"] = True
    try:  # without the check every branch's output is copied
        assert _signatures.signature_of(branches, (3,), torch.float32)[2] == (True, True)
    finally:
        _compat._force_fallback["views"] = False


@INDUCTOR
@pytest.mark.slow
def test_inductor_whole_batch_choices_of_convolutions():
    """Stacked choices and one torch.cond per choice (conv + BatchNorm), and a "batch" drop path
    around one, through inductor with its CPU layout optimization on (24 channels: enough for
    inductor to make the convolutions channels_last, which a cond's subgraph input once failed):
    static shapes, so no option is needed; outputs and statistics equal eager mode's."""
    torch.manual_seed(0)
    C = 24

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, C, 3, padding=1)
            self.same = mb.MaskedBranch([conv_bn(channels=C) for _ in range(N)])
            self.different = mb.MaskedBranch([conv_bn(tanh=i % 2, channels=C) for i in range(N)])
            self.drop = mb.ResidualDropPath(conv_bn(channels=C), 0.5, mode="batch")

        def forward(self, x, a, b):
            return self.drop(self.same(self.different(self.stem(x), b), a))  # a cond's input: a convolution's output

    eager = Net().train().double()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin)
    x = torch.randn(16, 3, 16, 16, dtype=torch.float64)
    loose = dict(rtol=1e-4, atol=1e-5)
    for step in range(4):
        args = (torch.tensor(step % N), torch.tensor((step + 1) % N))
        want = run(eager, x, *args, seed=step, params=list(eager.named_parameters()))
        got = run(compiled, x, *args, seed=step, params=list(twin.named_parameters()))
        torch.testing.assert_close(got[0], want[0], **loose)
        assert_same_grads(got[1], want[1], none_is_zero=True, **loose)
    for (name, b), c in zip(eager.named_buffers(), twin.buffers()):
        torch.testing.assert_close(c, b, **loose, msg=name)
    assert not counters["graph_break"]
