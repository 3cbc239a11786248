"""torch.func transforms and compiled autograd give the gradients of plain autograd.

* ``torch.func.grad`` and ``torch.func.vjp`` (through ``torch.func.functional_call`` for modules)
  of drop_path, DropPath, MaskedBranch (every gate kind, dead branches, a weights gate that
  requires grad) and ResidualDropPath equal ``torch.autograd.grad`` of the same call. Under the
  transforms the routing Functions run in their ``setup_context`` form, in eager mode in the
  classic one (told apart by the autograd node names).
* Compiled autograd (the whole backward captured into one graph and compiled with the eager or
  inductor backend) gives the gradients of eager autograd for MaskedBranch with int / ids / mask /
  weights gates including dead branches (``materialize_grads`` None, True, False: in one process
  the default ties nothing, True and False tie the dead parameters), ResidualDropPath with
  nothing / some / all rows dropped, DropPath and drop_path.

Where a torch release itself cannot do something, the test skips on that release with the
error torch gives, found by a probe that uses plain torch only (no maskedbranch code).
"""

import pytest
import torch
from torch import nn
from torch.func import functional_call

import maskedbranch as mb
from harness import assert_same_grads, autograd_node_names, needs_none_grads

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")

B, D, N = 8, 4, 3
TIGHT = dict(rtol=1e-6, atol=1e-6)


def mlp():
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))


# ----------------------------------------------------------------------------------------------
# What torch itself cannot do, probed with plain torch.


