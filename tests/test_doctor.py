"""maskedbranch.doctor, the library: what breaks DDP, grouped by module, and what routing did
(the command line: tests/test_doctor_cli.py)."""
import dataclasses
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import maskedbranch
from maskedbranch import _functional, doctor
from maskedbranch.doctor import Inputs, find_divergent_parameters, find_unused_parameters

import doctor_fixtures as fx
from harness import leave_job, run_ranks


def reference_inputs():
    return [(torch.ones(r + 1, 1),) for r in range(4)]


def half_square(out):
    return (0.5 * out**2).sum()


def states(report):
    return {p.name: "".join(p.ranks) for p in report.parameters}


def flat(report):
    """The report's text with wrapped paragraphs joined (table rows are not wrapped)."""
    return " ".join(str(report).split())


def groups(report):
    return [(g.module, len(g.parameters), g.ranks, g.finding) for g in report.groups if g.finding != "ok"]


def choice_inputs(choices):
    return [Inputs(torch.randn(2, 4), choice=c) for c in choices]


# ----------------------------------------------------------------------------------------------
# Library


def test_reference_if_else_is_divergent():
    report = find_divergent_parameters(fx.IfElse(), reference_inputs(), loss_fn=half_square)
    assert report.divergent == ["layer1.weight", "layer2.weight"]
    assert report.unused == [] and report.not_sampled == []
    assert not report.safe and report.breaks_ddp and report.exit_code == 1
    by_name = {p.name: p for p in report.parameters}
    assert by_name["layer1.weight"].used_on == [1, 3]  # odd ranks feed an even batch
    assert by_name["layer2.weight"].used_on == [0, 2]
    assert states(report) == {"layer1.weight": "-+-+", "layer2.weight": "+-+-"}
    assert groups(report) == [("layer1", 1, "-+-+", "divergent"), ("layer2", 1, "+-+-", "divergent")]
    text = flat(report)
    assert "DIVERGENT: not in the graph on ranks 0, 2" in text
    assert "NOT safe for DDP with find_unused_parameters=False: 2 parameters in 2 modules" in text
    assert "MaskedBranch" in text and "find_unused_parameters=True" in text


def test_single_input_lists_the_branch_not_taken():
    report = find_unused_parameters(fx.IfElse(), torch.ones(2, 1))
    assert report.num_ranks == 1
    assert report.unused == ["layer2.weight"] and report.divergent == []
    assert "UNUSED" in str(report) and not report.safe


def test_unused_parameters_are_grouped_by_module():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.extra = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # never called
            self.scale = nn.Parameter(torch.ones(4))  # the root's own parameters: a group each
            self.unused_scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.body(x) * self.scale

    report = find_divergent_parameters(M(), [(torch.randn(r + 1, 4),) for r in range(3)])
    assert report.unused == ["unused_scale", "extra.0.weight", "extra.0.bias", "extra.2.weight", "extra.2.bias"]
    assert groups(report) == [("unused_scale", 1, "---", "unused"), ("extra", 4, "---", "unused")]
    assert [g.module for g in report.groups if g.finding == "ok"] == ["scale", "body"]
    text = str(report)
    assert "  extra         4       ---    UNUSED on every rank" in text
    assert "extra.0.weight" not in text  # one row per module, not per parameter
    assert "requires_grad_(False)" in text
    assert "body" not in text and "body" in report.format(show_all=True)


def test_model_using_everything_is_safe():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)  # frozen: DDP ignores it
    report = find_divergent_parameters(model, [(torch.randn(3, 4),)] * 2)
    assert report.safe and report.exit_code == 0
    assert [p.name for p in report.parameters] == ["0.weight", "2.weight", "2.bias"]
    assert report.frozen == ["0.bias"]
    assert [(g.module, len(g.parameters), g.ranks) for g in report.groups] == [("(model)", 3, "++")]
    text = str(report)
    assert "Verdict: safe for DDP with find_unused_parameters=False" in text and "1 frozen" in text


