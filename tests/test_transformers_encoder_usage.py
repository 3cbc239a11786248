"""Encoder-decoder models under the transformers patch: what counts as used when LayerDrop leaves
an encoder's output unread, or does not draw at all.

* A rank that drops every decoder layer reads its encoder's output nowhere (the loss goes
  through the decoder only). HF's model under DDP(find_unused_parameters=True) leaves the
  encoder's parameters unused on that rank, and without a gradient (skipped by AdamW) when every
  rank did so. The patched model under find_unused_parameters=False must train the same, bit for
  bit: DDP must not wait for the encoder's parameters (the job would abort in gloo), and they
  must be pruned only when no rank used them, also when the loss reads the encoder's output.
* An owner whose LayerDrop probability is 0 (or that runs in eval mode) draws nothing; its
  layers ran and must never be pruned.

Forced draws: each rank sets its own probabilities per step (1.0 drops every layer).
"""
import pytest
import torch
from torch import nn

import harness

transformers = pytest.importorskip("transformers", minversion="5")
import hf_tiny  # noqa: E402 - needs transformers
from maskedbranch import unused_grads_to_none  # noqa: E402
from maskedbranch.integrations import transformers as mb_hf  # noqa: E402

# plan -> per step, per rank: (encoder_layerdrop, decoder_layerdrop)
PLANS = {
    "one rank drops every decoder layer": [[(0.5, 1.0), (0.5, 0.0)]] * 3,
    "every rank drops every decoder layer": [[(0.5, 0.5)] * 2, [(0.5, 1.0)] * 2, [(0.5, 0.5)] * 2, [(0.3, 1.0), (0.5, 0.2)]],
    "encoder probability 0": [[(0.0, 0.5)] * 2, [(0.0, 1.0)] * 2, [(0.0, 0.5), (0.0, 1.0)]],
    "the loss also reads the encoder": [[(0.5, 1.0)] * 2, [(0.5, 0.5), (0.5, 1.0)]],
}
FAMILIES = {
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(**hf_tiny.S2S)),
    "whisper": lambda: transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(**dict(hf_tiny.S2S, num_mel_bins=8, max_source_positions=8, max_target_positions=16))),
}


def set_layerdrop(model, encoder, decoder):
    """The owners read their probability from their own attribute, set from the config at init."""
    model.get_encoder().layerdrop, model.get_decoder().layerdrop = encoder, decoder


def _inputs(family):
    labels = torch.randint(3, 64, (2, 5))
    if family == "whisper":
        return dict(input_features=torch.randn(2, 8, 16), labels=labels)
    return dict(input_ids=torch.randint(3, 64, (2, 7)), labels=labels)


def _train(family, plan, how):
    def run(rank, group):
        torch.manual_seed(0)
        model = FAMILIES[family]()
        if how != "reference":
            mb_hf.patch(model)
        if how == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            ddp = fully_shard(model)
        else:
            ddp = nn.parallel.DistributedDataParallel(model, process_group=group, find_unused_parameters=how == "reference")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        unread = []  # per step: whether this rank's encoder got no gradient (reference only)
        for s, per_rank in enumerate(PLANS[plan]):
            set_layerdrop(model, *per_rank[rank])
            hf_tiny.seed_all(100 * s + rank)
            out = ddp(**_inputs(family))
            loss = out.loss
            if plan == "the loss also reads the encoder":
                loss = loss + out.encoder_last_hidden_state.pow(2).mean()
            loss.backward()
            unread.append(all(p.grad is None for n, p in model.get_encoder().named_parameters()
                              if p.requires_grad and "embed_tokens" not in n))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return unread, {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                        for n, p in model.named_parameters()}

    return run


# FSDP2 runs on CPUs from torch 2.7; its tie gives zero gradients, which it reduce-scatters.
FSDP2 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7)
FSDP2_PLANS = ["one rank drops every decoder layer", "every rank drops every decoder layer"]


def _worker(rank, world, init_file, out_dir):
    scenarios = {(f, p, how): _train(f, p, how) for f in FAMILIES for p in PLANS for how in ("reference", "patched")}
    if FSDP2:
        scenarios.update({("bart", p, "fsdp2"): _train("bart", p, "fsdp2") for p in FSDP2_PLANS})
    harness.run_scenarios(rank, world, init_file, out_dir, scenarios, timeout_s=60)


@pytest.fixture(scope="module")
def ranks():
    return harness.run_ranks(_worker, 2, timeout_s=400, what="the encoder-decoder DDP job")


@pytest.mark.slow  # the encoder-decoder DDP job
@pytest.mark.distributed
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_trains_as_hf_with_find_unused(ranks, family, plan):
    want = harness.results_of(ranks, (family, plan, "reference"))
    got = harness.results_of(ranks, (family, plan, "patched"))
    for r in range(2):
        for k, v in want[r][1].items():
            torch.testing.assert_close(got[r][1][k], v, rtol=0, atol=0, msg=f"rank {r} {k}")
    # The plans do what they say (in HF's model, where the encoder got no gradient on both ranks,
    # AdamW skipped it: the patched model must have pruned it there).
    unread_everywhere = [a and b for a, b in zip(want[0][0], want[1][0])]
    if plan == "every rank drops every decoder layer":
        assert unread_everywhere == [False, True, False, False]
    if plan == "one rank drops every decoder layer":
        assert not any(unread_everywhere)


@pytest.mark.slow  # the encoder-decoder DDP job
@pytest.mark.distributed
@pytest.mark.skipif(not FSDP2, reason="FSDP2 runs on CPUs from torch 2.7")
@pytest.mark.parametrize("plan", FSDP2_PLANS)
def test_fsdp2_trains_as_hf_with_find_unused(ranks, plan):
    """Under FSDP2 (the unit around the model), as under DDP, up to the reduce-scatter's rounding."""
    want = harness.results_of(ranks, ("bart", plan, "reference"))
    got = harness.results_of(ranks, ("bart", plan, "fsdp2"))
    for r in range(2):
        for k, v in want[r][1].items():
            torch.testing.assert_close(got[r][1][k], v, rtol=1e-6, atol=1e-7, msg=f"rank {r} {k}")


def test_owner_that_draws_nothing_keeps_its_gradients():
    """One process, the explicit pruning handle: an encoder with probability 0 (and one in eval
    mode) ran all its layers, which keep their gradients; the decoder's dropped layers are
    pruned."""
    for how in ("probability 0", "eval"):
        for seed in range(20):  # a draw where the decoder runs some layers and drops others
            torch.manual_seed(0)
            model = FAMILIES["bart"]()
            set_layerdrop(model, 0.5 if how == "eval" else 0.0, 0.5)
            if how == "eval":
                model.model.encoder.eval()
            mb_hf.patch(model, materialize_grads=True)  # zeros for dropped layers: the handle must prune them
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            handle = unused_grads_to_none(opt, model)
            hf_tiny.seed_all(seed)
            ran = []
            layers = model.model.decoder.layers
            hooks = [layer.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, layer in enumerate(layers)]
            model(**_inputs("bart")).loss.backward()
            for h in hooks:
                h.remove()
            opt.step()
            if 0 < len(ran) < len(layers):
                break
        assert 0 < len(ran) < len(layers)
        assert all(p.grad is not None for p in model.model.encoder.parameters()), how
        dropped = [i for i in range(len(layers)) if i not in ran]
        assert all(p.grad is None for i in dropped for p in layers[i].parameters())
        assert handle.last_reset == sum(1 for i in dropped for _ in layers[i].parameters())
