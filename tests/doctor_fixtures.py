"""Model factories for ``python -m maskedbranch.doctor`` (used by tests/test_doctor.py, and examples
of the factory contract): ``python -m maskedbranch.doctor doctor_fixtures:reference`` with this
folder on PYTHONPATH."""
import torch
from torch import nn

import maskedbranch


def _linear(value: float = 1.0) -> nn.Linear:
    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


class IfElse(nn.Module):
    """The reference case: rank r feeds r + 1 ones, through layer1 when r is odd (an even batch),
    through layer2 when r is even."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = _linear()
        self.layer2 = _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2 == 0:
            return self.layer1(x)
        return self.layer2(x)


class MaskedIfElse(nn.Module):
    """The same routing with maskedbranch.MaskedBranch: both layers stay in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = maskedbranch.MaskedBranch([_linear(), _linear()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x, 0 if x.shape[0] % 2 == 0 else 1)


class WithUnusedHead(nn.Module):
    """``extra`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class RandomLayerDrop(nn.Module):
    """LayerDrop with a Python ``if`` on a random draw: which blocks run differs per rank."""

    def __init__(self, depth: int = 4, p: float = 0.5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if not self.training or torch.rand(()) >= self.p:
                x = x + block(x)
        return x


class Supernet(nn.Module):
    """One of four choices per call, picked by the caller (random in a supernet job). With
    ``plain=True`` the choices are an nn.ModuleList called as ``choices[i](x)`` (if/else);
    ``unused_head=True`` adds a layer that is never called."""

    def __init__(self, plain: bool = False, unused_head: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        layers = [nn.Linear(4, 4) for _ in range(4)]
        self.choices = nn.ModuleList(layers) if plain else maskedbranch.MaskedBranch(layers)
        self.plain = plain
        if unused_head:
            self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        h = self.stem(x)
        return self.choices[choice](h) if self.plain else self.choices(h, choice)


class NotCalled(nn.Module):
    """A MaskedBranch that the forward never calls (left over from a refactoring)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.choices = maskedbranch.MaskedBranch([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Bypassed(nn.Module):
    """A MaskedBranch whose branches the forward calls directly, as the ModuleList it replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.choices = maskedbranch.MaskedBranch([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        return self.choices[choice](x)


class PartlyCalled(Supernet):
    """Calls its MaskedBranch only when the choice is not negative."""

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        return super().forward(x, choice) if choice >= 0 else self.stem(x)


class Nested(nn.Module):
    """A Supernet (a MaskedBranch inside) as branch 1 of a MaskedBranch that always runs branch 0."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = maskedbranch.MaskedBranch([nn.Linear(4, 4), Supernet()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(x, 0)


class ResidualStack(nn.Module):
    """LayerDrop with ResidualDropPath (whole batch dropped or kept, if/else gradient semantics)."""

    def __init__(self, depth: int, drop_prob: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            maskedbranch.ResidualDropPath(nn.Linear(4, 4), drop_prob, mode="batch", materialize_grads=None)
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.view(3, 5))  # a shape bug


def _half_square(out: torch.Tensor) -> torch.Tensor:
    return (0.5 * out**2).sum()


def reference():
    """(model, [inputs per rank], loss_fn): layer1 and layer2 diverge across the 4 ranks."""
    return IfElse(), [torch.ones(r + 1, 1) for r in range(4)], _half_square


def masked_reference():
    return MaskedIfElse(), [torch.ones(r + 1, 1) for r in range(4)], _half_square


def all_used():
    """(model, inputs): a model that uses every parameter; every rank feeds the same inputs."""
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)


def unused_head():
    """A dict with make_inputs(rank)."""
    return {"model": WithUnusedHead(), "make_inputs": lambda rank: torch.randn(rank + 1, 4)}


def layer_drop():
    return RandomLayerDrop(), (torch.randn(2, 4),)


def broken():
    return Broken(), torch.randn(2, 4)


def keyword_inputs():
    """Per-rank inputs built with maskedbranch.doctor.Inputs and a keyword argument."""
    from maskedbranch.doctor import Inputs

    return Supernet(), lambda rank: Inputs(torch.randn(2, 4), choice=rank % 4)


def not_called():
    return NotCalled(), torch.randn(2, 4)


def not_a_model():
    return 42
