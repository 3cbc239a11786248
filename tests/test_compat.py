"""maskedbranch/_compat.py: the private-API feature checks and their public fallbacks.

* functorch_active: with the private check available, eager mode runs the classic autograd
  Functions and torch.func transforms the setup_context form; with the check reported missing
  (as on a torch without it), every call takes the setup_context form, and results, gradients and
  torch.func transforms stay the same.
* active_ddp: without DDP's private attribute it reports no module, and the dead-gradient policy
  of a distributed job then falls back to zeros, which every DDP setting accepts (its DDP side is
  tested with real processes in the DDP tests).
* queue_backward_callback, ddp_ignored_names: the callback runs after the backward's gradients;
  the fallback queues nothing, and DDP then keeps the routed parameters in its buckets (trained
  against if/else with real processes: tests/test_ddp_masked_branch.py, "no_queue_callback_fallback").
"""
import contextlib

import pytest
import torch
from torch import nn
from torch.func import functional_call

import maskedbranch as mb
from harness import autograd_node_names, needs_none_grads
from maskedbranch import _compat

B, D, N = 6, 4, 3


@contextlib.contextmanager
def functorch_unknown():
    """The functorch check reports "unknown", as on a torch without the private function."""
    _compat._force_fallback["functorch"] = True
    try:
        yield
    finally:
        _compat._force_fallback["functorch"] = False


def routed_call(module, x, gate):
    """Output, x's gradient and every parameter's gradient (None where undefined)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = module(x, gate)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out, x.grad, [p.grad for p in module.parameters()]


def make_module():
    torch.manual_seed(0)
    return mb.MaskedBranch([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(N)], materialize_grads=True)


GATES = {
    "int": 1,
    "ids": torch.tensor([0, 2, 2, -1, 0, 2]),  # branch 1 dead
    "mask": torch.tensor([[1, 0, 1]] * 3 + [[0, 0, 1]] * 3, dtype=torch.bool),
}


def test_check_answers_and_eager_takes_the_classic_form():
    assert _compat._functorch_check is not None, f"torch {torch.__version__} lacks the functorch check"
    assert _compat.functorch_active() is False
    seen = []
    torch.func.grad(lambda t: (seen.append(_compat.functorch_active()), t.sum())[1])(torch.ones(2))
    assert seen == [True]
    out = make_module()(torch.randn(B, D, requires_grad=True), GATES["ids"])
    assert {"GatherClassicBackward", "CombineClassicBackward"} <= autograd_node_names(out)
    assert not {"GatherBackward", "CombineBackward"} & autograd_node_names(out)


@pytest.mark.parametrize("kind", list(GATES))
def test_fallback_takes_the_transform_form_with_the_same_results(kind):
    module = make_module()
    x = torch.randn(B, D)
    with functorch_unknown():
        assert _compat.functorch_active() is True
        fallback = routed_call(module, x, GATES[kind])
    classic = routed_call(module, x, GATES[kind])
    assert {"int": "TieBackward", "ids": "CombineBackward", "mask": "CombineBackward"}[kind] in autograd_node_names(fallback[0])
    assert not any(name.endswith("ClassicBackward") for name in autograd_node_names(fallback[0]))
    assert any(name.endswith("ClassicBackward") for name in autograd_node_names(classic[0]))
    torch.testing.assert_close(fallback[0], classic[0], rtol=0, atol=0)
    torch.testing.assert_close(fallback[1], classic[1], rtol=0, atol=0)
    for a, b in zip(fallback[2], classic[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fallback_under_torch_func_grad():
    """torch.func.grad through the fallback equals autograd (the transform form either way)."""
    module = make_module()
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = torch.randn(B, D)
    gate = GATES["int"]
    cot = torch.linspace(-1, 1, B * D).reshape(B, D)

    def loss(p, t):
        return (functional_call(module, p, (t, gate)) * cot).sum()

    with functorch_unknown():
        got_p, got_x = torch.func.grad(loss, argnums=(0, 1))(params, x)
    module.zero_grad(set_to_none=True)
    x_ref = x.clone().requires_grad_(True)
    loss(dict(module.named_parameters()), x_ref).backward()
    torch.testing.assert_close(got_x, x_ref.grad)
    for name, p in module.named_parameters():
        torch.testing.assert_close(got_p[name], p.grad, msg=lambda m: f"{name}: {m}")
    assert torch.count_nonzero(got_p["0.0.weight"]) == 0  # a dead branch: zeros (materialize_grads=True)


def test_residual_drop_path_under_fallback():
    torch.manual_seed(0)
    block = mb.ResidualDropPath(nn.Linear(D, D), 0.5, generator=torch.Generator())
    x = torch.randn(16, D)
    runs = []
    for unknown in (True, False):
        block.zero_grad(set_to_none=True)
        block.generator.manual_seed(3)
        xi = x.clone().requires_grad_(True)
        with functorch_unknown() if unknown else contextlib.nullcontext():
            out = block(xi)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        runs.append((autograd_node_names(out), out, xi.grad, [p.grad.clone() for p in block.parameters()]))
    (names_f, *fallback), (names_c, *classic) = runs
    assert "CombineBackward" in names_f and "CombineClassicBackward" in names_c
    for a, b in zip(fallback[:2] + fallback[2], classic[:2] + classic[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_active_ddp_fallback_reports_none(monkeypatch):
    """Without DDP's private attribute no module is reported, also from inside module forwards."""
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(_compat.active_ddp())
            return x

    monkeypatch.setitem(_compat._force_fallback, "ddp", True)
    nn.Sequential(nn.Linear(D, D), Probe())(torch.randn(2, D))
    assert seen == [None] and _compat.active_ddp() is None