def test_zero_and_anchored_gradients_are_in_the_graph():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.live = nn.Linear(2, 2)
            self.times_zero = nn.Linear(2, 2)
            self.anchored = nn.Linear(2, 2)
            self.materialized = nn.Linear(2, 2)

        def forward(self, x):
            y = self.live(x) + 0 * self.times_zero(x)
            y = maskedbranch.tie(y, list(self.anchored.parameters()))
            return maskedbranch.tie(y, list(self.materialized.parameters()), materialize=True)

    report = find_unused_parameters(M(), torch.randn(3, 2))
    assert report.safe
    got = states(report)
    assert got["live.weight"] == "+" and got["times_zero.weight"] == "0"
    assert got["anchored.weight"] == "~" and got["materialized.weight"] == "0"


def test_model_state_is_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2), nn.Linear(2, 2))
    model.eval()
    model[2].train()  # a per-module flag must survive too
    grad0 = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = grad0
    stats = {k: v.clone() for k, v in model[1].state_dict().items()}
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    inputs = [(torch.randn(5, 4) * 3 + 1,)] * 2
    rng = torch.get_rng_state()

    report = find_divergent_parameters(model, inputs)

    assert report.safe and report.training
    assert model[0].weight.grad is grad0 and torch.equal(grad0, torch.full_like(grad0, 7.0))
    assert model[3].weight.grad is None and model[0].bias.grad is None and model[4].weight.grad is None
    assert [m.training for m in model] == [False, False, True, False, False]
    for k, v in model[1].state_dict().items():
        assert torch.equal(v, stats[k]), k  # running stats and num_batches_tracked restored
    for k, v in model.named_parameters():
        assert torch.equal(v, params[k])
    assert torch.equal(torch.get_rng_state(), rng)


def test_routing_modules_are_left_as_found():
    model = fx.Supernet()
    model(torch.randn(2, 4), 1).sum().backward()  # a training step's record of branch 1
    bits = model.choices._unit.bits
    find_divergent_parameters(model, choice_inputs([0, 2]))
    assert model.choices._unit.bits == bits == 0b10  # what the step-time pruning will read
    assert not model.choices._forward_pre_hooks  # the doctor's call counters are gone
    assert model.choices[0].weight.grad is None


def test_eval_mode_and_training_flag():
    model = fx.RandomLayerDrop()
    report = find_divergent_parameters(model, [(torch.randn(2, 4),)] * 3, train=False)
    assert report.safe and not report.training and "eval mode" in str(report)
    assert model.training  # restored


def test_random_routing_per_rank_is_seeded():
    model = fx.RandomLayerDrop(depth=6)
    inputs = [(torch.randn(2, 4),)] * 4
    first = find_divergent_parameters(model, inputs, seed=1)
    assert states(first) == states(find_divergent_parameters(model, inputs, seed=1))
    assert first.divergent and not first.safe  # with these seeds, the blocks that run differ between ranks


def test_callable_inputs_get_the_rank():
    seen = []

    def make(rank):
        seen.append(rank)
        return torch.ones(rank + 1, 1)

    report = find_divergent_parameters(fx.IfElse(), [make] * 4)
    assert seen == [0, 1, 2, 3]
    assert report.divergent == ["layer1.weight", "layer2.weight"]
    # a callable without arguments, and Inputs with keyword arguments
    report = find_divergent_parameters(fx.IfElse(), [lambda: (torch.ones(2, 1),), Inputs(x=torch.ones(2, 1))])
    assert report.unused == ["layer2.weight"]


def test_structured_outputs_and_detached_heads():
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: dict
        step: int = 0

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(2, 2) for _ in range(4))

        def forward(self, x):
            ids = torch.arange(3)  # integer tensors are skipped
            return Out(self.a(x), {"pair": (self.b(x), ids), "frozen": self.c(x).detach()}), [self.d(x)]

    report = find_unused_parameters(M(), torch.randn(3, 2))
    assert report.unused == ["c.weight", "c.bias"]
    report = find_unused_parameters(M(), torch.randn(3, 2), loss_fn=lambda out: out[0].logits.pow(2).sum())
    assert report.unused == ["b.weight", "b.bias", "c.weight", "c.bias", "d.weight", "d.bias"]


