"""maskedbranch.integrations.transformers: HF LayerDrop that skips dropped layers and trains under
DDP with find_unused_parameters=False.

* Every supported family (tests/hf_tiny.py): with the same seed, the patched model draws the same
  layers as HF (the same layers run, checked with forward hooks: a dropped layer never runs), and
  gives the same loss and gradients, bit for bit; eval outputs are equal; the config is unchanged.
* Checkpoints: state_dict keys, save_pretrained -> from_pretrained into the plain class, generate.
* torch.compile: BART and OPT compiled (aot_eager) equal the patched models in eager mode, with no
  graph break at the hooks that hold HF's probability; holds from threads restore it.
* Refusals: unknown models (listing the supported ones), the owners whose loops do more than skip,
  subclasses that override forward, output_attentions in training where HF's loop skips them.
* Two gloo ranks drawing differently (tests/test_transformers_integration.py::test_ddp_*): the
  patched model under DDP(find_unused_parameters=False), static_graph and activation checkpointing,
  and under FSDP2 (the unit around the model, or one unit per layer), trains exactly as the
  unpatched model under DDP(find_unused_parameters=True) - parameters equal after AdamW steps with
  weight decay, gradients equal on both ranks; the unpatched model with find_unused_parameters=False
  does not.
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
from maskedbranch.integrations import _layerdrop  # noqa: E402
from maskedbranch.integrations import transformers as mb_hf  # noqa: E402

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread (two threads on a busy two-core runner spin more than they compute)."""
    with harness.intra_op_threads(1):
        yield


SKIPPED = {"pegasus_x": ["encoder"], "informer": ["encoder"], "table_transformer": ["decoder"]}


def owners(model):
    return [m for m in model.modules() if mb_hf.is_patched(m)]


def step(model, inputs, seed, calls=None):
    """One seeded forward and backward: (loss, gradients by name, layers that ran)."""
    ran = []
    hooks = []
    if calls is not None:
        for j, owner in enumerate(calls):
            for i, layer in enumerate(owner.layers):
                hooks.append(layer.register_forward_hook(lambda *_, k=(j, i): ran.append(k)))
    hf_tiny.seed_all(seed)
    loss = hf_tiny.loss_of(model(**inputs))
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, ran


def checkpointing(model):
    """HF's activation checkpointing (renamed from gradient checkpointing in transformers 5)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def assert_same(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    assert a[2] == b[2]


@pytest.mark.parametrize("family", sorted(hf_tiny.FAMILIES))
def test_training_equals_hf(family):
    ref, inputs = hf_tiny.build(family)
    model = copy.deepcopy(ref)
    report = mb_hf.patch(model, strict=family not in SKIPPED)
    assert sorted(report.skipped) == SKIPPED.get(family, [])
    patched = owners(model)
    assert patched and [n for n in report.converted] == [n for n, m in model.named_modules() if m in patched]
    ref_owners = [m for n, m in ref.named_modules() if n in report.converted]
    kept = [0] * len(patched)
    for seed in range(3):
        got = step(model, inputs, seed, patched)
        assert_same(step(ref, inputs, seed, ref_owners), got)
        for j, _ in got[2]:
            kept[j] += 1
    # Every converted module that ran drops some layers (a multi-modal model may not run them all:
    # the other families run those); tests/hf_tiny.py's families run each of the supported modules.
    assert any(kept) and all(k < 3 * len(owner.layers) for k, owner in zip(kept, patched)), (report.converted, kept)
    assert model.config.to_dict() == ref.config.to_dict()
    for name in report.converted:
        a, b = ref.get_submodule(name), model.get_submodule(name)
        assert getattr(a, "layerdrop", None) == getattr(b, "layerdrop", None)
    ref.eval(), model.eval()
    hf_tiny.seed_all(0)
    want = hf_tiny.loss_of(ref(**inputs))
    hf_tiny.seed_all(0)
    assert torch.equal(hf_tiny.loss_of(model(**inputs)), want)


@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"),
                    reason="transformers 5's attention masks call torch.compiler.is_exporting (torch >= 2.7)")
@pytest.mark.parametrize("family", ["bart", "opt"])
def test_compiled_patched_model_equals_eager_and_adds_no_break_of_its_own(family):
    """Plain torch.compile (aot_eager) of a patched model whose probability is an owner
    attribute: the same losses and gradients as the patched model in eager mode, step by step,
    and no graph break from the hooks that hold HF's probability (a lock there broke every
    compiled hold and release: 14 breaks in 4 steps of BART against HF's own 5)."""
    from torch._dynamo.utils import counters

    model, inputs = hf_tiny.build(family)
    mb_hf.patch(model)
    compiled_model = copy.deepcopy(model)
    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(compiled_model, backend="aot_eager")
    for seed in range(4):
        want = step(model, inputs, seed)
        got = step(compiled, inputs, seed)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        grads = {k.removeprefix("_orig_mod."): g for k, g in got[1].items()}
        assert grads.keys() == want[1].keys()
        for k in want[1]:
            torch.testing.assert_close(grads[k], want[1][k], rtol=1e-4, atol=1e-6, msg=k)
    reasons = [k for k in counters["graph_break"]]
    assert not any("context manager" in r.lower() for r in reasons), reasons
    assert sum(counters["graph_break"].values()) <= 4 * len(owners(model)) * 2, reasons
    torch.compiler.reset()