@pytest.mark.parametrize("fallback", [False, True], ids=["frames", "fallback"])
def test_wrapper_on_stack(monkeypatch, fallback):
    """The outermost data-parallel module whose forward runs is found from the Python stack (here
    a stand-in registered as FSDP2's module class); the fallback finds none."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(_compat.wrapper_on_stack())
            return x

    monkeypatch.setattr(fsdp, "FSDPModule", Wrapper, raising=False)
    monkeypatch.setitem(_compat._force_fallback, "stack", fallback)
    outer = Wrapper(nn.Sequential(Wrapper(Probe())))
    outer(torch.randn(2, D))
    Probe()(torch.randn(2, D))
    assert seen == ([None, None] if fallback else [outer, None])


@pytest.mark.parametrize("fallback", [False, True], ids=["flag", "fallback"])
def test_compiled_autograd_tracing(monkeypatch, fallback):
    """False in eager backwards and true in a backward that compiled autograd traces, with the
    private flag and with its fallback: a residual layer over a call that reaches no branch
    (materialize_grads=False) gives x the eager gradient under compiled autograd."""
    from torch._dynamo import compiled_autograd as ca

    needs_none_grads()
    monkeypatch.setitem(_compat._force_fallback, "compiled_autograd", fallback)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(_compat.compiled_autograd_tracing())
            return grad

    torch.manual_seed(0)
    routed = mb.MaskedBranch([nn.Linear(D, D) for _ in range(N)], materialize_grads=False)
    grads = []
    for compiled in (False, True):
        torch.compiler.reset()
        x = torch.randn(2, D, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        h = Probe.apply(x)
        out = h + routed(h, -1)
        with ca._enable(torch.compile(backend="eager")) if compiled else contextlib.nullcontext():
            out.sum().backward()
        grads.append(x.grad)
    assert seen == [False, True]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("fallback", [False, True], ids=["config", "fallback"])
def test_recompile_limit(monkeypatch, fallback):
    """Dynamo's limit of graphs per frame, read from its configuration (the name changed in torch
    2.7); the fallback knows none (and the int gates' warning stays silent)."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setitem(_compat._force_fallback, "recompile_limit", fallback)
    with config.patch(**{name: 5}):
        assert _compat.recompile_limit() == (None if fallback else 5)


@pytest.mark.parametrize("fallback", [False, True])
def test_queue_backward_callback(monkeypatch, fallback):
    """The callback runs once the backward has accumulated every gradient; the fallback queues
    nothing and says so (the routed parameters then stay in DDP's buckets)."""
    monkeypatch.setitem(_compat._force_fallback, "callback", fallback)
    w = torch.nn.Parameter(torch.ones(3))
    seen, queued = [], []

    def hook(grad):
        queued.append(_compat.queue_backward_callback(lambda: seen.append(w.grad.clone())))
        return grad

    y = (w * 2).sum()
    y.register_hook(hook)
    y.backward()
    assert queued == [not fallback]
    assert _compat.can_queue_backward_callback() is (not fallback)
    assert [s.tolist() for s in seen] == ([] if fallback else [[2.0, 2.0, 2.0]])
    ddp_like = type("NotDDP", (), {"parameters_to_ignore": {"a"}})()
    assert _compat.ddp_ignored_names(ddp_like) == (None if fallback else {"a"})
    assert _compat.ddp_comm_hooks(ddp_like) == []