def test_output_without_grad_is_explained():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def forward(self, x):
            with torch.no_grad():
                return self.layer(x)

    report = find_unused_parameters(M(), torch.randn(3, 2))
    assert report.unused == ["layer.weight", "layer.bias"]
    assert "requires grad" in str(report)


def test_tied_parameters_are_reported_once_with_aliases():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    report = find_unused_parameters(Tied(), torch.tensor([1, 2]))
    assert [(p.name, p.aliases) for p in report.parameters] == [("embed.weight", ("head.weight",))]
    assert report.safe and [g.parameters for g in report.groups] == [["embed.weight"]]


def test_forward_that_raises_is_reported():
    report = find_divergent_parameters(fx.Broken(), [(torch.randn(2, 4),)] * 2)
    assert not report.safe and report.exit_code == 3
    assert [(f.rank, f.stage) for f in report.failures] == [(0, "forward"), (1, "forward")]
    text = str(report)
    assert "Ranks 0, 1 failed in the forward: RuntimeError" in text
    assert "a shape bug" in text  # the user's line in the traceback
    assert os.path.join("maskedbranch", "doctor") not in text  # the doctor's own frames are trimmed
    assert "incomplete" in text


def test_some_ranks_fail_the_others_are_judged():
    def make(rank):
        if rank == 1:
            raise ValueError("no data for rank 1")
        return torch.ones(rank + 1, 1)

    report = find_divergent_parameters(fx.IfElse(), [make] * 3)
    assert [(f.rank, f.stage) for f in report.failures] == [(1, "inputs")]
    assert states(report) == {"layer1.weight": "-!-", "layer2.weight": "+!+"}
    assert report.unused == ["layer1.weight"] and report.exit_code == 3
    assert "no data for rank 1" in str(report) and "NOT safe" in str(report)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        find_divergent_parameters(lambda x: x, [(torch.ones(1),)])
    with pytest.raises(TypeError, match="inputs_per_rank"):
        find_divergent_parameters(fx.IfElse(), torch.ones(2, 1))
    with pytest.raises(ValueError, match="at least one"):
        find_divergent_parameters(fx.IfElse(), [])
    with pytest.raises(TypeError, match="loss_fn"):
        find_divergent_parameters(fx.IfElse(), [(torch.ones(2, 1),)], loss_fn=3)
    with pytest.raises(TypeError, match="seed"):
        find_divergent_parameters(fx.IfElse(), [(torch.ones(2, 1),)], seed=1.5)


def test_exported_from_the_package():
    assert maskedbranch.find_unused_parameters is find_unused_parameters
    assert maskedbranch.find_divergent_parameters is find_divergent_parameters
    assert maskedbranch.doctor is doctor and doctor.Inputs is Inputs
    assert {"find_unused_parameters", "find_divergent_parameters"} <= set(maskedbranch.__all__)


# ----------------------------------------------------------------------------------------------
# Routing modules: sampled or not, called or not


def test_if_else_rewritten_with_masked_branch_is_safe():
    report = find_divergent_parameters(fx.MaskedIfElse(), reference_inputs(), loss_fn=half_square)
    assert report.safe, str(report)
    # the branch that did not run is tied in, as under DDP: in the graph, gradient undefined
    assert states(report) == {"layers.0.weight": "~+~+", "layers.1.weight": "+~+~"}
    assert report.not_sampled == [] and "Verdict: safe" in str(report)


def test_layer_drop_with_residual_drop_path_is_safe():
    inputs = [(torch.randn(2, 4),)] * 4
    assert not find_divergent_parameters(fx.RandomLayerDrop(depth=6), inputs, seed=1).safe
    blocks = [maskedbranch.ResidualDropPath(nn.Linear(4, 4), drop_prob=0.5, mode="batch") for _ in range(6)]
    report = find_divergent_parameters(nn.Sequential(*blocks), inputs, seed=1)
    assert report.safe, str(report)
    assert any("0" in p.ranks for p in report.parameters)  # dropped blocks: zero gradients (the default)


