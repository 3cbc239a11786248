"""Autograd for the routing ops: ``torch.autograd.Function``s, each written once in the
``setup_context`` form, with a classic-form twin for eager calls (:func:`_two_forms`; docs/design.md,
"Autograd in Python Functions, in two forms"). Tied tensors get an undefined gradient, or zeros
when ``zeros`` is set (docs/design.md, "Words" and "Dead parameters").
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.autograd import Function

from . import _compat
from ._ops import ops


def _two_forms(cls):
    """Give a ``setup_context``-form Function an ``apply`` that picks the classic form in eager
    mode and the torch.func form under torch.func transforms and torch.compile."""

    def forward(ctx, *args):
        out = cls.forward(*args)
        cls.setup_context(ctx, args, out)
        return out

    # Named at creation: Function's metaclass names the backward node class then, and profiles,
    # errors and graphs show that name.
    name = cls.__name__ + "Classic"
    Classic = type(name, (Function,), {"forward": staticmethod(forward), "backward": staticmethod(cls.backward),
                                       "__qualname__": name, "__module__": cls.__module__})
    cls.classic = Classic

    def apply(*args):
        if torch.compiler.is_compiling() or _compat.functorch_active():
            return cls.apply(*args)
        return Classic.apply(*args)

    cls.route = staticmethod(apply)
    return cls


ZEROS_WHEN_COMPILED = 2
"""A ``zeros`` setting for tied non-leaf inputs: undefined gradients, except zeros while compiled
autograd traces the backward (it cannot add an undefined gradient to the other gradients of a
tensor with several consumers)."""


TensorMeta = Tuple[torch.Size, torch.dtype, torch.device]


def _tied_meta(tensors: Sequence[Tensor], zeros: Union[bool, int]) -> Union[int, List[TensorMeta]]:
    """What the backward needs to know of the tied tensors: their metadata when it may have to
    make zeros for them, else only their count (reading every dead parameter's metadata would
    be most of a tie's cost)."""
    if not zeros:
        return len(tensors)
    return [(t.shape, t.dtype, t.device) for t in tensors]


def _tied_grads(ctx, first: int, tied: Union[int, List[TensorMeta]]) -> List[Optional[Tensor]]:
    """The gradients of the tied tensors (inputs ``first``, ``first + 1``, ...); ``tied`` is
    what :func:`_tied_meta` kept."""
    if isinstance(tied, int):
        return [None] * tied
    if ctx.zeros == ZEROS_WHEN_COMPILED and not _compat.compiled_autograd_tracing():
        return [None] * len(tied)
    needs = ctx.needs_input_grad
    return [
        torch.zeros(shape, dtype=dtype, device=device) if needs[first + k] else None
        for k, (shape, dtype, device) in enumerate(tied)
    ]


@_two_forms
class Gather(Function):
    """``apply(x, rows, row_offsets, row_branch, row_pos, counts)`` -> one tensor per branch."""

    @staticmethod
    def forward(x, rows, row_offsets, row_branch, row_pos, counts):
        return tuple(ops.gather(x, rows, None, counts))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, rows, row_offsets, row_branch, row_pos, counts = inputs
        ctx.save_for_backward(row_offsets, row_branch, row_pos)
        ctx.counts = counts
        ctx.row_meta = (x.shape[1:], x.dtype, x.device)  # metadata only: no reference cycle

    @staticmethod
    def backward(ctx, *grads):
        row_offsets, row_branch, row_pos = ctx.saved_tensors
        trailing, dtype, device = ctx.row_meta
        grads = [
            g if g is not None else torch.zeros((c, *trailing), dtype=dtype, device=device)
            for g, c in zip(grads, ctx.counts)
        ]
        grad_x = ops.combine(None, grads, None, row_offsets, row_branch, row_pos)
        return grad_x, None, None, None, None, None


@_two_forms
class Combine(Function):
    """``apply(base, weights, rows, row_offsets, row_branch, row_pos, num_ys, zeros, *ys, *tied)``
    -> ``base + sum_i weights[:, i] * scatter(ys[i])``, with ``tied`` tied into its graph."""

    @staticmethod
    def forward(base, weights, rows, row_offsets, row_branch, row_pos, num_ys, zeros, *tensors):
        ys = list(tensors[:num_ys])
        return ops.combine(base, ys, None if weights is None else weights.detach(), row_offsets, row_branch, row_pos)

    @staticmethod
    def setup_context(ctx, inputs, output):
        base, weights, rows, row_offsets, row_branch, row_pos, num_ys, zeros, *tensors = inputs
        ys, tied = tensors[:num_ys], tensors[num_ys:]
        ctx.num_ys, ctx.zeros, ctx.tied = num_ys, zeros, _tied_meta(tied, zeros)
        ctx.counts = [y.shape[0] for y in ys]
        ctx.has_weights = weights is not None
        ctx.weights_dtype = None if weights is None else weights.dtype
        # ys are needed only for the weights' gradient: don't keep them alive otherwise.
        keep_ys = weights is not None and weights.requires_grad
        ctx.save_for_backward(weights, rows, row_offsets, row_branch, row_pos, *(ys if keep_ys else ()))

    @staticmethod
    def backward(ctx, grad):
        weights, rows, row_offsets, row_branch, row_pos, *ys = ctx.saved_tensors
        needs = ctx.needs_input_grad
        first_y = 8
        grad_base = grad if needs[0] else None
        grad_ys: List[Optional[Tensor]] = [None] * ctx.num_ys
        if any(needs[first_y : first_y + ctx.num_ys]):
            w = None if weights is None else weights.detach()
            grad_ys = list(ops.gather(grad, rows, w, ctx.counts))
        grad_weights = None
        if ctx.has_weights and needs[1]:
            grad_weights = ops.combine_weights_backward(grad, ys, row_offsets, row_branch, row_pos)
            grad_weights = grad_weights.to(ctx.weights_dtype)
        tied = _tied_grads(ctx, first_y + ctx.num_ys, ctx.tied)
        return (grad_base, grad_weights, None, None, None, None, None, None, *grad_ys, *tied)


@_two_forms
class Tie(Function):
    """``apply(x, zeros, *tied)`` -> a copy of ``x`` (same layout) whose backward also reaches
    ``tied``. A copy rather than a view, so that the caller may modify it in place."""

    @staticmethod
    def forward(x, zeros, *tied):
        return x.clone(memory_format=torch.preserve_format)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, zeros, *tied = inputs
        ctx.zeros, ctx.tied = zeros, _tied_meta(tied, zeros)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *_tied_grads(ctx, 2, ctx.tied))