def test_holds_from_threads_restore_the_real_value():
    """Threads holding HF's probability at once (replicas of one model, as nn.DataParallel runs
    them): on a shared config under the lock, on each replica's own attribute without one; the
    real value comes back once every hold is released."""
    import threading

    config = type("Config", (), {})()
    config.layerdrop = 0.3
    owner = nn.Linear(2, 2)
    owner.layerdrop = 0.2
    replicas = [copy.copy(owner) for _ in range(4)]
    barrier = threading.Barrier(8)

    def run(obj, name):
        barrier.wait()
        for _ in range(300):
            _layerdrop._hold(obj, name, 0.0)
            assert getattr(obj, name) == 0.0 and _layerdrop._real(obj, name) in (0.3, 0.2)
            _layerdrop._release(obj, name)

    threads = [threading.Thread(target=run, args=(config, "layerdrop")) for _ in range(4)]
    threads += [threading.Thread(target=run, args=(r, "layerdrop")) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert config.layerdrop == 0.3 and owner.layerdrop == 0.2
    assert all(r.layerdrop == 0.2 for r in replicas)
    assert not _layerdrop._held


def test_families_cover_every_supported_module():
    from maskedbranch.integrations._transformers_rules import RULES

    seen = set()
    for family in hf_tiny.FAMILIES:
        model, _ = hf_tiny.build(family)
        mb_hf.patch(model, strict=False)
        seen |= {f"{type(m).__module__}.{type(m).__qualname__}" for m in owners(model)}
    assert seen == set(RULES), sorted(set(RULES) ^ seen)


def test_state_dict_and_save_pretrained(tmp_path):
    cfg = transformers.Wav2Vec2Config(**dict(hf_tiny.AUDIO, num_labels=3))
    torch.manual_seed(0)
    ref = transformers.Wav2Vec2ForSequenceClassification(cfg)
    model = copy.deepcopy(ref)
    mb_hf.patch(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    step(model.train(), {"input_values": torch.randn(2, 400)}, 0)  # a training step leaves the config as it was
    model.save_pretrained(tmp_path / "patched")
    ref.save_pretrained(tmp_path / "ref")
    assert (tmp_path / "patched" / "config.json").read_text() == (tmp_path / "ref" / "config.json").read_text()
    loaded = transformers.Wav2Vec2ForSequenceClassification.from_pretrained(tmp_path / "patched")
    assert loaded.config.layerdrop == hf_tiny.P
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    model.load_state_dict(ref.state_dict())  # and the plain model's checkpoint loads into the patched one


@pytest.mark.parametrize("family", ["bart", "whisper"])
def test_generate_unchanged(family):
    cls = {"bart": "BartForConditionalGeneration", "whisper": "WhisperForConditionalGeneration"}[family]
    _, cfg_cls, kwargs, inputs = hf_tiny.FAMILIES[family]
    torch.manual_seed(0)
    ref = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kwargs)).eval()
    model = copy.deepcopy(ref)
    mb_hf.patch(model)
    x = inputs()
    x.pop("decoder_input_ids")
    out = model.generate(**x, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref.generate(**x, max_new_tokens=6, do_sample=False))