def test_unsampled_masked_branch_choices_are_not_unused():
    report = find_divergent_parameters(fx.Supernet(), choice_inputs([0, 2, 0]))
    assert report.safe and report.unused == [] and report.divergent == []
    assert report.not_sampled == ["choices.1.weight", "choices.1.bias", "choices.3.weight", "choices.3.bias"]
    assert groups(report) == [("choices.1", 2, "~~~", "not sampled"), ("choices.3", 2, "~~~", "not sampled")]
    assert [r.ran for r in report.routing] == [[0b1, 0b100, 0b1]]
    text = flat(report)
    assert "not sampled: MaskedBranch choices ran branches 0, 2 of 4 in 3 calls" in text
    assert "Do not delete them; run more ranks (--ranks 16" in text
    assert "requires_grad_(False)" not in text and "remove them" not in text


def test_unused_parameters_outside_routing_are_told_apart():
    report = find_divergent_parameters(fx.Supernet(unused_head=True), choice_inputs([0, 1]))
    assert groups(report) == [
        ("choices.2", 2, "~~", "not sampled"), ("choices.3", 2, "~~", "not sampled"), ("head", 2, "--", "unused"),
    ]
    assert report.unused == ["head.weight", "head.bias"] and not report.safe
    assert "requires_grad_(False)" in str(report)  # the advice for head


def test_plain_routing_choices_are_not_called_unused():
    report = find_divergent_parameters(fx.Supernet(plain=True), choice_inputs([0, 2, 0]))
    assert groups(report) == [
        ("choices.0", 2, "+-+", "divergent"), ("choices.1", 2, "---", "choice not sampled"),
        ("choices.2", 2, "-+-", "divergent"), ("choices.3", 2, "---", "choice not sampled"),
    ]
    assert report.unused == ["choices.1.weight", "choices.1.bias", "choices.3.weight", "choices.3.bias"]
    text = flat(report)
    assert "NOT SAMPLED (plain Python routing): other choices in choices are used on some ranks only" in text
    assert "do not delete them" in text and "requires_grad_(False)" not in text
    # LayerDrop with a Python if: a block that no rank kept is not sampled either, never "unused"
    # a block is kept on neither rank with probability 1/4 (none of 16: 1%), on one only with 1/2
    report = find_divergent_parameters(fx.RandomLayerDrop(depth=16), [(torch.randn(2, 4),)] * 2, seed=0)
    findings = {g.finding for g in report.groups}
    assert {"divergent", "choice not sampled"} <= findings and "unused" not in findings, str(report)


def test_residual_drop_path_not_sampled_with_its_probability():
    report = find_divergent_parameters(fx.ResidualStack(8, drop_prob=0.75), [(torch.randn(3, 4),)] * 2, seed=0)
    assert report.safe, str(report)
    dropped = [r.name for r in report.routing if not any(r.ran)]
    assert dropped  # each block is dropped on both ranks with probability 0.56: all 8 kept is 0.1%
    assert [g.module for g in report.groups if g.finding == "not sampled"] == dropped
    assert f"{dropped[0]} (drop_prob=0.75, mode=batch) dropped it in all 2 calls (probability 0.56)" in flat(report)


def test_masked_branch_that_is_never_called():
    """A routing module never called: DDP leaves its parameters to maskedbranch, they keep no
    gradient, as with find_unused_parameters=True, and DDP is fine (with routed parameters only
    too: the one DDP keeps is tied into every forward); with an explicit materialize_grads DDP
    keeps them, and breaks."""
    model = fx.NotCalled()
    model.activations = maskedbranch.MaskedBranch([nn.Identity(), nn.ReLU()])  # no parameters
    report = find_divergent_parameters(model, [(torch.randn(2, 4),)] * 2)
    assert report.not_called == ["choices", "activations"] and report.safe
    assert "Note: MaskedBranch activations is in the model, but the forward never calls it." in str(report)
    assert groups(report) == [("choices", 4, "--", "NOT CALLED, no gradient (DDP leaves its parameters to maskedbranch)")]
    text = " ".join(str(report).split())
    assert "no gradient (DDP leaves its parameters to maskedbranch): MaskedBranch choices is in the model, but the forward never calls it" in text
    assert "which keep no gradient, as with find_unused_parameters=True" in text
    model.body.weight.requires_grad_(False)  # routed parameters only: DDP keeps the first, tied in every forward
    model.body.bias.requires_grad_(False)
    report = find_divergent_parameters(model, [(torch.randn(2, 4),)] * 2)
    assert report.safe and [g[1:] for g in groups(report)] == [
        (4, "--", "NOT CALLED, no gradient (DDP leaves its parameters to maskedbranch)")]
    model.choices.materialize_grads = "zeros"
    report = find_divergent_parameters(model, [(torch.randn(2, 4),)] * 2)
    assert [g[1:] for g in groups(report)] == [(4, "--", "not called")] and not report.safe
    text = " ".join(str(report).split())
    assert "NOT CALLED: MaskedBranch choices is in the model, but the forward never calls it" in text
    assert "Call each routing module itself" in text and "requires_grad_(False)" not in text
    # a rank that failed before the call says nothing about it
    assert find_divergent_parameters(fx.Supernet(), [(torch.randn(2, 4),)]).not_called == []


