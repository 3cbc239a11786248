"""Tiny random transformers models with LayerDrop (no downloads: configs built here), one per family
that maskedbranch.integrations.transformers supports, with inputs and a seeded training step.
Shared by tests/test_transformers_integration.py and tests/test_trainers.py."""
import importlib
import random

import numpy as np
import torch
import transformers

B = 2
P = 0.5  # LayerDrop probability of every tiny model


def ids(n=7, vocab=64):
    return torch.randint(3, vocab, (B, n))


AUDIO = dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
             conv_kernel=(3, 3), conv_stride=(2, 2), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
             layerdrop=P, mask_time_prob=0.2, mask_time_length=2)
STABLE = dict(AUDIO, do_stable_layer_norm=True, feat_extract_norm="layer")
ADAPTER = dict(add_adapter=True, num_adapter_layers=3, adapter_stride=1, adapter_kernel_size=1, output_hidden_size=16)
S2S = dict(vocab_size=64, d_model=16, encoder_layers=4, decoder_layers=4, encoder_attention_heads=2, decoder_attention_heads=2,
           encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, encoder_layerdrop=P, decoder_layerdrop=P,
           pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
TS = dict(prediction_length=4, context_length=8, lags_sequence=[1, 2], num_time_features=1, d_model=16, encoder_layers=4,
          decoder_layers=4, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
          encoder_layerdrop=P, decoder_layerdrop=P)
CONFORMER = dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                 layerdrop=P, num_mel_bins=8, subsampling_conv_channels=8, conv_kernel_size=3)
SEAMLESS = dict(vocab_size=64, t2u_vocab_size=32, hidden_size=16, encoder_layers=4, decoder_layers=4, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, speech_encoder_layers=4,
                speech_encoder_attention_heads=2, speech_encoder_intermediate_size=32, feature_projection_input_dim=8,
                conv_depthwise_kernel_size=3, encoder_layerdrop=P, decoder_layerdrop=P, speech_encoder_layerdrop=P,
                max_position_embeddings=64, t2u_encoder_layers=1, t2u_decoder_layers=1, t2u_encoder_attention_heads=2,
                t2u_decoder_attention_heads=2, t2u_encoder_ffn_dim=16, t2u_decoder_ffn_dim=16, unit_hifi_gan_vocab_size=8,
                unit_embed_dim=8, lang_embed_dim=4, spkr_embed_dim=4, vocoder_num_langs=2, vocoder_num_spkrs=2,
                upsample_initial_channel=8, upsample_rates=[2], upsample_kernel_sizes=[4], resblock_kernel_sizes=[3],
                resblock_dilation_sizes=[[1]], pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
DECODER = dict(vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, max_position_embeddings=64, layerdrop=P)


def s2s():
    return dict(input_ids=ids(), decoder_input_ids=ids(5))


def wav():
    return dict(input_values=torch.randn(B, 400))


def speech_feats():
    return dict(input_features=torch.randn(B, 12, 8), decoder_input_ids=ids(5))


def series():
    return dict(past_values=torch.randn(B, 10), past_time_features=torch.randn(B, 10, 1), past_observed_mask=torch.ones(B, 10),
                future_values=torch.randn(B, 4), future_time_features=torch.randn(B, 4, 1))


# family -> (model class, config class, config kwargs, inputs)
FAMILIES = {
    "wav2vec2": ("Wav2Vec2Model", "Wav2Vec2Config", dict(AUDIO, **ADAPTER), wav),
    "wav2vec2-stable": ("Wav2Vec2Model", "Wav2Vec2Config", STABLE, wav),
    # SpecAugment off: masked_spec_embed is unused in every step (the patch ties it in)
    "wav2vec2-nospec": ("Wav2Vec2Model", "Wav2Vec2Config", dict(AUDIO, apply_spec_augment=False), wav),
    "hubert": ("HubertModel", "HubertConfig", AUDIO, wav),
    "hubert-stable": ("HubertModel", "HubertConfig", STABLE, wav),
    "unispeech": ("UniSpeechModel", "UniSpeechConfig", AUDIO, wav),
    "unispeech-stable": ("UniSpeechModel", "UniSpeechConfig", STABLE, wav),
    "unispeech-sat": ("UniSpeechSatModel", "UniSpeechSatConfig", AUDIO, wav),
    "unispeech-sat-stable": ("UniSpeechSatModel", "UniSpeechSatConfig", STABLE, wav),
    "data2vec-audio": ("Data2VecAudioModel", "Data2VecAudioConfig", dict(AUDIO, **ADAPTER), wav),
    "sew": ("SEWModel", "SEWConfig", dict(AUDIO, squeeze_factor=2), wav),
    "wav2vec2-conformer": ("Wav2Vec2ConformerModel", "Wav2Vec2ConformerConfig", dict(AUDIO, conv_depthwise_kernel_size=3, **ADAPTER), wav),
    "wav2vec2-bert": ("Wav2Vec2BertModel", "Wav2Vec2BertConfig", dict(
        hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32, feature_projection_input_dim=8,
        conv_depthwise_kernel_size=3, layerdrop=P, mask_time_prob=0.0, add_adapter=True, num_adapter_layers=3,
        adapter_kernel_size=3, adapter_stride=1, output_hidden_size=16), lambda: dict(input_features=torch.randn(B, 12, 8))),
    "wavlm": ("WavLMModel", "WavLMConfig", dict(AUDIO, num_buckets=8, max_bucket_distance=16, **ADAPTER), wav),
    "wavlm-stable": ("WavLMModel", "WavLMConfig", dict(STABLE, num_buckets=8, max_bucket_distance=16), wav),
    "omniasr": ("OmniASRAudioModel", "OmniASRAudioConfig", dict(AUDIO, mask_time_prob=0.0), lambda: dict(input_values=torch.randn(B, 1, 400))),
    "seamless_m4t": ("SeamlessM4TForSpeechToText", "SeamlessM4TConfig", SEAMLESS, speech_feats),
    "seamless_m4t-text": ("SeamlessM4TModel", "SeamlessM4TConfig", SEAMLESS, s2s),
    "seamless_m4t_v2": ("SeamlessM4Tv2ForSpeechToText", "SeamlessM4Tv2Config", dict(SEAMLESS, char_vocab_size=16), speech_feats),
    "seamless_m4t_v2-text": ("SeamlessM4Tv2Model", "SeamlessM4Tv2Config", dict(SEAMLESS, char_vocab_size=16), s2s),
    "seamless_m4t_v2-t2u": ("seamless_m4t_v2.modeling_seamless_m4t_v2.SeamlessM4Tv2TextToUnitForConditionalGeneration",
                            "SeamlessM4Tv2Config", dict(SEAMLESS, char_vocab_size=16, t2u_decoder_layers=4, t2u_variance_predictor_embed_dim=16,
                                                           t2u_variance_predictor_hidden_dim=16),
                            lambda: dict(inputs_embeds=torch.randn(B, 5, 16), char_input_ids=torch.randint(0, 16, (B, 10)),
                                         char_count_per_id=torch.full((B, 5), 2))),
    "bart": ("BartModel", "BartConfig", S2S, s2s),
    "mbart": ("MBartModel", "MBartConfig", S2S, s2s),
    "plbart": ("PLBartModel", "PLBartConfig", S2S, s2s),
    "m2m_100": ("M2M100Model", "M2M100Config", S2S, s2s),
    "nllb_moe": ("NllbMoeModel", "NllbMoeConfig", dict(S2S, num_experts=2, expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2), s2s),
    "marian": ("MarianModel", "MarianConfig", dict(S2S, decoder_vocab_size=64), s2s),
    "pegasus": ("PegasusModel", "PegasusConfig", S2S, s2s),
    "pegasus_x": ("PegasusXModel", "PegasusXConfig", dict(S2S, encoder_layerdrop=0.0, block_size=4, num_global_tokens=2, stagger_local_blocks=False),
                  lambda: dict(input_ids=ids(8), decoder_input_ids=ids(5))),
    "blenderbot": ("BlenderbotModel", "BlenderbotConfig", S2S, s2s),
    "blenderbot_small": ("BlenderbotSmallModel", "BlenderbotSmallConfig", S2S, s2s),
    "bigbird_pegasus": ("BigBirdPegasusModel", "BigBirdPegasusConfig", dict(S2S, attention_type="original_full"), s2s),
    "mvp": ("MvpModel", "MvpConfig", S2S, s2s),
    "led": ("LEDModel", "LEDConfig", dict(S2S, attention_window=4, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64),
            lambda: dict(input_ids=ids(8), decoder_input_ids=ids(5))),
    "fsmt": ("FSMTModel", "FSMTConfig", dict(S2S, src_vocab_size=64, tgt_vocab_size=64, langs=["en", "de"]), s2s),
    "whisper": ("WhisperModel", "WhisperConfig", dict(S2S, num_mel_bins=8, max_source_positions=8, max_target_positions=16),
                lambda: dict(input_features=torch.randn(B, 8, 16), decoder_input_ids=ids(5))),
    "speech_to_text": ("Speech2TextModel", "Speech2TextConfig", dict(S2S, num_conv_layers=2, conv_channels=8, input_feat_per_channel=8,
                       input_channels=1, max_source_positions=64, max_target_positions=64),
                       lambda: dict(input_features=torch.randn(B, 16, 8), decoder_input_ids=ids(5))),
    "speecht5": ("SpeechT5Model", "SpeechT5Config", dict(S2S, hidden_size=16),
                 lambda: dict(input_values=torch.randn(B, 6, 16), decoder_input_values=torch.randn(B, 5, 16))),
    "time_series_transformer": ("TimeSeriesTransformerModel", "TimeSeriesTransformerConfig", TS, series),
    "informer": ("InformerModel", "InformerConfig", dict(TS, encoder_layerdrop=0.0, distil=False), series),
    "autoformer": ("AutoformerModel", "AutoformerConfig", dict(TS, label_length=4), series),
    "table_transformer": ("TableTransformerModel", "TableTransformerConfig", dict(
        use_timm_backbone=False, backbone_config=dict(model_type="resnet", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        out_features=["stage2"]), d_model=16, encoder_layers=4, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4, encoder_layerdrop=P),
        lambda: dict(pixel_values=torch.randn(B, 3, 32, 32))),
    "opt": ("OPTModel", "OPTConfig", dict(DECODER, ffn_dim=32, word_embed_proj_dim=16), lambda: dict(input_ids=ids())),
    "xglm": ("XGLMModel", "XGLMConfig", dict(vocab_size=64, d_model=16, num_layers=4, ffn_dim=32, attention_heads=2,
             max_position_embeddings=64, layerdrop=P), lambda: dict(input_ids=ids())),
    "biogpt": ("BioGptModel", "BioGptConfig", dict(DECODER, intermediate_size=32), lambda: dict(input_ids=ids())),
    "kosmos2": ("kosmos2.modeling_kosmos2.Kosmos2TextForCausalLM", "Kosmos2TextConfig", dict(
        vocab_size=64, embed_dim=16, layers=4, ffn_dim=32, attention_heads=2, max_position_embeddings=64, layerdrop=P),
        lambda: dict(input_ids=ids())),
    "trocr": ("TrOCRForCausalLM", "TrOCRConfig", dict(vocab_size=64, d_model=16, decoder_layers=4, decoder_attention_heads=2,
              decoder_ffn_dim=32, max_position_embeddings=64, decoder_layerdrop=P), lambda: dict(input_ids=ids())),
    "pp_formulanet": ("PPFormulaNetTextModel", "PPFormulaNetTextConfig", dict(vocab_size=64, d_model=16, decoder_layers=4,
                      decoder_attention_heads=2, decoder_ffn_dim=32, max_position_embeddings=64, decoder_layerdrop=P),
                      lambda: dict(input_ids=ids(), encoder_hidden_states=torch.randn(B, 6, 16))),
    "musicgen": ("MusicgenForCausalLM", "MusicgenDecoderConfig", dict(DECODER, ffn_dim=32, num_codebooks=2), lambda: dict(input_ids=ids(5).repeat(2, 1))),
    "musicgen_melody": ("MusicgenMelodyForCausalLM", "MusicgenMelodyDecoderConfig", dict(DECODER, ffn_dim=32, num_codebooks=2),
                        lambda: dict(input_ids=ids(5).repeat(2, 1))),
    "vits": ("VitsModel", "VitsConfig", dict(
        vocab_size=32, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, ffn_dim=32, flow_size=16, spectrogram_bins=8,
        upsample_initial_channel=16, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1]], prior_encoder_num_flows=1, prior_encoder_num_wavenet_layers=1,
        posterior_encoder_num_wavenet_layers=1, duration_predictor_num_flows=1, duration_predictor_filter_channels=8,
        depth_separable_num_layers=1, layerdrop=P, use_stochastic_duration_prediction=False), lambda: dict(input_ids=ids(6, 32))),
    "qwen2_audio": ("Qwen2AudioEncoder", "Qwen2AudioEncoderConfig", dict(num_mel_bins=8, encoder_layers=4, encoder_attention_heads=2,
                    encoder_ffn_dim=32, d_model=16, max_source_positions=8, encoder_layerdrop=P),
                    lambda: dict(input_features=torch.randn(B, 8, 16))),
    "audioflamingo3": ("AudioFlamingo3Encoder", "AudioFlamingo3EncoderConfig", dict(num_mel_bins=8, num_hidden_layers=4,
                       num_attention_heads=2, intermediate_size=32, hidden_size=16, max_source_positions=8, layerdrop=P),
                       lambda: dict(input_features=torch.randn(B, 8, 16), input_features_mask=torch.ones(B, 16, dtype=torch.long))),
    "lasr": ("LasrEncoder", "LasrEncoderConfig", dict(CONFORMER, subsampling_conv_kernel_size=3), lambda: dict(input_features=torch.randn(B, 24, 8))),
    "parakeet": ("ParakeetEncoder", "ParakeetEncoderConfig", dict(CONFORMER, subsampling_factor=4), lambda: dict(input_features=torch.randn(B, 24, 8))),
    "nemotron_asr_streaming": ("NemotronAsrStreamingEncoder", "NemotronAsrStreamingEncoderConfig", dict(
        CONFORMER, subsampling_factor=4, sliding_window=8, default_num_lookahead_tokens=2), lambda: dict(input_features=torch.randn(B, 24, 8))),
}


