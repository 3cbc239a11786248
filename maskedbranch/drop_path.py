"""DropPath / stochastic depth on a branch output: drop-in replacements for timm's ``drop_path``
/ ``DropPath`` (the same formula, draws, strides and repr) and torchvision's
``stochastic_depth`` / ``StochasticDepth`` (``mode="batch"``).

The branch already ran, so these forms cannot skip its compute; the residual forms, which own
the branch and skip it, are in maskedbranch/residual.py (``ResidualDropPath``,
``drop_add_residual``).

Semantics are timm's and torchvision's: Bernoulli(keep_prob) per row (``mode="row"``) or per
call (``"batch"``), scaled by ``1 / keep_prob`` when ``scale_by_keep`` and ``keep_prob > 0``;
the identity in eval mode or at ``drop_prob == 0``; ``drop_prob == 1`` drops everything. The
mask is drawn where timm draws it (a tensor on x's device, from that device's default
generator), so that it equals timm's for the same seed; ``generator=`` (a CPU
``torch.Generator``) draws on the host instead.

The positional arguments are timm's (``drop_prob``, ``training``, ``scale_by_keep``); the settings
timm lacks are keyword-only (maskedbranch/_drop_args.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from . import _draws
from ._drop_args import (
    check_bool,
    check_drop_prob,
    check_generator,
    check_mode,
    check_x,
    refuse_positional,
    training_flag,
)

__all__ = ["drop_path", "DropPath", "stochastic_depth", "StochasticDepth"]


def _settings(scale_by_keep: Any, mode: Any, generator: Any):
    return check_bool(scale_by_keep, "scale_by_keep"), check_mode(mode), check_generator(generator)


def drop_path(
    x: Tensor,
    drop_prob: float = 0.0,
    training: bool = False,
    scale_by_keep: bool = True,
    *extra: Any,
    mode: str = "row",
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Stochastic depth on a branch output ``x``: timm's ``drop_path`` (``mode="row"``, the
    default) and torchvision's ``stochastic_depth`` (``mode="batch"`` drops the whole tensor).

    ``drop_path(x, drop_prob, training, scale_by_keep=True, *, mode="row", generator=None)``:
    timm's signature, with the settings it lacks keyword-only.
    Returns ``x`` itself in eval mode or at ``drop_prob == 0``; otherwise ``x * mask`` with the
    mask drawn and scaled exactly as timm draws and scales it (so the results are bitwise equal
    for the same seed, and the output keeps x's strides). ``generator``: a CPU
    ``torch.Generator`` to draw from instead (the mask is then shipped to x's device).

    The branch that produced ``x`` already ran: use :func:`maskedbranch.drop_add_residual` to
    skip it.
    """
    check_x(x)
    p = check_drop_prob(drop_prob)
    training = training_flag(training, "drop_path")  # first: torchvision's order has a string here
    refuse_positional("drop_path", extra)
    scale_by_keep, mode, generator = _settings(scale_by_keep, mode, generator)
    return _drop(x, p, training, scale_by_keep, mode, generator)