def test_masked_branch_whose_branches_are_called_directly():
    report = find_divergent_parameters(fx.Bypassed(), choice_inputs([0, 1]))
    assert report.not_called == ["choices"] and report.divergent == [
        "choices.0.weight", "choices.0.bias", "choices.1.weight", "choices.1.bias"
    ]
    assert "MaskedBranch choices is never called: its branches are called directly" in flat(report)
    # a routing module called on some ranks only
    report = find_divergent_parameters(fx.PartlyCalled(), choice_inputs([0, -1]))
    assert report.not_called == [] and groups(report)[:2] == [
        ("choices.0", 2, "+-", "divergent"), ("choices.1", 2, "~-", "divergent")
    ]
    assert "MaskedBranch choices is called on rank 0 only" in flat(report)


def test_nested_routing_module_in_an_unsampled_branch_is_not_flagged():
    report = find_divergent_parameters(fx.Nested(), [(torch.randn(2, 4),)] * 2)
    assert report.safe and report.not_called == []
    assert groups(report) == [("outer.1", 10, "~~", "not sampled")]
    assert "MaskedBranch outer ran branch 0 of 2 in 2 calls" in flat(report)


# ----------------------------------------------------------------------------------------------
# Every routing form: the module forms, the functional forms, the patched transformers models;
# and experts that plain Python routes, for contrast

EXPERT_STATES = {  # 2 ranks of fx.expert_rows: rank r's rows go to experts r and r + 1
    "router.weight": "++", "experts.0.weight": "+~", "experts.0.bias": "+~", "experts.1.weight": "++",
    "experts.1.bias": "++", "experts.2.weight": "~+", "experts.2.bias": "~+", "experts.3.weight": "~~",
    "experts.3.bias": "~~",
}


def assert_no_removal_advice(report):
    text = flat(report)
    assert "UNUSED" not in text and "requires_grad_(False)" not in text and "remove them" not in text, text


@pytest.mark.parametrize("form", ["functional", "module"])
def test_routed_experts_are_safe_in_every_form(form):
    """masked_branch's module branches are units of no module: the simulated DDP wrapper ties
    the ones that did not run, as the real reducer does, exactly as for MaskedBranch."""
    report = find_divergent_parameters(fx.Experts(form), [fx.expert_rows] * 2)
    assert report.safe and report.exit_code == 0, str(report)
    assert states(report) == EXPERT_STATES
    assert report.not_sampled == ["experts.3.weight", "experts.3.bias"]
    assert groups(report) == [("experts.3", 2, "~~", "not sampled")]
    assert_no_removal_advice(report)
    if form == "functional":
        assert [(r.name, r.type, r.calls, r.ran) for r in report.routing] == [
            ("experts.0", "masked_branch", [1, 1], [1, 0]), ("experts.1", "masked_branch", [1, 1], [1, 1]),
            ("experts.2", "masked_branch", [1, 1], [0, 1]), ("experts.3", "masked_branch", [1, 1], [0, 0])]
        assert "experts.3 2 ~~ not sampled: masked_branch routed no row to it on any rank" in flat(report)
    else:
        assert "not sampled: MaskedBranch experts ran branches 0-2 of 4 in 2 calls" in flat(report)


