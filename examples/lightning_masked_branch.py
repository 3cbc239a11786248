"""A model that routes each rank's batch to one of three experts (MaskedBranch), trained by Lightning
with ``strategy="ddp"`` (find_unused_parameters=False).

    python examples/lightning_masked_branch.py                        # Lightning starts 2 processes
    torchrun --standalone --nproc_per_node=2 examples/lightning_masked_branch.py --compare

With if/else routing (``self.experts[gate](h)``) the experts a rank did not use get no gradient
there, so Lightning needs ``strategy="ddp_find_unused_parameters_true"``. ``MaskedBranch`` is the
same ``nn.ModuleList`` (same state_dict keys) that skips the unused experts' compute and still
gives their parameters a gradient, so the plain ``strategy="ddp"`` works.

--compare first trains the if/else model with ddp_find_unused_parameters_true, then the
MaskedBranch model with ddp, and checks that the gradients of every step and the final
parameters are equal on every rank. --out PATH saves each rank's records to PATH.rank<r>.pt.
"""
import argparse

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from maskedbranch import MaskedBranch

from _records import same  # examples/_records.py

STEPS = 6
EXPERTS = 3


class Routed(L.LightningModule):
    def __init__(self, masked):
        super().__init__()
        self.masked = masked
        self.grads = []

    def configure_model(self):
        # Made here, where Lightning has started the distributed job and not yet built DDP: the
        # DDP built around it is seen being built and leaves the experts to maskedbranch (made in
        # __init__, before the job, DDP would keep them, at a cost per idle expert and step).
        if hasattr(self, "head"):
            return
        torch.manual_seed(0)  # the same initial weights on every rank
        self.pre = nn.Linear(8, 16)
        experts = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(EXPERTS)]
        self.experts = MaskedBranch(experts) if self.masked else nn.ModuleList(experts)
        self.head = nn.Linear(16, 4)

    def forward(self, x, gate):
        h = torch.tanh(self.pre(x))
        y = self.experts(h, gate) if self.masked else self.experts[gate](h)
        return self.head(h + y)

    def training_step(self, batch, batch_idx):
        x, target = batch
        gate = (self.global_step + self.global_rank) % EXPERTS  # ranks differ; one expert idle each step
        return nn.functional.cross_entropy(self(x, gate), target)

    def on_before_optimizer_step(self, optimizer):
        self.grads.append({n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in self.named_parameters()})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def data():
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, target), batch_size=8)


def train(masked):
    model = Routed(masked)
    trainer = L.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "gpu", devices=2, max_steps=STEPS,
        strategy="ddp" if masked else "ddp_find_unused_parameters_true",  # "ddp": the one setting
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=True,
    )
    trainer.fit(model, data())
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return trainer, {"grads": model.grads, "params": params}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", action="store_true", help="also train the if/else model with find_unused_parameters=True")
    parser.add_argument("--out", help="save each rank's records to OUT.rank<r>.pt")
    args = parser.parse_args()
    records = {}
    if args.compare:
        records["reference"] = train(masked=False)[1]
    trainer, records["patched"] = train(masked=True)
    rank = trainer.global_rank
    if args.out:
        torch.save(records, f"{args.out}.rank{rank}.pt")
    everyone = [None] * trainer.world_size
    dist.all_gather_object(everyone, records["patched"])
    if rank == 0:
        print(f"gradients and parameters equal on all {len(everyone)} ranks: {all(same(everyone[0], e) for e in everyone)}")
        if args.compare:
            print(f"equal to the if/else model with find_unused_parameters=True: {same(records['reference'], records['patched'])}")


if __name__ == "__main__":
    main()
