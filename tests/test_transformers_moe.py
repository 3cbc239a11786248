"""maskedbranch.integrations.transformers on mixture-of-experts models whose experts are modules
of their own (SwitchTransformers, NLLB-MoE): the experts become a MaskedBranch over the same
modules and keys, routing as HF's loop does.

* float64, training mode, same seed: the patched model's loss, router z-loss and auxiliary loss
  and gradients equal HF's, bit for bit; eval outputs too; the same experts run on the same rows.
* Keys and checkpoints: state_dict keys unchanged, state dicts load both ways, copies, pickles and
  ``unpatch`` (HF's container back, with the same experts).
* The report: experts routed; fused-expert families (Mixtral, OLMoE) and dense ones (VitPose) need
  nothing; an expert layer this patch does not know is refused, naming MaskedBranch.
* Two gloo ranks routing differently: patched under DDP(find_unused_parameters=False) trains as
  HF's model under DDP(find_unused_parameters=True) over AdamW steps, bit for bit (NLLB-MoE's
  experts inside its LayerDrop layers included); HF's model under find_unused_parameters=False
  fails.
"""
import copy
import io
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import harness

transformers = pytest.importorskip("transformers", minversion="5")
import hf_tiny  # noqa: E402 - needs transformers
from maskedbranch.integrations import _experts  # noqa: E402
from maskedbranch.integrations import transformers as mb_hf  # noqa: E402

FAMILIES = tuple(hf_tiny.MOE)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with harness.intra_op_threads(1):
        yield


def _changed_forward(family):
    """Why the installed transformers' expert layer of ``family`` is not the one the patch was
    written from (None when it is): the patch then refuses it, which its rule's own test checks."""
    model, _ = hf_tiny.build_moe(family)
    for m in model.modules():
        rule, why = mb_hf._experts_rule_of(m)
        if rule is not None or why:
            return why
    return "no expert layer found"


@pytest.fixture(autouse=True)
def installed_forward_is_known(request):
    family = getattr(getattr(request.node, "callspec", None), "params", {}).get("family")
    if family is not None and family in FAMILIES:
        why = _changed_forward(family)
        if why:
            pytest.skip(f"transformers {transformers.__version__}: {why}")


def expert_modules(model):
    """(name, module) of every expert, in model order."""
    return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1].startswith("expert_")]


def step(model, inputs, seed):
    """One seeded forward and backward: (outputs, gradients by name, (expert, rows) that ran)."""
    ran = []
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: ran.append((n, args[0].shape[0])) if not out.is_meta else None)
             for n, m in expert_modules(model)]  # (the routing checks a new input shape's outputs on meta tensors)
    hf_tiny.seed_all(seed)
    out = model(**inputs)
    out.loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    losses = [getattr(out, k, None) for k in ("loss", "z_loss", "aux_loss", "encoder_z_loss", "encoder_aux_loss",
                                               "decoder_z_loss", "decoder_aux_loss")]  # the router losses HF returns
    return [t.detach() for t in losses if isinstance(t, torch.Tensor)], grads, ran


def assert_same(a, b):
    assert len(a[0]) == len(b[0]) >= 3 and all(torch.equal(x, y) for x, y in zip(a[0], b[0])), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    assert a[2] == b[2]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_and_eval_equal_hf(family):
    ref, inputs = hf_tiny.build_moe(family)
    model = copy.deepcopy(ref)
    report = mb_hf.patch(model)
    assert len(report.experts) == 2 and all(isinstance(m.experts, _experts.RoutedExperts) for m in routed(model))
    for seed in (1, 2):
        want, got = step(ref, inputs, seed), step(model, inputs, seed)
        assert_same(want, got)
        assert any(rows for _, rows in want[2])
    used = {n for n, _ in want[2]}
    assert len(used) < len(expert_modules(ref)), "an expert idles"
    ref.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(ref(**inputs).logits, model(**inputs).logits)