def test_unsupported_models_get_the_closest_families_not_every_name():
    """GPT-2 (no LayerDrop) and Flaubert (a LayerDrop this patch refuses): the reason, then a few
    families of the same kind by name, and where the whole list is; not the 80 names."""
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    flaubert = transformers.FlaubertModel(transformers.FlaubertConfig(vocab_size=32, emb_dim=16, n_layers=1,
                                                                      n_heads=2, layerdrop=0.1))
    cases = [(gpt2, "GPT2Model has no module with LayerDrop", "closest to gpt2 (decoder-only language models)",
              ["BioGptModel", "OPTDecoder", "XGLMModel"]),
             (flaubert, "<root>: its layers are not modules of one list", "closest to flaubert (encoder-decoder text models)",
              ["BartEncoder", "MBartEncoder"])]
    for model, reason, closest, named in cases:
        with pytest.raises(ValueError) as info:
            mb_hf.patch(model)
        msg = str(info.value)
        assert reason in msg and closest in msg and "maskedbranch.integrations.transformers.SUPPORTED" in msg
        assert all(name in msg for name in named)
        listed = [name for name in mb_hf.SUPPORTED if name in msg]
        assert 1 <= len(listed) <= 8, listed  # a few families' classes, not all of them
        assert len(msg) < 700 and "Wav2Vec2Encoder" not in msg


def test_every_family_has_a_kind():
    from maskedbranch.integrations._transformers_rules import FAMILIES, KINDS

    kinds = [f for _, families in KINDS.values() for f in families]
    assert sorted(kinds) == sorted(FAMILIES)


def test_refuses_what_it_does_not_know():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=16))
    with pytest.raises(ValueError, match=r"(?s)BertModel has no module with LayerDrop.*closest to bert.*BartEncoder.*SUPPORTED"):
        mb_hf.patch(bert)
    model, _ = hf_tiny.build("informer")
    with pytest.raises(ValueError, match=r"(?s)encoder: a dropped layer also skips the distilling convolution.*strict=False"):
        mb_hf.patch(model)
    assert not owners(model)  # nothing changed

    class Custom(transformers.models.bart.modeling_bart.BartEncoder):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    custom = Custom(transformers.BartConfig(**hf_tiny.S2S))
    with pytest.raises(ValueError, match="subclasses BartEncoder and overrides forward"):
        mb_hf.patch(custom)
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        mb_hf.patch("bart")
    model, _ = hf_tiny.build("bart")
    with pytest.raises(TypeError, match="materialize_grads: expected 'auto' \\(None\\)"):
        mb_hf.patch(model, materialize_grads=1)
    assert not owners(model)
    mb_hf.patch(model)
    assert sorted(mb_hf.patch(model).already) == ["decoder", "encoder"]


def test_output_attentions_where_hf_skips_them():
    ref, inputs = hf_tiny.build("trocr")
    model = copy.deepcopy(ref)
    mb_hf.patch(model)
    with pytest.raises(ValueError, match="TrOCRDecoder.layers: output_attentions=True in training"):
        for seed in range(8):  # a seed that drops a layer
            hf_tiny.seed_all(seed)
            model(**inputs, output_attentions=True)
    model.eval(), ref.eval()
    a, b = model(**inputs, output_attentions=True), ref(**inputs, output_attentions=True)
    assert all(torch.equal(x, y) for x, y in zip(a.attentions, b.attentions))
    model.train(), ref.train()
    assert_same(step(ref, inputs, 3), step(model, inputs, 3))  # and the model works afterwards


