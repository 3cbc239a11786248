"""A Hugging Face model with LayerDrop, trained by the HF Trainer under DDP with
find_unused_parameters=False.

    torchrun --standalone --nproc_per_node=2 examples/hf_trainer_layerdrop.py
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer_layerdrop.py --compare

HF's Trainer turns find_unused_parameters=True on for every PreTrainedModel (it must: a layer
LayerDrop skips gets no gradient). After ``maskedbranch.integrations.transformers.patch(model)``
a dropped layer is still skipped (no compute) but its parameters get a gradient on every rank,
so ``TrainingArguments(ddp_find_unused_parameters=False)`` works, and the training equals HF's.

--compare trains HF's own model with ddp_find_unused_parameters=True first, then the patched one
with False, and checks that the gradients of every step and the final parameters are equal on
every rank. --out PATH saves each rank's records to PATH.rank<r>.pt. Runs on CPUs (gloo) or GPUs.
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments, Wav2Vec2Config, Wav2Vec2ForSequenceClassification

from maskedbranch.integrations import transformers as mb_hf

from _ranks import everyone, leave  # examples/_ranks.py
from _records import same  # examples/_records.py

STEPS = 4


def tiny_model():
    torch.manual_seed(0)  # the same initial weights on every rank
    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=64,
                            conv_dim=(16, 16), conv_kernel=(3, 3), conv_stride=(2, 2), num_conv_pos_embeddings=4,
                            num_conv_pos_embedding_groups=2, layerdrop=0.5, num_labels=3, mask_time_prob=0.0)
    return Wav2Vec2ForSequenceClassification(config)


class Waves(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_values": torch.randn(800, generator=g), "labels": i % 3}


class Record(TrainerCallback):
    """Each rank draws its own LayerDrop (as when ranks consume their random streams differently);
    the layers that ran and the gradients (before the optimizer step) of every step are kept."""

    def __init__(self):
        self.grads, self.ran = [], []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for i, layer in enumerate(model.wav2vec2.encoder.layers):
            layer.register_forward_hook(lambda *_, i=i: self.ran[-1].append(i))

    def on_step_begin(self, args, state, control, **kwargs):
        torch.manual_seed(1000 * state.global_step + dist.get_rank())
        self.ran.append([])

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})


def train(patched, workdir):
    # The arguments first: they start the distributed job, so that the DDP built around the model
    # made next is seen being built and leaves the dropped layers to maskedbranch.
    args = TrainingArguments(
        output_dir=workdir, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.1,
        ddp_find_unused_parameters=not patched,  # the one setting: False once the model is patched
        ddp_backend=None if torch.cuda.is_available() else "gloo", use_cpu=not torch.cuda.is_available(),
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    model = tiny_model()
    if patched:
        report = mb_hf.patch(model)  # after building / loading, before the Trainer wraps it
        if int(os.environ.get("RANK", 0)) == 0:
            print(report)
    record = Record()
    Trainer(model=model, args=args, train_dataset=Waves(), callbacks=[record]).train()
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    grads = [{n: None if g is None else g.cpu() for n, g in s.items()} for s in record.grads]
    return {"grads": grads, "params": params, "ran": record.ran}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", action="store_true", help="also train HF's model with find_unused_parameters=True")
    parser.add_argument("--out", help="save each rank's records to OUT.rank<r>.pt")
    args = parser.parse_args()
    records = {}
    with tempfile.TemporaryDirectory() as workdir:
        if args.compare:
            records["reference"] = train(False, workdir)
        records["patched"] = train(True, workdir)
    rank = dist.get_rank()
    if args.out:
        torch.save(records, f"{args.out}.rank{rank}.pt")
    ranks = everyone(records["patched"])
    if rank == 0:
        print(f"gradients and parameters equal on all {len(ranks)} ranks: {all(same(ranks[0], r) for r in ranks)}")
        if args.compare:
            print(f"equal to HF's model with find_unused_parameters=True: {same(records['reference'], records['patched'])}")
    leave()


if __name__ == "__main__":
    main()