def routed(model):
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), _experts.RoutedExperts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_keys_checkpoints_copies_and_unpatch(family, tmp_path):
    ref, inputs = hf_tiny.build_moe(family)
    model = copy.deepcopy(ref)
    mb_hf.patch(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert any(".experts.expert_0." in k for k in model.state_dict())
    model.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path, dtype=torch.float64)  # into HF's own class
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ref.state_dict().values()))
    other, _ = hf_tiny.build_moe(family, seed=5)
    patched_other = copy.deepcopy(other)
    mb_hf.patch(patched_other)
    patched_other.load_state_dict(ref.state_dict())  # HF's checkpoint into the patched model
    assert_same(step(ref, inputs, 3), step(patched_other, inputs, 3))
    other.load_state_dict(model.state_dict())  # and back
    assert_same(step(ref, inputs, 3), step(other, inputs, 3))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert len(routed(copied)) == 2
        assert_same(step(ref, inputs, 4), step(copied, inputs, 4))
    assert mb_hf.patch(model).already and not mb_hf.patch(model).experts
    container = type(routed_candidates(ref)[0].experts)
    assert mb_hf.unpatch(model) >= 2 and not routed(model)
    assert all(type(m.experts) is container for m in routed_candidates(model))
    assert list(model.state_dict()) == list(ref.state_dict())
    assert_same(step(ref, inputs, 5), step(model, inputs, 5))


def test_report_fused_and_dense_experts_need_nothing():
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2))
    olmoe = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2))
    for model, cls in ((mixtral, "MixtralExperts"), (olmoe, "OlmoeExperts")):
        keys = list(model.state_dict())
        report = mb_hf.patch(model)  # nothing to convert, and nothing refused
        assert not report.experts and not report.converted and not report.skipped
        assert report.needs_nothing and all(why.startswith(cls + ": every expert's weights are in the same parameters")
                                            for why in report.needs_nothing.values())
        assert "needs nothing" in str(report) and list(model.state_dict()) == keys
    from transformers.models.vitpose_backbone.modeling_vitpose_backbone import VitPoseNaiveMoe

    config = transformers.VitPoseBackboneConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                                num_experts=2, part_features=4, image_size=[16, 16], patch_size=[8, 8])
    naive = nn.Sequential(VitPoseNaiveMoe(config))
    report = mb_hf.patch(naive)
    assert list(report.needs_nothing.values()) == ["VitPoseNaiveMoe: every expert runs on every token (its output masked by a multiplication)"]


def test_refusals_name_the_routing_module(monkeypatch):
    ref, _ = hf_tiny.build_moe("switch_transformers")
    sparse = type(routed_candidates(ref)[0])

    class Custom(sparse):
        def forward(self, hidden_states):
            return super().forward(hidden_states)

    layer = Custom(ref.config)
    with pytest.raises(ValueError, match=r"(?s)subclasses SwitchTransformersSparseMLP and overrides forward.*maskedbranch\.MaskedBranch\(self\.experts\).*strict=False"):
        mb_hf.patch(nn.Sequential(layer))
    rule = mb_hf.EXPERTS[f"{sparse.__module__}.{sparse.__qualname__}"]
    monkeypatch.setitem(mb_hf.EXPERTS, f"{sparse.__module__}.{sparse.__qualname__}",
                        type(rule)(rule.container, rule.routed, ("0" * 16, rule.read_from[1])))
    model = copy.deepcopy(ref)
    with pytest.raises(ValueError, match=r"SwitchTransformersSparseMLP\.forward is not the one this patch reproduces.*MaskedBranch"):
        mb_hf.patch(model)
    assert not routed(model)  # nothing changed
    report = mb_hf.patch(model, strict=False)
    assert not report.experts and len(report.skipped) == 2
    monkeypatch.undo()

    class Moe(nn.Module):  # a user's experts in a list, looped in Python: not a known forward
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x, k):
            return self.experts[k](x)

    with pytest.raises(ValueError, match=r"(?s)0\.experts: ModuleList holds experts that Moe's forward routes.*MaskedBranch.*nn\.ModuleDict keeps its keys") as info:
        mb_hf.patch(nn.Sequential(Moe()))
    assert "closest" not in str(info.value)  # no LayerDrop family to point at
    with pytest.raises(ValueError, match="has no module with LayerDrop.*and no expert layer"):
        mb_hf.patch(nn.Sequential(nn.Linear(2, 2)))


def routed_candidates(model):
    return [m for m in model.modules() if type(m).__name__.endswith("SparseMLP")]


# ----------------------------------------------------------------------------------------------
# Two gloo ranks.

STEPS = 3


