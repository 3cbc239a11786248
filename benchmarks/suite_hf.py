"""A Hugging Face model with LayerDrop under DDP: HF's own model with find_unused_parameters=True
(what HF's Trainer picks for it) against the same model patched by
``maskedbranch.integrations.transformers.patch`` with find_unused_parameters=False.

A Wav2Vec2ForSequenceClassification (random weights, a small frozen convolutional feature encoder)
at LayerDrop p. Each rank draws its own layers; within a step every contender draws the same ones
(the step's seed is an input), so HF and patched run the same layers and train identically (checked:
parameters equal after the timed SGD steps with momentum and weight decay). The step ratio
patched / HF is then what find_unused_parameters=True costs (DDP's graph walk and used-map
all-reduce) against what the patch costs (the dropped layers' tie, the unused-gradient pruning).
"p = 0" is the model without LayerDrop (fup=False): HF / p = 0 shows what LayerDrop saves, whose
ideal is about the kept fraction of the encoder layers' share of the step.
2 gloo ranks on CPU (one thread each), NCCL on GPUs; contenders interleaved step by step.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only hf")
    raise SystemExit(0)

import importlib.util

import torch
from torch import nn

from . import note, table
from .ddp_train import backend, columns, launch_all, record_checks, summarize

NONE = "p = 0, fup=False"


def _names(ps):
    return [n for p in ps for n in (f"HF p={p}, fup=True", f"patched p={p}, fup=False")] + [NONE]


class Seeded(nn.Module):
    """The model, seeded per step from an input: every contender of a step draws the same layers."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, seed: int):
        torch.manual_seed(seed)
        return self.model(input_values=x).logits


def build(name: str, job: dict) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    p = 0.0 if name == NONE else float(name.split("p=")[1].split(",")[0])
    d = job["d"]
    config = Wav2Vec2Config(hidden_size=d, num_hidden_layers=job["layers"], num_attention_heads=4, intermediate_size=4 * d,
                            conv_dim=(64, 64, 64, 64), conv_kernel=(10, 3, 3, 3), conv_stride=(5, 2, 2, 2),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=p, num_labels=4,
                            mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = Wav2Vec2ForSequenceClassification(config)
    model.freeze_feature_encoder()  # as fine-tuning does
    if name.startswith("patched"):
        from maskedbranch.integrations import transformers as mb_hf

        mb_hf.patch(model)
    return Seeded(model)


def ddp_kwargs(name: str) -> dict:
    return {"find_unused_parameters": "fup=True" in name}


def draw(g: torch.Generator, job: dict):
    x = torch.randn(job["batch"], job["samples"], generator=g)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    return (x, seed), torch.randint(0, 4, (job["batch"],), generator=g)


def loss(out, target):
    return nn.functional.cross_entropy(out, target)


def run(cfg) -> list:
    if importlib.util.find_spec("transformers") is None:
        note(cfg, "hf: skipped: transformers is not installed")
        return []
    cuda = cfg.device == "cuda"
    world = cfg.ddp_ranks or (1 if cuda else 2)
    size = cfg.size
    layers, d, batch, samples = {"smoke": (4, 32, 2, 1600), "quick": (8, 128, 2, 8000), "full": (12, 256, 4, 16000)}[size]
    launches, reps, warmup = {"smoke": (1, 3, 1), "quick": (1, 10, 2), "full": (2, 30, 3)}[size]
    ps = {"smoke": (0.4,), "quick": (0.2, 0.4), "full": (0.1, 0.2, 0.4)}[size]
    names = _names(ps)
    same = [[f"patched p={p}, fup=False", f"HF p={p}, fup=True"] for p in ps]
    job = dict(device=cfg.device, layers=layers, d=d, batch=batch, samples=samples, reps=reps, warmup=warmup,
               lr=1e-3, weight_decay=1e-4, module_phases=False)
    runs = launch_all(__name__, names, same, world, launches, job)
    record_checks(cfg, runs, "hf")
    rows = summarize(runs, names, lambda n: n.replace("patched", "HF").replace("fup=False", "fup=True")
                     if n.startswith("patched") else NONE, module_phases=False)
    return [table(
        f"HF LayerDrop under DDP ({backend(world, cuda)}; Wav2Vec2ForSequenceClassification, {layers} layers of width {d}, "
        f"batch {batch} x {samples} samples per rank, SGD momentum 0.9, weight decay 1e-4; {launches} launch(es) x "
        f"{reps} interleaved steps; medians in ms, rank 0)",
        columns(False),
        rows,
        "*Median of per-step ratios against the contender in 'against': patched against HF at the same p (the same "
        "layers run in every step; trained identically, checked), HF against the model without LayerDrop. Goal: "
        "patched / HF <= 1 (no graph walk); HF / p = 0 approaches the kept fraction of the layers' share of the step.",
    )]
