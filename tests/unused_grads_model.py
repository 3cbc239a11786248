"""The model the pruning tests train (tests/test_unused_grads.py in one process,
tests/test_unused_grads_ddp.py on two ranks): two routed layers between a trunk and a head, its
data, loss and optimizer."""
import torch
from torch import nn

from maskedbranch import MaskedBranch, reference


N = 3
D = 6
ROWS = 8


def mlp():
    return nn.Sequential(nn.Linear(D, 10), nn.Tanh(), nn.Linear(10, D))


class Net(nn.Module):
    """Two routed layers between a trunk and a head; ``masked=False``: the if/else model."""

    def __init__(self, materialize=True, masked=True):
        super().__init__()
        self.masked = masked
        self.pre = nn.Linear(4, D)
        make = (lambda: MaskedBranch([mlp() for _ in range(N)], materialize_grads=materialize)) if masked else (
            lambda: nn.ModuleList(mlp() for _ in range(N)))
        self.layers = nn.ModuleList(make() for _ in range(2))
        self.head = nn.Linear(D, 2)

    def forward(self, x, gates):
        h = torch.tanh(self.pre(x))
        for layer, gate in zip(self.layers, gates):
            y = layer(h, gate) if self.masked else reference.masked_branch_ifelse(list(layer), h, gate)
            h = h + (0 if y is None else y)
        return self.head(h)


def data(step, rank=0):
    g = torch.Generator().manual_seed(10_000 + step * 17 + rank)
    return torch.randn(ROWS, 4, generator=g, dtype=torch.float64), torch.randn(ROWS, 2, generator=g, dtype=torch.float64)


def loss_of(model, step, gates, rank=0):
    x, t = data(step, rank)
    return (model(x, gates) - t).square().mean()


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2)


def grads_none(module):
    return [p.grad is None for p in module.parameters()]