def test_per_token_expert_router():
    """Tokens [B, T, d] routed per token to their top-2 experts, on 4 ranks: the functional form
    gives the module form's graph on every rank."""
    inputs = [lambda: torch.randn(1, 2, 4)] * 4
    functional = find_divergent_parameters(fx.Experts("functional", k=2), inputs)
    module = find_divergent_parameters(fx.Experts("module", k=2), inputs)
    assert functional.safe and module.safe, str(functional)
    assert states(functional) == states(module)
    assert any("~" in s for s in states(functional).values())  # experts that some rank did not pick
    plain = find_divergent_parameters(fx.Experts("plain", k=2), inputs)
    assert states(plain) == {k: v.replace("~", "-") for k, v in states(functional).items()}
    assert not plain.safe and "experts routed in plain Python" in flat(plain)


def test_functional_drop_add_residual():
    report = find_divergent_parameters(fx.FunctionalResidualStack(6, drop_prob=0.75), [(torch.randn(3, 4),)] * 2, seed=0)
    assert report.safe, str(report)
    assert {r.type for r in report.routing} == {"drop_add_residual"}
    dropped = [r.name for r in report.routing if not any(r.ran)]
    assert dropped  # each block is dropped on both ranks with probability 0.56: all 6 kept is 0.7%
    assert [g.module for g in report.groups if g.finding == "not sampled"] == dropped
    assert f"{dropped[0]} 2 ~~ not sampled: drop_add_residual dropped it on every rank" in flat(report)
    assert_no_removal_advice(report)


def test_routed_branches_are_never_told_remove_or_freeze():
    """One rank, where nothing diverges: a branch the routing did not pick is a routing choice."""
    for model in (fx.Experts("functional"), fx.Experts("module")):
        report = find_unused_parameters(model, fx.expert_rows(0))
        assert report.safe and report.not_sampled == ["experts.2.weight", "experts.2.bias", "experts.3.weight",
                                                      "experts.3.bias"], str(report)
        assert_no_removal_advice(report)
    assert_no_removal_advice(find_unused_parameters(fx.FunctionalResidualStack(4, drop_prob=0.9), torch.randn(2, 4)))


def test_plain_if_else_experts_are_reported_as_plain_routing():
    """The same experts called by a Python loop: what they are (experts routed in plain Python),
    with the advice to route them, never to remove them."""
    report = find_divergent_parameters(fx.Experts("plain"), [fx.expert_rows] * 2)
    assert groups(report) == [("experts.0", 2, "+-", "divergent"), ("experts.2", 2, "-+", "divergent"),
                              ("experts.3", 2, "--", "choice not sampled")]
    text = flat(report)
    assert "DIVERGENT: not in the graph on rank 1: experts routed in plain Python" in text
    assert "NOT SAMPLED (plain Python routing): other experts in experts are used on some ranks only" in text
    # the same rows on every rank: no expert diverges, and the ones no row picked are still choices
    for report in (find_divergent_parameters(fx.Experts("plain"), [fx.expert_rows(0)] * 2),
                   find_unused_parameters(fx.Experts("plain"), fx.expert_rows(0))):
        assert [(g.module, g.finding) for g in report.groups if g.finding != "ok"] == [
            ("experts.2", "choice not sampled"), ("experts.3", "choice not sampled")]
        assert report.unused == ["experts.2.weight", "experts.2.bias", "experts.3.weight", "experts.3.bias"]
        assert not report.safe and report.exit_code == 1
        text = flat(report)
        assert "NOT SAMPLED (plain Python routing): other experts in experts are used" in text
        assert "do not delete them or freeze them" in text and "maskedbranch.masked_branch" in text
        assert_no_removal_advice(report)