@_two_forms
class Alias(Function):
    """``apply(x, *params)`` -> a copy of ``x`` and a view of each parameter, for the branches to
    run on under DDP's Python reducer (maskedbranch/_route.py): every parameter's gradient then
    leaves the graph at this one node, in order, zeros where no branch used it."""

    @staticmethod
    def forward(x, *params):
        return (x.clone(memory_format=torch.preserve_format), *(p.view_as(p) for p in params))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass  # unused outputs' gradients arrive as zeros (materialize_grads, the default)

    @staticmethod
    def backward(ctx, *grads):
        return grads


@_two_forms
class Pick(Function):
    """``apply(index, branches, *tensors)`` -> copies of the chosen branch's tensors
    (``tensors``: k per branch, branch after branch); backward: the gradient to the chosen
    branch's tensors, zeros to the others'. Only compiled graphs call it (the stacked choices of
    maskedbranch/_choice.py); why a Function: docs/design.md, "Compiled whole-batch choices"."""

    @staticmethod
    def forward(index, branches, *tensors):
        return tuple(ops.pick(list(tensors), index, branches))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.branches = inputs[1]

    @staticmethod
    def backward(ctx, *grads):
        (index,) = ctx.saved_tensors
        return (None, None, *ops.pick_backward(list(grads), index, ctx.branches))


# ----------------------------------------------------------------------------------------------
# Differentiable calls with the plan as one object.


def gather(x: Tensor, plan) -> List[Tensor]:
    return list(Gather.route(x, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos, plan.counts))


def combine(
    ys: Sequence[Tensor],
    plan,
    weights: Optional[Tensor] = None,
    base: Optional[Tensor] = None,
    tied: Sequence[Tensor] = (),
    zeros: bool = False,
) -> Tensor:
    return Combine.route(
        base, weights, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos, len(ys), zeros, *ys, *tied
    )


def tie(x: Tensor, tied: Sequence[Tensor], zeros: Union[bool, int] = False) -> Tensor:
    return Tie.route(x, zeros, *tied)


def alias(x: Tensor, params: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    return Alias.route(x, *params)


def pick(tensors: Sequence[Tensor], index: Tensor, branches: int) -> Tuple[Tensor, ...]:
    return Pick.route(index, branches, *tensors)


def tie_outputs(output: Any, dead: Sequence[Tensor], zeros: bool) -> Any:
    """``output`` with every tensor that requires grad replaced by a copy whose backward also
    reaches ``dead`` (one node per tensor; the backward calls each parameter's hook once, from
    the first it reaches). Tuples, lists, dicts (HF ModelOutputs) as the model made them."""
    if isinstance(output, Tensor):
        return tie(output, dead, zeros) if output.requires_grad else output
    if isinstance(output, dict):  # in place: an HF ModelOutput keeps its attributes in step
        for k, v in list(output.items()):
            new = tie_outputs(v, dead, zeros)
            if new is not v:
                output[k] = new
        return output
    if isinstance(output, list):
        for i, v in enumerate(output):
            output[i] = tie_outputs(v, dead, zeros)
        return output
    if isinstance(output, tuple):
        items = [tie_outputs(v, dead, zeros) for v in output]
        if all(a is b for a, b in zip(items, output)):
            return output
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    return output
