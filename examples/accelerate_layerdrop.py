"""A Hugging Face seq2seq model with encoder and decoder LayerDrop, trained with Accelerate under DDP
with find_unused_parameters=False.

    torchrun --standalone --nproc_per_node=2 examples/accelerate_layerdrop.py
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_layerdrop.py --compare  # CPUs too

``maskedbranch.integrations.transformers.patch(model)`` before ``accelerator.prepare``: a layer
LayerDrop skips still costs nothing, and its parameters get a gradient on every rank, so
Accelerate's default ``DistributedDataParallelKwargs(find_unused_parameters=False)`` works.

--compare first trains HF's own model with find_unused_parameters=True, then the patched one
with False, and checks that the gradients of every step and the final parameters are equal on
every rank. --out PATH saves each rank's records to PATH.rank<r>.pt.
"""
import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from transformers import BartConfig, BartForConditionalGeneration

from maskedbranch.integrations import transformers as mb_hf

from _records import same  # examples/_records.py

STEPS = 4


def tiny_model():
    torch.manual_seed(0)  # the same initial weights on every rank
    config = BartConfig(vocab_size=64, d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        encoder_layerdrop=0.5, decoder_layerdrop=0.5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2)
    return BartForConditionalGeneration(config)


def batches(rank):
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    for _ in range(STEPS):
        yield {"input_ids": torch.randint(3, 64, (4, 12), generator=g), "labels": torch.randint(3, 64, (4, 8), generator=g)}


def train(patched):
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=not patched)],  # False: the default
    )
    model = tiny_model()
    if patched:
        report = mb_hf.patch(model)  # before accelerator.prepare wraps it
        accelerator.print(report)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    grads, ran = [], []
    hooks = [layer.register_forward_hook(lambda *_, k=(stack, i): ran[-1].append(k))
             for stack in ("encoder", "decoder")
             for i, layer in enumerate(getattr(accelerator.unwrap_model(model).model, stack).layers)]
    for step, batch in enumerate(batches(rank)):
        torch.manual_seed(1000 * step + rank)  # each rank draws its own LayerDrop
        ran.append([])
        loss = model(**{k: v.to(accelerator.device) for k, v in batch.items()}).loss
        accelerator.backward(loss)
        grads.append({n: None if p.grad is None else p.grad.detach().cpu().clone()
                      for n, p in accelerator.unwrap_model(model).named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    params = {n: p.detach().cpu().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    return accelerator, {"grads": grads, "params": params, "ran": ran}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", action="store_true", help="also train HF's model with find_unused_parameters=True")
    parser.add_argument("--out", help="save each rank's records to OUT.rank<r>.pt")
    args = parser.parse_args()
    records = {}
    if args.compare:
        records["reference"] = train(False)[1]
    accelerator, records["patched"] = train(True)
    if args.out:
        torch.save(records, f"{args.out}.rank{accelerator.process_index}.pt")
    everyone = accelerator.gather_for_metrics([records["patched"]], use_gather_object=True)
    accelerator.print(f"gradients and parameters equal on all {len(everyone)} ranks: {all(same(everyone[0], e) for e in everyone)}")
    if args.compare:
        accelerator.print(f"equal to HF's model with find_unused_parameters=True: {same(records['reference'], records['patched'])}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