def test_hugging_face_nllb_moe():
    """NLLB-MoE routes each token to experts with a Python loop over the experts it hit; the same
    inputs on every rank leave the others out of the graph everywhere: routing choices, not unused
    weights. Routed through masked_branch instead, the model is safe."""
    pytest.importorskip("transformers")
    report = find_divergent_parameters(fx.nllb_moe(), [fx.nllb_moe_inputs()] * 2)
    bad = [g for g in report.groups if g.finding != "ok"]
    assert bad and {g.finding for g in bad} == {"choice not sampled"}, str(report)
    assert all(".ffn.experts.expert_" in g.module for g in bad)
    assert "other experts in encoder.layers.1.ffn.experts are used" in flat(report)
    assert_no_removal_advice(report)
    report = find_divergent_parameters(fx.nllb_moe(routed=True), [fx.nllb_moe_inputs()] * 2)
    assert report.safe and report.not_sampled, str(report)
    assert {g.finding for g in report.groups} == {"ok", "not sampled"}
    assert "masked_branch routed no row to it on any rank" in flat(report)


def test_transformers_layerdrop_plain_and_patched():
    pytest.importorskip("transformers")
    import hf_tiny
    from maskedbranch.integrations import transformers as mb_hf

    model, inputs = hf_tiny.build("bart")
    report = find_divergent_parameters(model, [Inputs(**inputs)] * 2, seed=0)
    assert not report.safe and report.divergent
    assert "Hugging Face LayerDrop: maskedbranch.integrations.transformers.patch(model) routes it" in flat(report)
    assert_no_removal_advice(report)
    mb_hf.patch(model)
    report = find_divergent_parameters(model, [Inputs(**inputs)] * 2, seed=0)
    assert report.safe, str(report)
    assert {r.type for r in report.routing} == {"LayerDrop"}
    sampled = [g.module for g in report.groups if g.finding == "not sampled"]
    assert sampled and all(m.startswith(("encoder.layers.", "decoder.layers.")) for m in sampled)
    assert "not sampled: LayerDrop encoder.layers ran branches" in flat(report)


@pytest.mark.parametrize("materialize_grads", [True, False])
def test_patched_timm_model(materialize_grads):
    """A patched timm block skips its dropped rows' branches and ties them in with each call:
    zeros, or no gradient (DDP fills zeros)."""
    timm = pytest.importorskip("timm")
    from maskedbranch.integrations import timm as mb_timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, drop_path_rate=0.9,
                              img_size=32, patch_size=8, embed_dim=32, num_heads=2, depth=3)
    mb_timm.patch(model, materialize_grads=materialize_grads)
    report = find_divergent_parameters(model, [(torch.randn(2, 3, 32, 32),)] * 2, seed=0)
    assert report.safe, str(report)
    tied = "0" if materialize_grads else "~"
    assert any(tied in p.ranks for p in report.parameters)  # branches dropped on some rank
    assert_no_removal_advice(report)


def test_functional_units_are_left_as_found():
    model = fx.Experts("functional")
    model(fx.expert_rows(2)).sum().backward()  # a training step's record: experts 2 and 3 ran
    before = [(u.bits, u.called) for u in _functional.units_in(list(model.experts))]
    assert before == [(0, True), (0, True), (1, True), (1, True)]  # what the step-time pruning will read
    find_divergent_parameters(model, [fx.expert_rows] * 2)
    assert [(u.bits, u.called) for u in _functional.units_in(list(model.experts))] == before
    fresh = fx.Experts("functional")  # units made by the doctor's own calls keep no record
    find_divergent_parameters(fresh, [fx.expert_rows] * 2)
    assert [(u.bits, u.called) for u in _functional.units_in(list(fresh.experts))] == [(0, False)] * 4


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_functional_routing_trains_under_real_ddp():
    """The functional-routing model the doctor calls safe, under real 2-rank DDP (gloo,
    find_unused_parameters=False): both iterations finish, and every rank holds the same
    gradients, the average of the ranks' own (an expert a rank did not run counts as zero)."""
    assert find_divergent_parameters(fx.Experts("functional"), [fx.expert_rows] * 2).safe
    ranks = run_ranks(_functional_ddp_worker, 2, timeout_s=180, what="the DDP job")
    torch.manual_seed(0)
    model = fx.Experts("functional")
    for step in range(2):
        own = []
        for r in range(2):
            model.zero_grad(set_to_none=True)
            (0.5 * model(fx.expert_rows(r)) ** 2).sum().backward()
            own.append({k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in model.named_parameters()})
        want = {k: (own[0][k] + own[1][k]) / 2 for k in own[0]}
        for r, steps in enumerate(ranks):
            got = steps[step]
            assert got.keys() == want.keys()
            for k in want:
                assert got[k] is not None, f"rank {r}, step {step}: {k} has no gradient"
                torch.testing.assert_close(got[k], want[k], msg=lambda m: f"rank {r}, step {step}, {k}: {m}")
        with torch.no_grad():
            for k, p in model.named_parameters():
                p -= 0.1 * want[k]