def _probe(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any failure is torch's answer
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


def _readback_under_grad():
    """A tensor made inside a transform read back to the host (what a plan's counts need)."""
    g = torch.tensor([1, 0, 1])
    torch.func.grad(lambda t: (torch.nonzero(g).tolist(), t.sum())[1])(torch.ones(2))


READBACK = _probe(_readback_under_grad)
needs_readback = pytest.mark.skipif(
    bool(READBACK),
    reason=f"torch {torch.__version__} cannot read a tensor made inside a torch.func transform back to "
    f"the host ({READBACK}); routing by a tensor gate and drawing a residual mask need it",
)


# ----------------------------------------------------------------------------------------------
# torch.func


GATES = {
    "int": lambda: 1,
    "int_none": lambda: -1,
    "ids": lambda: torch.tensor([0, 1, 0, -1, 1, 1, 0, -1]),  # branch 2 dead
    "mask": lambda: torch.tensor([[0, 1, 1], [0, 0, 1], [0, 1, 0], [0, 0, 0]] * 2, dtype=torch.bool),  # 0 dead
    "weights": lambda: torch.tensor([[0.5, 0, 1.5], [2.0, 0, 0], [0, 0, 0.25], [1.0, 0, 1.0]] * 2),  # 1 dead
}
TENSOR_GATES = {"ids", "mask", "weights"}


def cotangent(shape):
    return torch.linspace(-1, 1, torch.Size(shape).numel()).reshape(shape)


def autograd_reference(fn, module, inputs):
    """d(<fn(params, *inputs), cotangent>) by torch.autograd.grad: ({name: grad}, [input grads]),
    None where undefined."""
    params = dict(module.named_parameters())
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(params, *leaves)
    names = [k for k, p in params.items() if p.requires_grad]
    if out.requires_grad:
        grads = torch.autograd.grad((out * cotangent(out.shape)).sum(), [params[k] for k in names] + leaves, allow_unused=True)
    else:  # nothing ran and nothing was tied: no graph, as for if/else
        grads = [None] * (len(names) + len(leaves))
    return dict(zip(names, grads[: len(names)])), list(grads[len(names):]), autograd_node_names(out)


def func_grads(op, fn, module, inputs):
    """The same gradients through torch.func.grad or torch.func.vjp, and the autograd node names
    seen inside the transform."""
    params = {k: v.detach() for k, v in module.named_parameters()}
    names = []

    def traced(p, *xs):
        out = fn(p, *xs)
        names.append(autograd_node_names(out) if out.grad_fn is not None else set())
        return out

    if op == "grad":
        shape = fn(params, *inputs).shape
        loss = lambda p, *xs: (traced(p, *xs) * cotangent(shape)).sum()  # noqa: E731
        gp, *gx = torch.func.grad(loss, argnums=tuple(range(len(inputs) + 1)))(params, *inputs)
    else:
        out, pull = torch.func.vjp(traced, params, *inputs)
        gp, *gx = pull(cotangent(out.shape))
    return gp, gx, names[-1]


def assert_func_equals_autograd(op, fn, module, inputs, routed: bool):
    want_p, want_x, eager_names = autograd_reference(fn, module, inputs)
    got_p, got_x, func_names = func_grads(op, fn, module, inputs)
    assert_same_grads({k: got_p[k] for k in want_p}, want_p, none_is_zero=True, **TIGHT)
    assert_same_grads(dict(enumerate(got_x)), dict(enumerate(want_x)), none_is_zero=True, **TIGHT)
    if routed:  # a routing Function ran: classic in eager mode, setup_context form under torch.func
        assert any(n.endswith("ClassicBackward") for n in eager_names), eager_names
        assert not any(n.endswith("ClassicBackward") for n in func_names), func_names
        assert any(n.startswith(("Combine", "Tie", "Gather")) for n in func_names), func_names


@pytest.mark.parametrize("op", ["grad", "vjp"])
@pytest.mark.parametrize("materialize", [None, True, False])
@pytest.mark.parametrize("kind", list(GATES))
def test_func_masked_branch(kind, materialize, op):
    if kind in TENSOR_GATES and READBACK:
        pytest.skip(needs_readback.kwargs["reason"])
    torch.manual_seed(0)
    module = mb.MaskedBranch([mlp() for _ in range(N)], materialize_grads=materialize)
    gate = GATES[kind]()
    x = torch.randn(B, D)
    if kind == "weights":  # the weights are an input that requires grad
        inputs = [x, gate]

        def fn(p, x, w):
            return functional_call(module, p, (x, w))
    else:
        inputs = [x]

        def fn(p, x):
            return functional_call(module, p, (x, gate))

    routed = kind in TENSOR_GATES or materialize is not None
    assert_func_equals_autograd(op, fn, module, inputs, routed)


@needs_readback
@pytest.mark.parametrize("op", ["grad", "vjp"])
@pytest.mark.parametrize("case", ["none_dropped", "some_dropped", "all_dropped", "batch", "all_dropped_tied"])
def test_func_residual_drop_path(case, op):
    drop_prob, mode, materialize = {
        "none_dropped": (1e-9, "row", None),
        "some_dropped": (0.5, "row", None),
        "all_dropped": (1.0, "row", None),
        "batch": (0.5, "batch", None),
        "all_dropped_tied": (1.0, "row", True),
    }[case]
    torch.manual_seed(0)
    block = mb.ResidualDropPath(mlp(), drop_prob, mode=mode, generator=torch.Generator(), materialize_grads=materialize)
    x = torch.randn(B, D)

    def fn(p, x):
        block.generator.manual_seed(5)  # the same mask in every call
        return functional_call(block, p, (x,))

    kept = int(torch.empty(B).bernoulli_(1 - drop_prob, generator=torch.Generator().manual_seed(5)).sum())
    if case == "some_dropped":
        assert 0 < kept < B
    assert_func_equals_autograd(op, fn, block, [x], routed=case == "some_dropped" or materialize is not None)


@pytest.mark.parametrize("op", ["grad", "vjp"])
@pytest.mark.parametrize("form", ["function", "module", "generator"])
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_func_drop_path(mode, form, op):
    lin = nn.Linear(D, D)

    def fn(p, x):
        torch.manual_seed(3)  # the default generator draws the same mask in every call
        y = functional_call(lin, p, (x,))
        if form == "function":
            return x + mb.drop_path(y, 0.5, True, mode=mode)
        if form == "module":
            return x + mb.DropPath(0.5, mode=mode).train()(y)
        return x + mb.drop_path(y, 0.5, True, mode=mode, generator=torch.Generator().manual_seed(4))

    assert_func_equals_autograd(op, fn, lin, [torch.randn(B, D)], routed=False)


def test_cache_after_a_transform_holds_the_module_parameters():
    """A first call under torch.func (functional_call swaps parameters in without registering
    them) leaves later eager calls tying the module's own dead parameters."""
    torch.manual_seed(0)
    module = mb.MaskedBranch([mlp() for _ in range(N)], materialize_grads=True)
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = torch.randn(B, D)
    torch.func.grad(lambda p: functional_call(module, p, (x, 1)).sum())(params)
    module(x, 1).sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{name}: not tied"
        if not name.startswith("1."):
            assert torch.count_nonzero(p.grad) == 0, name


# ----------------------------------------------------------------------------------------------
# Compiled autograd


def compiled_autograd(backend, graphs):
    """Backward passes inside are captured whole by compiled autograd and compiled with
    ``backend``; each captured graph is appended to ``graphs``. torch offers this entry point only
    as the private ``torch._dynamo.compiled_autograd._enable`` (the one torch's compiled-autograd
    tutorial uses for a backward outside torch.compile); the config route is tested below."""
    def compiler(gm):
        graphs.append(gm)
        return torch.compile(gm, backend=backend)

    return torch._dynamo.compiled_autograd._enable(compiler)


class Routed(nn.Module):
    """One residual layer per gate kind, so that one backward covers them all."""

    def __init__(self, materialize):
        super().__init__()
        self.layers = nn.ModuleList(
            mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)], materialize_grads=materialize) for _ in GATES
        )

    def forward(self, x, weights):
        for layer, kind in zip(self.layers, GATES):
            x = x + layer(x, weights if kind == "weights" else GATES[kind]())
        return x


