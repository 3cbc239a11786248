"""Which transformers modules apply LayerDrop, and how each one does it, and which route their
experts in Python (read from their forwards, transformers 5.x).
:mod:`maskedbranch.integrations.transformers` applies these rules; the tests run every listed
family against the unpatched model.

An *owner* is the module whose forward loops over ``self.layers`` and skips a layer when a random
draw falls below the LayerDrop probability. A rule says where that probability lives, how HF draws,
and what the loop then needs from a layer that did not run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Rule:
    """How one owner class applies LayerDrop.

    * ``source``: the owner attribute holding the probability (``"layerdrop"``), or
      ``"config.<name>"`` for one read from the owner's config on every call.
    * ``draw``: ``"torch"``: HF draws ``torch.rand([])`` when training with a positive probability
      (the patch draws it instead, in the same place); otherwise HF draws on every iteration and the
      patch reads the same number ahead (restoring the generator): ``"torch-always"``,
      ``"numpy-random"`` (``np.random.random()``), ``"numpy-uniform"`` (``np.random.uniform(0, 1)``),
      ``"python-uniform"`` (``random.uniform(0, 1)``).
    * ``inclusive``: the layer is dropped when the draw is ``<=`` the probability (else ``<``).
    * ``first``: layers before this index are never dropped (WavLM computes its position bias in
      layer 0).
    * ``out``: 0: the loop takes the layer's return value as the hidden states; n > 0: a tuple of n
      whose first item is the hidden states and the rest ``None`` (what HF's loop substitutes);
      ``"position_bias"`` / ``"trend"``: the pair WavLM / Autoformer's decoder unpack.
    * ``attentions``: HF's loop skips past the code that collects attention outputs, so with
      ``output_attentions=True`` in training the patched loop could not return the same tuples: such
      a call is refused.
    * ``neutral``: the value given to HF's own probability while the owner runs, so that its own
      check never drops a layer (-1.0 where HF keeps a layer when ``draw > probability``).
    """

    source: str = "layerdrop"
    draw: str = "torch"
    inclusive: bool = False
    first: int = 0
    out: object = 0
    attentions: bool = False
    neutral: float = 0.0


_CONFIG = Rule(source="config.layerdrop")
_ATTR = Rule()
_ADAPTER = Rule(draw="numpy-random", inclusive=True, neutral=-1.0)


def _rules(package: str, module: str, rule: Rule, *classes: str) -> Dict[str, Rule]:
    return {f"transformers.models.{package}.{module}.{c}": rule for c in classes}


RULES: Dict[str, Rule] = {
    # The Wav2Vec2 family: the probability is config.layerdrop, read on every call.
    **_rules("wav2vec2", "modeling_wav2vec2", _CONFIG, "Wav2Vec2Encoder", "Wav2Vec2EncoderStableLayerNorm"),
    **_rules("hubert", "modeling_hubert", _CONFIG, "HubertEncoder", "HubertEncoderStableLayerNorm"),
    **_rules("unispeech", "modeling_unispeech", _CONFIG, "UniSpeechEncoder", "UniSpeechEncoderStableLayerNorm"),
    **_rules("unispeech_sat", "modeling_unispeech_sat", _CONFIG, "UniSpeechSatEncoder", "UniSpeechSatEncoderStableLayerNorm"),
    **_rules("data2vec", "modeling_data2vec_audio", _CONFIG, "Data2VecAudioEncoder"),
    **_rules("sew", "modeling_sew", _CONFIG, "SEWEncoder"),
    **_rules("wav2vec2_conformer", "modeling_wav2vec2_conformer", _CONFIG, "Wav2Vec2ConformerEncoder"),
    **_rules("wav2vec2_bert", "modeling_wav2vec2_bert", _CONFIG, "Wav2Vec2BertEncoder"),
    **_rules("wavlm", "modeling_wavlm", Rule(source="config.layerdrop", first=1, out="position_bias"),
             "WavLMEncoder", "WavLMEncoderStableLayerNorm"),
    **_rules("seamless_m4t", "modeling_seamless_m4t", Rule(source="config.speech_encoder_layerdrop"), "SeamlessM4TConformerEncoder"),
    **_rules("seamless_m4t_v2", "modeling_seamless_m4t_v2", Rule(source="config.speech_encoder_layerdrop"),
             "SeamlessM4Tv2ConformerEncoder"),
    # Their adapters (config.add_adapter): numpy draws on every iteration, a layer runs when draw > p.
    **_rules("wav2vec2", "modeling_wav2vec2", _ADAPTER, "Wav2Vec2Adapter"),
    **_rules("data2vec", "modeling_data2vec_audio", _ADAPTER, "Data2VecAudioAdapter"),
    **_rules("wav2vec2_conformer", "modeling_wav2vec2_conformer", _ADAPTER, "Wav2Vec2ConformerAdapter"),
    **_rules("wavlm", "modeling_wavlm", _ADAPTER, "WavLMAdapter"),
    **_rules("wav2vec2_bert", "modeling_wav2vec2_bert", Rule(inclusive=True), "Wav2Vec2BertAdapter"),
    # Encoder / decoder stacks with encoder_layerdrop / decoder_layerdrop copied to self.layerdrop.
    **_rules("bart", "modeling_bart", _ATTR, "BartEncoder", "BartDecoder"),
    **_rules("mbart", "modeling_mbart", _ATTR, "MBartEncoder", "MBartDecoder"),
    **_rules("plbart", "modeling_plbart", _ATTR, "PLBartEncoder", "PLBartDecoder"),
    **_rules("m2m_100", "modeling_m2m_100", _ATTR, "M2M100Encoder", "M2M100Decoder"),
    **_rules("nllb_moe", "modeling_nllb_moe", _ATTR, "NllbMoeEncoder", "NllbMoeDecoder"),
    **_rules("marian", "modeling_marian", _ATTR, "MarianEncoder", "MarianDecoder"),
    **_rules("pegasus", "modeling_pegasus", _ATTR, "PegasusEncoder", "PegasusDecoder"),
    **_rules("pegasus_x", "modeling_pegasus_x", _ATTR, "PegasusXDecoder"),
    **_rules("blenderbot", "modeling_blenderbot", _ATTR, "BlenderbotEncoder", "BlenderbotDecoder"),
    **_rules("blenderbot_small", "modeling_blenderbot_small", _ATTR, "BlenderbotSmallEncoder", "BlenderbotSmallDecoder"),
    **_rules("bigbird_pegasus", "modeling_bigbird_pegasus", _ATTR, "BigBirdPegasusEncoder", "BigBirdPegasusDecoder"),
    **_rules("whisper", "modeling_whisper", _ATTR, "WhisperEncoder", "WhisperDecoder"),
    **_rules("speech_to_text", "modeling_speech_to_text", _ATTR, "Speech2TextEncoder", "Speech2TextDecoder"),
    **_rules("time_series_transformer", "modeling_time_series_transformer", _ATTR,
             "TimeSeriesTransformerEncoder", "TimeSeriesTransformerDecoder"),
    **_rules("informer", "modeling_informer", _ATTR, "InformerDecoder"),
    **_rules("autoformer", "modeling_autoformer", _ATTR, "AutoformerEncoder"),
    **_rules("autoformer", "modeling_autoformer", Rule(out="trend"), "AutoformerDecoder"),
    **_rules("opt", "modeling_opt", _ATTR, "OPTDecoder"),
    **_rules("xglm", "modeling_xglm", _ATTR, "XGLMModel"),
    **_rules("biogpt", "modeling_biogpt", _ATTR, "BioGptModel"),
    **_rules("kosmos2", "modeling_kosmos2", _ATTR, "Kosmos2TextTransformer"),
    **_rules("seamless_m4t", "modeling_seamless_m4t", _ATTR, "SeamlessM4TEncoder", "SeamlessM4TDecoder"),
    **_rules("seamless_m4t_v2", "modeling_seamless_m4t_v2", _ATTR, "SeamlessM4Tv2Encoder", "SeamlessM4Tv2Decoder",
             "SeamlessM4Tv2TextToUnitDecoder"),
    **_rules("qwen2_audio", "modeling_qwen2_audio", _ATTR, "Qwen2AudioEncoder"),
    **_rules("audioflamingo3", "modeling_audioflamingo3", _ATTR, "AudioFlamingo3Encoder"),
    **_rules("lasr", "modeling_lasr", _ATTR, "LasrEncoder"),
    **_rules("parakeet", "modeling_parakeet", _ATTR, "ParakeetEncoder"),
    **_rules("nemotron_asr_streaming", "modeling_nemotron_asr_streaming", _ATTR, "NemotronAsrStreamingEncoder"),
    **_rules("pp_formulanet", "modeling_pp_formulanet", _ATTR, "PPFormulaNetTextModel"),
    **_rules("omniasr", "modeling_omniasr", Rule(draw="torch-always"), "OmniASRAudioModel"),
    # Stacks whose layers return tuples; HF's loop substitutes Nones for a dropped layer.
    **_rules("mvp", "modeling_mvp", Rule(out=2), "MvpEncoder"),
    **_rules("led", "modeling_led", Rule(out=3), "LEDEncoder"),
    **_rules("speecht5", "modeling_speecht5", Rule(out=2), "SpeechT5Encoder"),
    **_rules("fsmt", "modeling_fsmt", Rule(out=2), "FSMTEncoder"),
    **_rules("table_transformer", "modeling_table_transformer", Rule(out=2), "TableTransformerEncoder"),
    # HF's loop `continue`s past the attention outputs of a dropped layer.
    **_rules("mvp", "modeling_mvp", Rule(out=3, attentions=True), "MvpDecoder"),
    **_rules("led", "modeling_led", Rule(out=3, attentions=True), "LEDDecoder"),
    **_rules("speecht5", "modeling_speecht5", Rule(out=3, attentions=True), "SpeechT5Decoder"),
    **_rules("trocr", "modeling_trocr", Rule(out=3, attentions=True), "TrOCRDecoder"),
    **_rules("fsmt", "modeling_fsmt", Rule(out=3, attentions=True), "FSMTDecoder"),
    # Draws on every iteration from Python's or numpy's generator.
    **_rules("musicgen", "modeling_musicgen", Rule(draw="python-uniform"), "MusicgenDecoder"),
    **_rules("musicgen_melody", "modeling_musicgen_melody", Rule(draw="python-uniform", out=2), "MusicgenMelodyDecoder"),
    **_rules("vits", "modeling_vits", Rule(draw="numpy-uniform", out=2), "VitsEncoder"),
}

# Owners whose loops do more than skip the layer when it is dropped: the patched loop could not
# give the same result, so the patch refuses them (with the reason).
REFUSED: Dict[str, str] = {
    "transformers.models.conditional_detr.modeling_conditional_detr.ConditionalDetrDecoder":
        "a dropped layer also skips the query scaling and the auxiliary-loss outputs of its iteration",
    "transformers.models.table_transformer.modeling_table_transformer.TableTransformerDecoder":
        "a dropped layer also skips the auxiliary-loss outputs of its iteration",
    "transformers.models.mask2former.modeling_mask2former.Mask2FormerMaskedAttentionDecoder":
        "a dropped layer also skips the mask prediction of its iteration",
    "transformers.models.informer.modeling_informer.InformerEncoder":
        "a dropped layer also skips the distilling convolution that follows it",
    "transformers.models.flaubert.modeling_flaubert.FlaubertModel":
        "its layers are not modules of one list (attentions[i], ffns[i], ...)",
    "transformers.models.pegasus_x.modeling_pegasus_x.PegasusXEncoder":
        "HF's own LayerDrop sets the hidden states to None when it drops a layer",
}

# Model names for messages and docs: owner module -> the model family users know.
FAMILIES: Tuple[str, ...] = tuple(sorted({key.split(".")[2] for key in RULES}))

# The families by the kind of model, the most used first: an unsupported model's error names the
# closest ones (its own kind, then the most similar names) instead of all of them.
KINDS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "speech": ("speech and audio encoders", (
        "wav2vec2", "whisper", "hubert", "wavlm", "wav2vec2_conformer", "wav2vec2_bert", "data2vec", "unispeech",
        "unispeech_sat", "sew", "speech_to_text", "speecht5", "seamless_m4t", "seamless_m4t_v2", "qwen2_audio",
        "audioflamingo3", "parakeet", "lasr", "nemotron_asr_streaming", "omniasr")),
    "seq2seq": ("encoder-decoder text models", (
        "bart", "mbart", "marian", "m2m_100", "pegasus", "nllb_moe", "plbart", "blenderbot", "blenderbot_small",
        "bigbird_pegasus", "pegasus_x", "led", "mvp", "fsmt")),
    "decoder": ("decoder-only language models", ("opt", "xglm", "biogpt", "kosmos2")),
    "time_series": ("time-series models", ("time_series_transformer", "informer", "autoformer")),
    "vision": ("vision and document models", ("trocr", "table_transformer", "pp_formulanet")),
    "text_to_audio": ("text-to-audio models", ("musicgen", "musicgen_melody", "vits")),
}


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts layers. Most families keep every expert in one fused parameter (a 3-D
# ``gate_up_proj``), which each step uses whatever the routing: DDP needs nothing there. The
# families below keep each expert a module of its own and loop over them in Python, so that an
# expert no token of a rank reached leaves its parameters without a gradient there.


@dataclass(frozen=True)
class ExpertsRule:
    """How one owner (the sparse MLP, whose forward calls its router, then its experts) routes.

    * ``container``: the class of the owner's ``experts`` (an ``nn.ModuleDict`` of ``expert_<i>``),
      which the patch replaces by ``routed``, a class of maskedbranch/integrations/_experts.py
      that keeps the same expert modules under the same keys;
    * ``read_from``: fingerprints (maskedbranch/integrations/_experts.py, ``fingerprint``) of the
      owner's and the container's forwards the routed class reproduces; another forward (a newer
      transformers) is refused rather than routed another way than HF routes.
    """

    container: str
    routed: str
    read_from: Tuple[str, str]


EXPERTS: Dict[str, ExpertsRule] = {
    # Top-1 with an expert capacity per sequence; a token over capacity gets zeros (the layer's
    # residual passes it on), a routed one its expert's output times its router probability.
    "transformers.models.switch_transformers.modeling_switch_transformers.SwitchTransformersSparseMLP": ExpertsRule(
        "transformers.models.switch_transformers.modeling_switch_transformers.SwitchTransformersExperts",
        "RoutedSwitchExperts", ("5f51b50a94b55e16", "46a082c0fbab82ac")),
    # HF's loop takes the one-hot of the top-1 *mask*: its "expert" c runs the (expert, token) pairs
    # whose mask entry is c, so only expert_0 (weighted by the pairs' combined probabilities, the
    # top-2 one) and expert_1 (the top-1 one) ever run, then the token dropout per pair.
    "transformers.models.nllb_moe.modeling_nllb_moe.NllbMoeSparseMLP": ExpertsRule(
        "transformers.models.nllb_moe.modeling_nllb_moe.NllbMoeExperts",
        "RoutedNllbMoeExperts", ("0f2f4496a3f9da15", "ed50ddf864b81391")),
}

# Expert lists whose every expert runs on every token (its output masked by a multiplication):
# every parameter gets a gradient in every step, so DDP needs nothing.
DENSE_EXPERTS: Dict[str, str] = {
    "transformers.models.vitpose_backbone.modeling_vitpose_backbone.VitPoseNaiveMoe":
        "every expert runs on every token (its output masked by a multiplication)",
}
