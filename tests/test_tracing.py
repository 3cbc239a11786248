"""Graphs of DropPath, ResidualDropPath and MaskedBranch next to timm's and torchvision's
modules doing the same: torch.fx symbolic tracing in eval and train (the dense formula where
the routing is data-dependent), torchvision's feature extraction on a torchvision model whose
StochasticDepth modules are maskedbranch.DropPath, torch.jit.script, and torch.export in eval."""
import copy
import math
import warnings

import pytest
import torch
from torch import nn

import maskedbranch as mb
from maskedbranch import reference

timm_layers = pytest.importorskip("timm.layers")
tv_ops = pytest.importorskip("torchvision.ops")
tv_models = pytest.importorskip("torchvision.models")
feature_extraction = pytest.importorskip("torchvision.models.feature_extraction")

B, D, N = 12, 6, 3


def ours_and_theirs(p, mode):
    """maskedbranch's DropPath and the peer module with the same semantics."""
    theirs = timm_layers.DropPath(p) if mode == "row" else tv_ops.StochasticDepth(p, "batch")
    return mb.DropPath(p, mode=mode), theirs


def branch(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


def run(fn, x, seed):
    """Output and input gradient of ``fn(x)`` with the default generator at ``seed``."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad


def assert_same_runs(a, b, x, seeds=range(4)):
    for seed in seeds:
        for u, v in zip(run(a, x, seed), run(b, x, seed)):
            assert torch.equal(u, v), seed


def scripted(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated in newer torch
        return torch.jit.script(module)


# ----------------------------------------------------------------------------------------------
# torch.fx


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_fx_drop_path_like_peers(mode, training):
    ours, theirs = ours_and_theirs(0.4, mode)
    gm, ref = (torch.fx.symbolic_trace(nn.Sequential(m).train(training)) for m in (ours, theirs))
    gm.graph.eliminate_dead_code()  # as feature extractors do: the graph must not depend on dead ops
    gm.recompile()
    x = torch.randn(B, 3, D)
    assert_same_runs(gm, ref, x)
    assert_same_runs(gm, nn.Sequential(ours).train(training), x)
    if not training:  # the identity: no op recorded, as for timm's
        assert [n.op for n in gm.graph.nodes] == ["placeholder", "output"]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_fx_residual_drop_path_is_the_dense_formula(mode, training):
    f = branch()
    _, theirs = ours_and_theirs(0.5, mode)
    block = mb.ResidualDropPath(f, 0.5, mode=mode).train(training)
    gm = torch.fx.symbolic_trace(nn.Sequential(block))  # (a root's *args would be one Proxy)
    theirs.train(training)
    x = torch.randn(B, D)
    assert_same_runs(gm, lambda t: t + theirs(f(t)), x)


class Routed(nn.Module):
    def __init__(self, functional=False):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(D, D)
        self.choices = mb.MaskedBranch([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(N)])
        self.functional = functional

    def forward(self, x, gate):
        h = self.pre(x)
        return mb.masked_branch(list(self.choices), h, gate) if self.functional else self.choices(h, gate)


def gates():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, N, generator=g) < 0.5
    mask[:, 2] = False  # a branch no row reaches
    return {
        "ids": torch.tensor([0, 1, -1, 0, 2, 1, 1, 0, -1, 2, 0, 1]),
        "mask": mask,
        "weights": torch.rand(B, N, generator=g) * mask,
        "none": torch.full((B,), -1),
    }


@pytest.mark.parametrize("functional", [False, True], ids=["module", "function"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_fx_masked_branch_records_the_dense_formula(training, functional):
    model = Routed(functional).train(training)
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(B, D)
    for kind, gate in gates().items():  # one graph, any gate when it runs
        got = gm(x, gate)
        torch.testing.assert_close(got, model(x, gate), msg=kind)
        want = reference.masked_branch_dense(list(model.choices), model.pre(x), gate)
        torch.testing.assert_close(got, want, msg=kind)
    # the graph's gradients are the dense formula's: those of x and of the parameters equal the
    # routed ones (a zero coefficient contributes zero)
    ids = gates()["ids"]
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    gm(xa, ids).square().sum().backward()
    want = {k: p.grad.clone() for k, p in gm.named_parameters()}  # gm holds model's parameters
    model.zero_grad(set_to_none=True)
    model(xb, ids).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    for k, p in model.named_parameters():
        torch.testing.assert_close(torch.zeros_like(p) if p.grad is None else p.grad, want[k], msg=k)
    with pytest.raises(IndexError, match="gate"):  # the gate is checked when the graph runs
        gm(x, torch.full((B,), N))


def test_fx_masked_branch_constant_int_gate_records_one_branch():
    model = Routed()
    x = torch.randn(B, D)
    for k in (1, -1):
        gm = torch.fx.symbolic_trace(model, concrete_args={"gate": k})
        called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
        torch.testing.assert_close(gm(x, k), model(x, k))
        branches = [1] if k == 1 else range(N)  # -1: the dense formula with zero coefficients
        assert called == {"pre"} | {f"choices.{i}.{j}" for i in branches for j in range(2)}


def efficientnet_pair():
    """torchvision's efficientnet_b0 and a copy whose StochasticDepth modules are maskedbranch's."""
    torch.manual_seed(0)
    theirs = tv_models.efficientnet_b0(weights=None)
    ours = copy.deepcopy(theirs)
    replaced = 0
    for module in ours.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, tv_ops.StochasticDepth):
                setattr(module, name, mb.DropPath(child.p, mode=child.mode))
                replaced += 1
    assert replaced > 10
    return ours, theirs


def test_torchvision_feature_extraction():
    ours, theirs = efficientnet_pair()
    tr, ev = feature_extraction.get_graph_node_names(ours)
    tr_tv, ev_tv = feature_extraction.get_graph_node_names(theirs)
    # DropPath is one node, as torchvision's StochasticDepth is, with no tracer settings
    assert (tr, ev) == (tr_tv, ev_tv)
    leaf = {"leaf_modules": [mb.DropPath]}
    assert feature_extraction.get_graph_node_names(ours, tracer_kwargs=leaf) == (tr_tv, ev_tv)
    depth = [n for n in tr_tv if n.endswith("stochastic_depth")][-1]
    x = torch.randn(2, 3, 64, 64)
    for training in (False, True):
        ours.train(training)
        theirs.train(training)
        want = run_extractor(theirs, {"features.3": "f3", depth: "sd", "classifier": "out"}, x)
        got = run_extractor(ours, {"features.3": "f3", depth: "sd", "classifier": "out"}, x, leaf)
        got_plain = run_extractor(ours, {"features.3": "f3", "classifier": "out"}, x)
        for k in want:
            assert torch.equal(got[k], want[k]), (training, k)
        for k in got_plain:
            assert torch.equal(got_plain[k], want[k]), (training, k)


def run_extractor(model, nodes, x, tracer_kwargs=None):
    fe = feature_extraction.create_feature_extractor(model, nodes, tracer_kwargs=tracer_kwargs)
    torch.manual_seed(1)
    return fe(x)


# ----------------------------------------------------------------------------------------------
# TorchScript


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_script_drop_path_like_peers(mode):
    ours, theirs = ours_and_theirs(0.25, mode)
    model = nn.Sequential(nn.Linear(D, D), ours)
    s_ours = scripted(model)
    s_theirs = scripted(nn.Sequential(model[0], theirs))
    assert model[1] is ours  # the Python model keeps its module (timm's does too)
    x = torch.randn(B, 3, D)
    for training in (False, True):
        for m in (s_ours, s_theirs, model):
            m.train(training)
        assert_same_runs(s_ours, s_theirs, x)
        assert_same_runs(s_ours, model, x)


def test_script_drop_path_statistics_and_arguments_as_given():
    import numpy as np

    s = scripted(mb.DropPath(np.float32(0.25)).train())  # timm's refuses a numpy scalar here
    x = torch.ones(4000, 2)
    torch.manual_seed(0)
    kept = (s(x)[:, 0] != 0).double().mean().item()
    assert abs(kept - 0.75) <= 5 * math.sqrt(0.75 * 0.25 / 4000)
    assert set(s(x).unique().tolist()) == {0.0, torch.tensor(1 / 0.75).item()}
    assert torch.equal(scripted(mb.DropPath(1)).train()(x), torch.zeros_like(x))  # an int, as timm keeps it
    assert torch.equal(scripted(mb.DropPath(0.5)).eval()(x), x)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_script_residual_drop_path_is_the_dense_formula(mode):
    f = branch()
    _, theirs = ours_and_theirs(0.5, mode)
    s = scripted(copy.deepcopy(mb.ResidualDropPath(f, 0.5, mode=mode)))
    x = torch.randn(B, D)
    for training in (False, True):
        s.train(training)
        theirs.train(training)
        assert_same_runs(s, lambda t: t + theirs(f(t)), x)
    # statistics of the scripted module itself: the fraction of rows (or calls) whose branch ran
    s.train()
    xs, ran = torch.randn(400, D), []
    for seed in range(25):
        torch.manual_seed(seed)
        ran.append((s(xs) != xs).any(1).double())
    frac = torch.cat(ran).mean().item()
    n = 25 * (400 if mode == "row" else 1)
    assert abs(frac - 0.5) <= 5 * math.sqrt(0.25 / n)


def test_script_masked_branch_says_what_to_do():
    model = Routed()
    with pytest.raises(RuntimeError, match=r"MaskedBranch: torch\.jit\.script cannot compile it.*torch\.export\.export"):
        scripted(model)
    x = torch.randn(B, D)
    torch.testing.assert_close(model(x, 1), model.choices[1](model.pre(x)))  # still works


# ----------------------------------------------------------------------------------------------
# torch.export (eval)


class Net(nn.Module):
    """A stem, a routed layer, a residual block with stochastic depth and a DropPath: built
    with maskedbranch's modules, or with timm's / torchvision's and an if/else."""

    def __init__(self, peers=False):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(D, D)
        choices = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(N)]
        self.choices = nn.ModuleList(choices) if peers else mb.MaskedBranch(choices)
        self.f = branch(1)
        self.res = None if peers else mb.ResidualDropPath(self.f, 0.3)
        self.sd = tv_ops.StochasticDepth(0.3, "batch") if peers else mb.DropPath(0.3, mode="batch")
        self.dp = timm_layers.DropPath(0.2) if peers else mb.DropPath(0.2)
        self.peers = peers

    def forward(self, x, gate):
        h = self.pre(x)
        if self.peers:
            h = reference.masked_branch_ifelse(list(self.choices), h, gate) if not isinstance(gate, int) else self.choices[gate](h)
            h = h + self.sd(self.f(h))
        else:
            h = self.sd(self.res(self.choices(h, gate)))
        return self.dp(h)


TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_export_eval_int_gate_like_peers(strict):
    ours, peers = Net().eval(), Net(peers=True).eval()
    x = torch.randn(B, D)
    ep = torch.export.export(ours, (x, 1), strict=strict)
    ep_peers = torch.export.export(peers, (x, 1), strict=strict)
    torch.testing.assert_close(ep.module()(x, 1), ours(x, 1))
    torch.testing.assert_close(ep.module()(x, 1), ep_peers.module()(x, 1))


@pytest.mark.skipif(TORCH < (2, 14), reason="torch 2.6's fake tensors cannot size the routed rows (checked on 2.6 and 2.14)")
@pytest.mark.parametrize("gate_kind", ["ids", "mask", "weights"])
def test_export_eval_tensor_gate_like_peers(gate_kind):
    ours, peers = Net().eval(), Net(peers=True).eval()
    x = torch.randn(B, D)
    example = gates()[gate_kind]
    ep = torch.export.export(ours, (x, example), strict=False)
    g = torch.Generator().manual_seed(3)
    runs = [
        example,
        gates()["none"] if gate_kind == "ids" else torch.zeros_like(example),  # no row anywhere
        gates()["ids"].roll(5) if gate_kind == "ids" else (torch.rand(B, N, generator=g) > 0.3).to(example.dtype),
    ]
    for k, gate in enumerate(runs):  # one graph routes every gate, whatever the counts
        got = ep.module()(x, gate)
        torch.testing.assert_close(got, ours(x, gate))
        if k != 1:  # (the if/else model has no output when no row reaches a branch)
            torch.testing.assert_close(got, peers(x, gate))