def test_outside_forward_and_after_errors():
    model, inputs = hf_tiny.build("wav2vec2")
    mb_hf.patch(model)
    state = torch.get_rng_state()
    layers = list(model.encoder.layers)  # training mode, outside the forward: the layers, no draws
    assert layers == list(model.encoder.layers._modules.values()) and torch.equal(state, torch.get_rng_state())
    assert isinstance(model.encoder.layers[1:], nn.ModuleList) and len(model.encoder.layers[1:]) == 3

    def fail(*_):
        raise RuntimeError("boom")

    handle = model.encoder.layers[3].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        for seed in range(8):
            hf_tiny.seed_all(seed)
            model(**inputs)
    handle.remove()
    assert model.config.layerdrop == hf_tiny.P and model.encoder.layers._p is None
    ref, _ = hf_tiny.build("wav2vec2")
    assert_same(step(ref, inputs, 1), step(model, inputs, 1))


def test_materialize_grads_and_deepspeed_zero3(monkeypatch):
    ref, inputs = hf_tiny.build("bart")
    model = copy.deepcopy(ref)
    mb_hf.patch(model, materialize_grads=True)  # zeros for a dropped layer's parameters, even in one process
    a, b = step(ref, inputs, 0), step(model, inputs, 0)
    missing = set(n for n, p in ref.named_parameters()) - set(a[1])
    assert missing and missing == {n for n, g in b[1].items() if not g.any()} - set(a[1])
    for n, g in a[1].items():
        assert torch.equal(b[1][n], g), n
    monkeypatch.setattr(_layerdrop, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(RuntimeError, match="BartEncoder.layers: LayerDrop under DeepSpeed ZeRO-3"):
        step(model, inputs, 0)
    assert model.config.encoder_layerdrop == hf_tiny.P and model.encoder.layerdrop == hf_tiny.P
    model.eval()
    model(**inputs)  # eval mode drops nothing: nothing to refuse


def test_copies_pickles_unpatch_and_checkpointing():
    ref, inputs = hf_tiny.build("bart")
    model = copy.deepcopy(ref)
    mb_hf.patch(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert len(owners(other)) == 2
        assert_same(step(ref, inputs, 2), step(other, inputs, 2))
    checkpointing(ref)
    checkpointing(model)
    assert_same(step(ref, inputs, 4), step(model, inputs, 4))
    assert mb_hf.unpatch(model) == 2 and not owners(model)
    assert type(model.encoder.layers) is nn.ModuleList
    assert_same(step(ref, inputs, 5), step(model, inputs, 5))  # the remaining hooks do nothing
    mb_hf.patch(model)  # and a second patch does not register them twice
    assert len(model.encoder._forward_pre_hooks) == 1


# ----------------------------------------------------------------------------------------------
# Two gloo ranks.

STEPS = 3
FAMILIES_DDP = ("wav2vec2", "bart", "wav2vec2-nospec")


def _train(rank, family, how):
    """STEPS AdamW steps with rank-dependent data and draws: (gradients per step, layers that ran
    per step, final parameters, every layer)."""
    model, _ = hf_tiny.build(family)  # identical weights on both ranks
    stacks = [model.get_submodule(n) for n in mb_hf.patch(copy.deepcopy(model)).converted]
    layers = [(j, i) for j, o in enumerate(stacks) for i in range(len(o.layers))]
    if how != "plain":
        mb_hf.patch(model)
    if how == "checkpointing":
        checkpointing(model)
    if how.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        if how == "fsdp-layers":
            for owner in owners(model):
                for layer in owner.layers:
                    fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=how == "reference", static_graph=how == "static")
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    grads, runs = [], []
    for s in range(STEPS):
        hf_tiny.seed_all(100 + rank)
        inputs = hf_tiny.FAMILIES[family][3]()
        ran = []
        # A layer's first submodule runs only when the layer computes (a dropped layer that is its
        # own FSDP2 unit is still entered, for its collectives).
        hooks = [next(layer.children()).register_forward_hook(lambda *_, k=(j, i): ran.append(k))
                 for j, o in enumerate(stacks) for i, layer in enumerate(o.layers)]
        hf_tiny.seed_all(1000 * s + rank)  # the ranks draw differently
        hf_tiny.loss_of(wrapped(**inputs)).backward()
        for h in hooks:
            h.remove()
        full = {}
        for n, p in model.named_parameters():
            g = p.grad
            full[n] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
        grads.append(full)
        runs.append(sorted(set(ran)))  # activation checkpointing runs a kept layer twice
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    return grads, runs, params, layers


# FSDP2 runs on CPUs from torch 2.7 (2.6's all-gather records an event on a device stream).
FSDP2_ON_CPU = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7)
SCENARIOS = [(f, h) for f in FAMILIES_DDP for h in ("reference", "patched")] + [
    ("wav2vec2", h) for h in ("static", "checkpointing", "fsdp-root", "fsdp-layers", "plain")]