def build(family, seed=0):
    """(model in training mode, inputs) for ``family``, with weights from ``seed``."""
    model_cls, config_cls, kwargs, inputs = FAMILIES[family]
    if "." in model_cls:
        module, name = model_cls.rsplit(".", 1)
        cls = getattr(importlib.import_module("transformers.models." + module), name)
    else:
        cls = getattr(transformers, model_cls)
    torch.manual_seed(seed)
    model = cls(getattr(transformers, config_cls)(**kwargs)).train()
    return model, inputs()


def seed_all(seed):
    """HF's models draw from torch's, numpy's (SpecAugment masks, adapters) and Python's generators."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def loss_of(out):
    """A scalar that depends on every floating output (hidden states, logits, ...)."""
    items = out.to_tuple() if hasattr(out, "to_tuple") else (out if isinstance(out, tuple) else (out,))
    return sum(t.float().pow(2).mean() for t in items if isinstance(t, torch.Tensor) and t.is_floating_point())


# Mixture-of-experts models whose experts are modules of their own (tests/test_transformers_moe.py):
# few tokens per expert and a small capacity, so that some tokens overflow and some experts idle.
MOE_S2S = dict(vocab_size=64, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
MOE = {
    "switch_transformers": ("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig", dict(
        MOE_S2S, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=8,
        expert_capacity=2, encoder_sparse_step=2, decoder_sparse_step=2)),
    "nllb_moe": ("NllbMoeForConditionalGeneration", "NllbMoeConfig", dict(
        S2S, num_experts=4, expert_capacity=3, encoder_sparse_step=2, decoder_sparse_step=2, encoder_layers=2,
        decoder_layers=2, encoder_layerdrop=0.0, decoder_layerdrop=0.0)),  # (HF's aux loss fails when every router is dropped)
}


def moe_inputs(n=9):
    return dict(input_ids=ids(n), labels=ids(5), output_router_logits=True)


def build_moe(family, seed=0, dtype=torch.float64):
    """(model in training mode, inputs) for ``family`` of ``MOE``, in ``dtype``; the routers
    compute in ``dtype`` too (their config only offers float32 and below)."""
    model_cls, config_cls, kwargs = MOE[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).to(dtype).train()
    for m in model.modules():
        if type(m).__name__.endswith(("Top1Router", "Top2Router")):
            m.dtype = dtype
            m.classifier.to(dtype)
    return model, moe_inputs()