def _drop_path(x: Tensor, drop_prob: float, training: bool, scale_by_keep: bool, mode: str,
               mask: Optional[Tensor] = None) -> Tensor:
    """The drop-path formula, timm's to the bit, written once: eager mode, torch.fx (which
    records its ops, as timm's), TorchScript (``DropPath`` scripts it) and torch.compile (the
    residual forms' and the timm patch's dense form) all run it. ``mask``: a draw made on the
    host (``_draws.draw``: ``[B]`` in "row" mode, ``[1]`` in "batch" mode, 0/1); None: drawn here,
    on x's device from its default generator, where timm draws."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1) if mode == "row" else (1,) * x.ndim
    if mask is None:
        m = x.new_empty(shape).bernoulli_(keep_prob)
    else:  # a tensor of its own, in x's dtype: the division below is in place
        m = mask.to(device=x.device, dtype=x.dtype, non_blocking=True, copy=True).reshape(shape)
    if keep_prob > 0.0 and scale_by_keep:
        # The result is used, so that a torch.fx graph keeps the division: dead-code
        # elimination (create_feature_extractor runs it) drops an in-place op whose result is unused.
        m = m.div_(keep_prob)
    return x * m


def _drop(x: Tensor, p: Any, training: bool, scale_by_keep: bool, mode: str, generator: Optional[torch.Generator]) -> Tensor:
    """:func:`_drop_path` with the mask drawn on the host from ``generator`` when one is given
    (nothing drawn when nothing is dropped, so the generator stays where it was)."""
    mask = None
    if generator is not None and training and p != 0.0:
        mask = _draws.draw(x.shape[0] if mode == "row" else 1, 1.0 - p, generator)
    return _drop_path(x, p, training, scale_by_keep, mode, mask)


def _leaf_call(module: nn.Module, x: Any) -> Any:
    """In torchvision's feature extraction (its tracers treat the modules of torchvision.ops,
    StochasticDepth among them, as leaves), one ``call_module`` node for ``module``, as a leaf
    gives; None elsewhere (plain ``torch.fx`` traces the formula, as for timm's DropPath)."""
    tracer = getattr(x, "tracer", None)
    if not any(c.__module__.startswith("torchvision.") for c in type(tracer).__mro__):
        return None
    try:
        path = tracer.path_of_module(module)
    except (AttributeError, NameError):
        return None
    return tracer.create_proxy("call_module", path, (x,), {})


class DropPath(nn.Module):
    """Module form of :func:`drop_path`; a drop-in swap for timm's ``DropPath`` (same attributes,
    repr and results: the repr shows ``drop_prob`` as timm's does, never ``scale_by_keep``, and
    ``mode`` / ``generator`` only when they are not the default) with torchvision's ``mode="batch"`` as well:
    ``DropPath(drop_prob=0.0, scale_by_keep=True, *, mode="row", generator=None)``: timm's
    signature, with the settings it lacks keyword-only.

    ``torch.jit.script`` compiles the module itself (as it compiles timm's): the same formula,
    drawing from the default generator of x's device. Symbolic tracing (``torch.fx``) records
    the formula's ops, as for timm's; torchvision's feature extraction records the module as one
    node (a leaf), as it records torchvision's ``StochasticDepth``.
    """

    def __init__(
        self,
        drop_prob: float = 0.0,
        scale_by_keep: bool = True,
        *extra: Any,
        mode: str = "row",
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        refuse_positional("DropPath", extra)
        self.drop_prob = check_drop_prob(drop_prob)
        self.scale_by_keep, self.mode, self.generator = _settings(scale_by_keep, mode, generator)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone
            return _drop_path(x, float(self.drop_prob), self.training, self.scale_by_keep, self.mode)
        if isinstance(x, torch.fx.Proxy):
            node = _leaf_call(self, x)
            if node is not None:
                return node
        check_x(x)
        return _drop(x, check_drop_prob(self.drop_prob), self.training, self.scale_by_keep, check_mode(self.mode), self.generator)

    def extra_repr(self) -> str:
        # timm's repr for every setting timm has (it never shows scale_by_keep); the settings of
        # our own (mode, generator) only where they are not the default.
        s = f"drop_prob={round(self.drop_prob, 3):0.3f}"
        if self.mode != "row":
            s += f", mode={self.mode}"
        if self.generator is not None:
            s += f", generator=torch.Generator({str(self.generator.device)!r})"
        return s

    def __prepare_scriptable__(self) -> nn.Module:
        # The module scripts as it is (a replacement returned here would also take its place in
        # the Python model). TorchScript types attributes by value: a numpy scalar has no type.
        if not isinstance(self.drop_prob, (int, float)):
            self.drop_prob = float(self.drop_prob)
        return self


# ----------------------------------------------------------------------------------------------
# torchvision's spelling.


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """torchvision's ``stochastic_depth(input, p, mode, training=True)``, argument for argument
    (``mode`` is "row" or "batch"); the same results as torchvision's for the same seed."""
    check_x(input)
    return _drop_path(input, check_drop_prob(p), training_flag(training, "stochastic_depth"), True, check_mode(mode))


class StochasticDepth(DropPath):
    """torchvision's ``StochasticDepth(p, mode)``: a :class:`DropPath` with torchvision's
    argument names, attributes (``p``, ``mode``) and repr (``StochasticDepth(p=0.5, mode=row)``)."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__(p, mode=mode)

    @property
    def p(self) -> Any:
        return self.drop_prob

    @p.setter
    def p(self, value: Any) -> None:
        self.drop_prob = check_drop_prob(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p}, mode={self.mode})"

    def extra_repr(self) -> str:
        return ""  # torchvision's module has none (its __repr__ says everything)
