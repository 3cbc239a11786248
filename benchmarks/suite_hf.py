"""Comparison 5: a Hugging Face model with LayerDrop under DDP, patched by
maskedbranch.integrations.transformers with find_unused_parameters=False, against HF's own model
with find_unused_parameters=True (the setting HF's Trainer picks for it).

A Wav2Vec2ForSequenceClassification (random weights, a small convolutional feature encoder) at
LayerDrop p; each rank draws its own layers (seeded by rank and step), and both contenders draw the
same ones in a step, so they run the same layers: the step-time ratio is the cost of DDP's graph
walk and used-map all-reduce (fup=True) against the tie of the dropped layers' parameters and the
unused-gradient pruning (patched; the two train identically, tests/test_transformers_integration.py).
"p = 0" is the same model without LayerDrop under fup=False: the step a model pays for every layer.
Ideal ratio "LayerDrop / p = 0" = the fraction of layer compute kept, about 1 - p for the encoder.
Contenders are interleaved step by step; 2 gloo ranks on CPU (one thread each), NCCL on GPUs.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file (e.g. by a loop over benchmarks/*.py)
    print("run the suite as a module: python -m benchmarks --only hf")
    raise SystemExit(0)

import json
import os
import socket
import statistics
import tempfile
import time

import torch

NAMES = ["HF LayerDrop, fup=True", "patched, fup=False", "p = 0, fup=False"]


def _model(cfg, p, patched):
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(0)
    d = cfg["d"]
    config = Wav2Vec2Config(hidden_size=d, num_hidden_layers=cfg["layers"], num_attention_heads=4, intermediate_size=4 * d,
                            conv_dim=(64, 64, 64, 64), conv_kernel=(10, 3, 3, 3), conv_stride=(5, 2, 2, 2),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=p, num_labels=4,
                            mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = Wav2Vec2ForSequenceClassification(config)
    model.freeze_feature_encoder()  # as fine-tuning does
    if patched:
        from maskedbranch.integrations import transformers as mb_hf

        mb_hf.patch(model)
    return model.train()


def _worker(rank, world, cfg, port, path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = cfg["device"] == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    models, opts = {}, {}
    for name in NAMES:
        m = _model(cfg, 0.0 if name.startswith("p = 0") else cfg["p"], name.startswith("patched")).to(dev)
        models[name] = DDP(m, device_ids=[rank] if cuda else None, find_unused_parameters="fup=True" in name)
        opts[name] = torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    steps = {k: [] for k in NAMES}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        x = torch.randn(cfg["batch"], cfg["samples"], generator=g).to(dev)
        y = torch.randint(0, 4, (cfg["batch"],), generator=g).to(dev)
        s = rep % len(NAMES)
        for name in NAMES[s:] + NAMES[:s]:
            torch.manual_seed(1000 * rep + rank)  # the same draws for every contender in this step
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            models[name](input_values=x, labels=y).loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if rep >= cfg["warmup"]:
                steps[name].append(time.perf_counter() - t0)
    dist.barrier()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(steps, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cfg) -> list:
    import torch.multiprocessing as mp

    cuda = cfg.device == "cuda"
    world = cfg.ddp_ranks or (min(2, torch.cuda.device_count()) if cuda else 2)
    base = dict(device=cfg.device, layers=8 if cfg.quick else 12, d=128 if cfg.quick else 256, batch=2 if cfg.quick else 4,
                samples=8000 if cfg.quick else 16000, reps=10 if cfg.quick else 30, warmup=2 if cfg.quick else 3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in ((0.4,) if cfg.quick else (0.1, 0.2, 0.4)):
            path = os.path.join(tmp, f"hf{p}.json")
            mp.spawn(_worker, args=(world, dict(base, p=p), _free_port(), path), nprocs=world, join=True)
            with open(path) as f:
                steps = json.load(f)
            ref, patched, full = (steps[k] for k in NAMES)
            rows.append([p, statistics.median(ref) * 1e3, statistics.median(patched) * 1e3, statistics.median(full) * 1e3,
                         statistics.median(a / b for a, b in zip(patched, ref)),
                         statistics.median(patched) / statistics.median(full), 1 - p])
    backend = f"{world} NCCL ranks" if cuda else f"{world} gloo ranks, 1 thread each"
    return [{
        "title": f"HF LayerDrop under DDP ({backend}; Wav2Vec2ForSequenceClassification, {base['layers']} layers of "
                 f"width {base['d']}, batch {base['batch']} x {base['samples']} samples per rank; medians over "
                 f"{base['reps']} interleaved steps, rank 0)",
        "columns": ["LayerDrop p", "HF, fup=True ms", "patched, fup=False ms", "p = 0 ms", "patched / HF fup=True*",
                    "patched / p = 0", "ideal (layers kept)"],
        "rows": rows,
        "notes": "*Median of per-step ratios (both contenders drop the same layers in a step). Both train "
                 "identically. The step also runs the (frozen) feature encoder and the head, which LayerDrop does "
                 "not skip, so patched / p = 0 stays above the ideal.",
    }]