RUN = [s for s in SCENARIOS if FSDP2_ON_CPU or not s[1].startswith("fsdp")]


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
        if how == "plain":
            break  # its failed reduction leaves the process group unusable
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    harness.leave_job(closing)


@pytest.fixture(scope="module")
def ranks():
    return harness.run_ranks(_worker, 2, timeout_s=300, what="the DDP / FSDP2 LayerDrop job")


def _zeros_for_none(grads, like):
    return {k: torch.zeros_like(like[k]) if g is None else g for k, g in grads.items()}


@pytest.mark.slow  # the DDP / FSDP2 job
@pytest.mark.distributed
@pytest.mark.parametrize("family,how", [
    pytest.param(*s, marks=pytest.mark.skipif(s not in RUN, reason="FSDP2 runs on CPUs from torch 2.7"))
    for s in SCENARIOS if s[1] not in ("reference", "plain")])
def test_ddp_patched_equals_reference(ranks, family, how):
    ref = harness.results_of(ranks, (family, "reference"))
    got = harness.results_of(ranks, (family, how))
    final = ref[0][2]
    # DDP reduces the same buckets either way: bit for bit. FSDP2 reduce-scatters in other groups.
    tol = dict(rtol=1e-6, atol=1e-7) if how.startswith("fsdp") else dict(rtol=0, atol=0)
    all_dropped = some_dropped = False
    for r in range(2):
        ref_grads, ref_runs, ref_params, _ = ref[r]
        grads, runs, params, _ = got[r]
        assert runs == ref_runs, "the same layers run on each rank"
        for s in range(STEPS):
            want = _zeros_for_none(ref_grads[s], final)
            have = _zeros_for_none(grads[s], final)
            for k in want:
                torch.testing.assert_close(have[k], want[k], **tol, msg=f"rank {r} step {s} {k}")
                torch.testing.assert_close(have[k], _zeros_for_none(got[1 - r][0][s], final)[k], rtol=0, atol=0)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], **tol, msg=f"rank {r} {k}")
    for s in range(STEPS):
        run0, run1 = set(ref[0][1][s]), set(ref[1][1][s])
        all_dropped |= bool(set(ref[0][3]) - run0 - run1)
        some_dropped |= bool(run0 ^ run1)
    assert all_dropped and some_dropped, "the draws must drop a layer on every rank in some step, on one rank in another"


@pytest.mark.slow  # the DDP / FSDP2 job
@pytest.mark.distributed
def test_ddp_plain_model_fails_without_find_unused(ranks):
    """The test above can fail: HF's own LayerDrop under find_unused_parameters=False errors or
    averages different gradients on the two ranks."""
    outcomes = [res[("wav2vec2", "plain")] for res in ranks]
    if all(status == "ok" for status, _ in outcomes):
        a, b = outcomes[0][1][2], outcomes[1][1][2]
        assert any(not torch.equal(a[k], b[k]) for k in a), "the ranks should have diverged"
    else:
        assert any("find_unused_parameters" in str(v) or "reduction" in str(v) for _, v in outcomes)