class Residuals(nn.Module):
    """ResidualDropPath with nothing / some / all rows dropped and in batch mode, then DropPath
    and drop_path; the draws are reset by ``reseed``."""

    def __init__(self, materialize):
        super().__init__()
        self.blocks = nn.ModuleList(
            mb.ResidualDropPath(nn.Linear(D, D), p, mode=mode, generator=torch.Generator(), materialize_grads=materialize)
            for p, mode in [(1e-9, "row"), (0.5, "row"), (1.0, "row"), (0.5, "batch")]
        )
        self.lin = nn.Linear(D, D)
        self.drop = mb.DropPath(0.5)

    def reseed(self, seed):
        torch.manual_seed(seed)
        for i, block in enumerate(self.blocks):
            block.generator.manual_seed(seed + i)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        x = x + self.drop(self.lin(x))
        return x + mb.drop_path(self.lin(x), 0.3, True, mode="batch")


def backward_step(model, x, *args, seed=None):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    args = [a.detach().clone().requires_grad_(True) for a in args]
    if seed is not None:
        model.reseed(seed)
    out = model(x, *args)
    (out * cotangent(out.shape)).sum().backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    grads.update({"x": x.grad}, **{f"arg{i}": a.grad for i, a in enumerate(args)})
    return grads


def assert_compiled_autograd_equals_eager(model, x, *args, seed=None, backend="eager", tol=TIGHT):
    want = backward_step(model, x, *args, seed=seed)
    torch.compiler.reset()  # a fresh compiled-autograd cache: the backward is captured here
    graphs = []
    with compiled_autograd(backend, graphs):
        got = backward_step(model, x, *args, seed=seed)
    assert len(graphs) == 1, "compiled autograd did not capture the backward"
    assert_same_grads(got, want, **tol)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("materialize", [None, True, False])
def test_compiled_autograd_masked_branch(materialize):
    if materialize is False:
        needs_none_grads()
    torch.manual_seed(0)
    model = Routed(materialize)
    weights = GATES["weights"]()
    got = assert_compiled_autograd_equals_eager(model, torch.randn(B, D), weights)
    dead = {"int": [0, 2], "int_none": [0, 1, 2], "ids": [2], "mask": [0], "weights": [1]}
    for layer, kind in enumerate(GATES):
        for i in dead[kind]:
            g = got[f"layers.{layer}.{i}.weight"]
            if materialize:
                assert g is not None and torch.count_nonzero(g) == 0, (kind, i)
            else:
                assert g is None, (kind, i)
    assert torch.count_nonzero(got["arg0"][:, 1]) == 0  # the dead column of the weights gate


@pytest.mark.slow
@pytest.mark.parametrize("materialize", [None, True, False])
def test_compiled_autograd_residual_drop_path(materialize):
    if materialize is False:
        needs_none_grads()
    torch.manual_seed(0)
    model = Residuals(materialize)
    kept = int(torch.empty(B).bernoulli_(0.5, generator=torch.Generator().manual_seed(7 + 1)).sum())
    assert 0 < kept < B  # block 1 drops some rows
    got = assert_compiled_autograd_equals_eager(model, torch.randn(B, D), seed=7)
    dead = got["blocks.2.branch.weight"]  # block 2 drops every row
    assert (dead is not None and torch.count_nonzero(dead) == 0) if materialize else dead is None


@pytest.mark.slow
def test_compiled_autograd_inductor():
    """One small case through inductor (C++ kernels on a CPU: slow to build): a routed layer
    with a dead branch and a fully dropped residual, dead parameters tied with zeros."""
    torch.manual_seed(0)

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.route = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)], materialize_grads=True)
            self.block = mb.ResidualDropPath(nn.Linear(D, D), 1.0, materialize_grads=True)

        def forward(self, x):
            return self.block(self.route(x, GATES["ids"]()))

    got = assert_compiled_autograd_equals_eager(Small(), torch.randn(B, D), backend="inductor", tol=dict(rtol=1e-5, atol=1e-5))
    assert torch.count_nonzero(got["route.2.weight"]) == 0 and torch.count_nonzero(got["block.branch.weight"]) == 0


@pytest.mark.slow
def test_compiled_autograd_config_route():
    """torch._dynamo.config.compiled_autograd with a compiled training step (forward and
    backward in one torch.compile call), the route torch documents for compiled autograd.
    Whether the backward was captured is read from Dynamo's counters (test-only introspection)."""
    torch.manual_seed(0)
    model = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)], materialize_grads=True)
    weights = GATES["weights"]()  # branch 1 dead
    x = torch.randn(B, D)
    want = backward_step(model, x, weights)

    def step(x, weights):
        out = model(x, weights)
        (out * cotangent(out.shape)).sum().backward()

    def captures():
        return torch._dynamo.utils.counters["compiled_autograd"]["captures"]

    torch.compiler.reset()
    before = captures()
    model.zero_grad(set_to_none=True)
    x, weights = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend="eager")(x, weights)
    assert captures() > before, "compiled autograd did not capture the backward"
    got = {k: p.grad for k, p in model.named_parameters()}
    got.update(x=x.grad, arg0=weights.grad)
    assert_same_grads(got, want, **TIGHT)
