"""The models the suites time: MLP branches, the routed residual MLP stack of the DDP suite, and a
single-path one-shot NAS supernet (ShuffleNetV2 choice blocks, as in SPOS: Guo et al., 2020).

A routed model is the same class for every contender: ``MaskedBranch`` is the ``nn.ModuleList``
that if/else code indexes, so ``layer(x, k)`` (routed) and ``layer[k](x)`` (if/else) run the same
parameters, initialized alike from the same seed.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor, nn

from maskedbranch import MaskedBranch


def mlp(d: int, h: int) -> nn.Module:
    """Linear(d, h) -> GELU -> Linear(h, d): a transformer MLP / a mixture-of-experts expert."""
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))


def route(layer: nn.ModuleList, x: Tensor, k: int, kind: str) -> Tensor:
    """One routed layer: ``"masked"`` calls the MaskedBranch, ``"if/else"`` the chosen branch,
    ``"dense"`` every branch times a one-hot coefficient (the 0/1 trick: every parameter is used)."""
    if kind == "masked":
        return layer(x, k)
    if kind == "dense":
        coef = torch.nn.functional.one_hot(torch.tensor(k), len(layer)).to(x.dtype)
        return sum(coef[j] * br(x) for j, br in enumerate(layer))
    return layer[k](x)


def routed(branches: List[nn.Module], kind: str, materialize_grads=None) -> nn.ModuleList:
    if kind == "masked":
        return MaskedBranch(branches, materialize_grads=materialize_grads)
    return nn.ModuleList(branches)


class RoutedMLP(nn.Module):
    """``layers`` residual layers of ``n`` MLP branches d -> h -> d, one branch per layer and step.
    ``kind``: "masked", "if/else" or "dense" (every branch times a one-hot coefficient)."""

    def __init__(self, kind: str, layers: int, d: int, h: int, n: int = 4, materialize_grads=None):
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(routed([mlp(d, h) for _ in range(n)], kind, materialize_grads) for _ in range(layers))

    def forward(self, x: Tensor, path: Sequence[int]) -> Tensor:
        for layer, k in zip(self.layers, path):
            x = x + route(layer, x, k, self.kind)
        return x


# ----------------------------------------------------------------------------------------------
# The NAS supernet: 12 choice layers x 4 choices (ShuffleNetV2 blocks with 3x3, 5x5, 7x7 depthwise
# kernels and the Xception-like block), BatchNorm everywhere, as in Single Path One-Shot.


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, relu: bool = True) -> List[nn.Module]:
    mods: List[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return mods + [nn.ReLU(inplace=True)] if relu else mods


class ShuffleBlock(nn.Module):
    """A ShuffleNetV2 unit. Stride 1: channel shuffle, half the channels pass through, the other
    half go through the main branch. Stride 2: both halves see the whole input (a depthwise
    projection branch and the main branch), concatenated to ``cout`` channels."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, xception: bool = False):
        super().__init__()
        self.stride = stride
        if stride == 1:
            assert cin == cout, "a stride-1 unit keeps its width"
            inp, out = cin // 2, cout - cin // 2
            self.proj = None
        else:
            assert cout > cin, "a stride-2 unit widens: its main branch gives cout - cin channels"
            inp, out = cin, cout - cin
            self.proj = nn.Sequential(*_conv_bn(cin, cin, k, stride, groups=cin, relu=False), *_conv_bn(cin, cin, 1))
        mid = cout // 2
        if xception:  # three depthwise 3x3 + pointwise pairs
            main = _conv_bn(inp, inp, 3, stride, groups=inp, relu=False) + _conv_bn(inp, mid, 1)
            main += _conv_bn(mid, mid, 3, groups=mid, relu=False) + _conv_bn(mid, mid, 1)
            main += _conv_bn(mid, mid, 3, groups=mid, relu=False) + _conv_bn(mid, out, 1)
        else:  # pointwise -> depthwise k x k -> pointwise
            main = _conv_bn(inp, mid, 1) + _conv_bn(mid, mid, k, stride, groups=mid, relu=False) + _conv_bn(mid, out, 1)
        self.main = nn.Sequential(*main)

    def forward(self, x: Tensor) -> Tensor:
        if self.proj is not None:
            return torch.cat((self.proj(x), self.main(x)), 1)
        b, c, h, w = x.shape
        x = x.reshape(b, c // 2, 2, h, w).transpose(1, 2)  # channel shuffle: even / odd channels
        return torch.cat((x[:, 0], self.main(x[:, 1].contiguous())), 1)


CHOICES = ("shuffle 3x3", "shuffle 5x5", "shuffle 7x7", "xception")


def choice_layer(cin: int, cout: int, stride: int, kind: str) -> nn.ModuleList:
    blocks = [ShuffleBlock(cin, cout, k, stride) for k in (3, 5, 7)] + [ShuffleBlock(cin, cout, 3, stride, xception=True)]
    return routed(blocks, kind)


class Supernet(nn.Module):
    """Stem -> 12 choice layers in 3 stages (4 layers each; the first of a stage halves the
    resolution) -> 1x1 conv -> pooling -> classifier. ``forward(x, path)``: ``path[i]`` is layer
    i's choice, drawn per rank and step (single-path one-shot training). ``kind``: as for
    :func:`route` ("dense" also trains every choice's BatchNorm statistics)."""

    def __init__(self, kind: str, widths: Sequence[int] = (48, 96, 192), stem: int = 16, classes: int = 10, per_stage: int = 4):
        super().__init__()
        self.kind = kind
        self.stem = nn.Sequential(*_conv_bn(3, stem, 3))
        layers, cin = [], stem
        for w in widths:
            for j in range(per_stage):
                layers.append(choice_layer(cin, w, 2 if j == 0 else 1, kind))
                cin = w
        self.layers = nn.ModuleList(layers)
        self.head = nn.Sequential(*_conv_bn(cin, 2 * cin, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * cin, classes))

    def forward(self, x: Tensor, path: Sequence[int]) -> Tensor:
        x = self.stem(x)
        for layer, k in zip(self.layers, path):
            x = route(layer, x, k, self.kind)
        return self.head(x)


class ConvSupernet(nn.Module):
    """Stem -> ``layers`` choice layers of ``choices`` choices (a convolution of kernel
    ``kernels[i]``, BatchNorm when ``batch_norm``, ReLU) -> pooling -> classifier;
    ``forward(x, path)`` as :class:`Supernet`'s. Same-shaped choices (the default, 3x3 each) are
    one structure, which compiled MaskedBranch stacks; other kernels (3/5/7/3, a MobileNet-style
    search space) take one torch.cond per choice."""

    def __init__(self, kind: str, layers: int = 6, choices: int = 4, channels: int = 16, batch_norm: bool = True,
                 classes: int = 10, kernels: Sequence[int] = ()):
        super().__init__()
        self.kind = kind
        kernels = tuple(kernels) or (3,) * choices

        def choice(k: int) -> nn.Module:
            mods = [nn.Conv2d(channels, channels, k, padding=k // 2, bias=not batch_norm)]
            return nn.Sequential(*mods, *([nn.BatchNorm2d(channels)] if batch_norm else []), nn.ReLU())

        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(routed([choice(k) for k in kernels], kind) for _ in range(layers))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x: Tensor, path: Sequence[int]) -> Tensor:
        x = self.stem(x)
        for layer, k in zip(self.layers, path):
            x = route(layer, x, k, self.kind)
        return self.head(x)