def _train(rank, family, how):
    """STEPS AdamW steps with rank-dependent data and draws: (gradients per step, experts that ran
    per step, final parameters)."""
    model, _ = hf_tiny.build_moe(family)  # identical weights on both ranks
    if how == "patched":
        mb_hf.patch(model)
    wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=how == "reference")
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    grads, runs = [], []
    for s in range(STEPS):
        hf_tiny.seed_all(100 * s + rank)
        inputs = hf_tiny.moe_inputs()
        ran = []
        hooks = [m.register_forward_hook(lambda mod, args, out, n=n: ran.append(n) if not out.is_meta else None)
                 for n, m in expert_modules(model)]
        hf_tiny.seed_all(1000 * s + rank)  # the ranks draw differently (dropout, jitter)
        wrapped(**inputs).loss.backward()
        for h in hooks:
            h.remove()
        opt.step()  # (its pre-hook sets the gradients no rank used to None: read them after it)
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        runs.append(sorted(set(ran)))
        opt.zero_grad(set_to_none=True)
    return grads, runs, {n: p.detach().clone() for n, p in model.named_parameters()}


RUN = [(f, h) for f in FAMILIES for h in ("reference", "patched")] + [("switch_transformers", "plain")]


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    closing = dist.new_group(backend="gloo")  # the "plain" case leaves the default group unusable
    results = {}
    for family, how in RUN:
        try:
            results[(family, how)] = ("ok", _train(rank, family, how))
        except Exception:  # noqa: BLE001 - reported to the test
            results[(family, how)] = ("error", traceback.format_exc())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    harness.leave_job(closing)


@pytest.fixture(scope="module")
def ranks():
    return harness.run_ranks(_worker, 2, timeout_s=300, what="the DDP mixture-of-experts job")


@pytest.mark.slow  # the DDP job
@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_ddp_patched_equals_find_unused(ranks, family):
    ref = harness.results_of(ranks, (family, "reference"))
    got = harness.results_of(ranks, (family, "patched"))
    one_rank = every_rank_idle = False
    for r in range(2):
        ref_grads, ref_runs, ref_params = ref[r]
        grads, runs, params = got[r]
        assert runs == ref_runs, "the same experts run on each rank"
        for s in range(STEPS):
            assert grads[s].keys() == ref_grads[s].keys()
            for k, want in ref_grads[s].items():
                assert (grads[s][k] is None) == (want is None), f"rank {r} step {s} {k}: None where HF has None"
                if want is not None:
                    torch.testing.assert_close(grads[s][k], want, rtol=0, atol=0, msg=f"rank {r} step {s} {k}")
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=0, msg=f"rank {r} {k}")
    for s in range(STEPS):
        run0, run1 = set(ref[0][1][s]), set(ref[1][1][s])
        one_rank |= bool(run0 ^ run1)
        every_rank_idle |= any(g is None for k, g in ref[0][0][s].items() if ".expert_" in k)
    # (NLLB-MoE's loop runs expert_0 and expert_1 on every rank, the others on none)
    assert one_rank or family == "nllb_moe", "the routing must leave an expert idle on one rank in some step"
    assert every_rank_idle, "the routing must leave an expert idle on both ranks in some step"


@pytest.mark.slow  # the DDP job
@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_ddp_first_step_gradients_equal_up_to_the_reset(ranks, family):
    """What DDP reduces in the first step, before the reset: equal, with zeros where HF's model
    has None (DDP's reducer fills them for the experts no rank ran)."""
    ref = harness.results_of(ranks, (family, "reference"))
    got = harness.results_of(ranks, (family, "patched"))
    for r in range(2):
        assert got[r][1][0] == ref[r][1][0]
        for k, want in ref[r][0][0].items():
            have = got[r][0][0][k]
            if want is None:
                assert have is None or not have.any(), f"rank {r} {k}"
            else:
                torch.testing.assert_close(have, want, rtol=0, atol=0, msg=f"rank {r} {k}")


@pytest.mark.slow  # the DDP job
@pytest.mark.distributed
def test_ddp_hf_model_fails_without_find_unused(ranks):
    outcomes = [res[("switch_transformers", "plain")] for res in ranks]
    assert any(status == "error" for status, _ in outcomes)
    assert any("find_unused_parameters" in str(v) or "reduction" in str(v) for _, v in outcomes)