def _functional_ddp_worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(fx.Experts("functional"), find_unused_parameters=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        (0.5 * ddp(fx.expert_rows(rank)) ** 2).sum().backward()
        steps.append({k: None if p.grad is None else p.grad.clone() for k, p in ddp.module.named_parameters()})
        opt.step()
    torch.save(steps, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_job()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_verdict_agrees_with_ddp():
    """Two ranks of real DDP (gloo): the second iteration raises exactly when the doctor finds
    parameters out of the graph on some rank, for the same per-rank inputs."""
    ranks = run_ranks(_ddp_worker, 2, timeout_s=180, what="the DDP job")
    for name, (make, inputs) in _DDP_CASES.items():
        report = find_divergent_parameters(make(), [inputs(r) for r in range(2)])
        for r, seen in enumerate(ranks):
            assert seen[name] in ("ok", "raised"), f"rank {r}, {name}: {seen[name]}"
            assert (seen[name] == "ok") == report.safe, f"{name}: DDP {seen[name]} on rank {r}, doctor:\n{report}"
    assert set(ranks[0].values()) == {"ok", "raised"}


_DDP_CASES = {  # name: (model factory, rank -> inputs); every rank draws the same parameters
    "if_else": (fx.IfElse, lambda r: (torch.ones(r + 1, 1),)),
    "unused_head": (fx.WithUnusedHead, lambda r: (torch.ones(3, 4),)),
    "dense": (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), lambda r: (torch.ones(3, 4),)),
    "masked_if_else": (fx.MaskedIfElse, lambda r: (torch.ones(r + 1, 1),)),
    "supernet": (fx.Supernet, lambda r: Inputs(torch.ones(2, 4), choice=r)),
    "plain_supernet": (lambda: fx.Supernet(plain=True), lambda r: Inputs(torch.ones(2, 4), choice=r)),
    "residual_drop_path": (lambda: fx.ResidualStack(3, drop_prob=0.5), lambda r: (torch.ones(2, 4),)),
    "not_called": (fx.NotCalled, lambda r: (torch.ones(2, 4),)),
    "bypassed": (fx.Bypassed, lambda r: Inputs(torch.ones(2, 4), choice=r)),
    "functional_experts": (fx.Experts, lambda r: (fx.expert_rows(r),)),
    "plain_experts": (lambda: fx.Experts("plain"), lambda r: (fx.expert_rows(r),)),
    "functional_residual": (lambda: fx.FunctionalResidualStack(3, drop_prob=0.5), lambda r: (torch.ones(2, 4),)),
}


def _ddp_worker(rank, world, init_file, out_dir):
    from maskedbranch.doctor.rank import _as_call

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    seen = {}
    for name, (make, inputs) in _DDP_CASES.items():
        group = dist.new_group(list(range(world)))  # a case that goes wrong cannot disturb the next
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(make(), process_group=group)
        args, kwargs = _as_call(inputs(rank))
        try:
            for step in range(2):
                torch.manual_seed(10 * step + rank)
                out = ddp(*args, **kwargs)
                (0.5 * out**2).sum().backward()
            seen[name] = "ok"
        except RuntimeError as e:
            # DDP's error, or maskedbranch's for routed parameters DDP left to it (a branch called directly)
            raised = "Expected to have finished reduction" in str(e) or "no routing module ran them" in str(e)
            seen[name] = "raised" if raised else repr(e)
    torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_job()  # on the default group, which no case used
