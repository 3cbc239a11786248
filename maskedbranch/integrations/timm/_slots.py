"""One converted drop path of a timm block at run time: the function the block's rewritten
forward calls in its place (maskedbranch/integrations/timm/_blocks.py makes the forward).

A residual ``add(base, tail(dp(y)))`` becomes ``drop_add_residual(base, branch, ...)``; any other
use of ``dp(y)`` becomes :func:`masked`, the branch's output on the kept samples and zeros
elsewhere. Both draw and compile through the residual forms' one dispatch
(maskedbranch/residual.py, ``dispatch``), so a compiled model draws exactly as an eager one, and
both compile whole.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx, nn

from ... import _route, _structure, _unit
from ...drop_path import DropPath as _MaskedDropPath
from ...residual import add_residual, dispatch
from . import _graph

try:
    from timm.layers import DropPath as _TimmDropPath
except ImportError:  # pragma: no cover - the package imports timm first
    _TimmDropPath = ()

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def is_drop_path(m: nn.Module) -> bool:
    """timm's DropPath (or a subclass keeping its forward) or maskedbranch's."""
    if isinstance(m, _MaskedDropPath):
        return True
    return isinstance(m, _TimmDropPath) and type(m).forward is _TimmDropPath.forward


def drop_settings(dp: nn.Module) -> Optional[Tuple[Any, bool, str, bool, Optional[torch.Generator]]]:
    """(drop_prob, training, mode, scale_by_keep, generator) of a drop-path slot; None for a
    module that is not a drop path (the slot was replaced after patching)."""
    if isinstance(dp, nn.Identity):
        return 0.0, False, "row", True, None
    if isinstance(dp, _MaskedDropPath):
        return dp.drop_prob, dp.training, dp.mode, dp.scale_by_keep, dp.generator
    if is_drop_path(dp):
        return dp.drop_prob, dp.training, "row", bool(getattr(dp, "scale_by_keep", True)), None
    return None


def uses_batch_stats(m: nn.Module) -> bool:
    """A normalization whose output depends on the other samples of the batch right now."""
    if isinstance(m, _BATCH_NORMS):
        return m.training or m.running_mean is None
    return type(m).__name__.startswith("EvoNorm2dB") and m.training  # timm's batch-variance EvoNorms


def batch_stats_type(m: nn.Module) -> bool:
    return isinstance(m, _BATCH_NORMS) or type(m).__name__.startswith("EvoNorm2dB")


def slot_call(
    block: nn.Module, state: Any, slot: _graph.Slot, tainted: Set[fx.Node], dense: Callable, routed: Callable,
    output: Optional[Tuple[tuple, torch.dtype]],
) -> Callable:
    """The function that replaces one drop path: ``call(block, base, *inputs)`` for a residual,
    ``call(block, *inputs)`` for the masked form. Shared by every block of one structure
    (blocks of a model share their rewrite's code), so it reads the block it is given."""
    dp_path, residual = slot.dp, slot.add is not None
    x_index = slot.inputs.index(slot.base) if residual and slot.base in slot.inputs else None
    row_idx = tuple(i for i, n in enumerate(slot.inputs) if n in tainted and i != x_index)
    bn_paths = [
        f"{m}.{n}" if n else m
        for m in slot.modules for n, sub in block.get_submodule(m).named_modules() if batch_stats_type(sub)
    ]
    module_paths, param_paths = list(slot.modules), list(slot.params)

    def parameters(blk: nn.Module) -> Tuple[Tensor, ...]:
        """The branch's parameters in ``blk``, read when a call needs them (no cache, so
        nothing of this block's becomes a guard in a compiled graph)."""
        params = tuple(p for m in module_paths for p in blk.get_submodule(m).parameters())
        return params + tuple(blk.get_parameter(p) for p in param_paths)

    def call(blk: nn.Module, *args: Any) -> Tensor:
        base, inputs = (args[0], args[1:]) if residual else (None, args)
        settings = drop_settings(blk.get_submodule(dp_path))
        bns = [blk.get_submodule(p) for p in bn_paths]
        read_params = functools.partial(parameters, blk)  # called only where a call ties them
        if (
            settings is None or not settings[1] or settings[0] == 0
            or (bns and blk.__dict__["_maskedbranch_timm"].batch_norm == "dense" and any(uses_batch_stats(m) for m in bns))
        ):  # timm's operations: its drop path is the identity, or BatchNorm needs every sample
            return dense(blk, *inputs) if base is None else base + dense(blk, *inputs)
        per_row = [inputs[i] for i in row_idx]
        lead = base if residual else (per_row[0] if per_row else None)
        batch = lead.shape[0] if isinstance(lead, Tensor) and lead.dim() > 0 else None
        if batch is None or any(not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != batch for t in per_row):
            blk.__dict__["_maskedbranch_timm"].warn(blk, f"feeds the branch of {dp_path} a value whose first dimension is not the batch")
            return dense(blk, *inputs) if base is None else base + dense(blk, *inputs)

        def branch(h: Tensor, *rows: Tensor) -> Tensor:
            full = list(inputs)
            idx = row_idx if residual else row_idx[1:]
            for i, r in zip(idx, rows):
                full[i] = r
            if residual and x_index is not None:
                full[x_index] = h
            elif not residual:
                full[row_idx[0]] = h
            return routed(blk, *full)

        p, _, mode, scale_by_keep, generator = settings
        materialize = blk.__dict__["_maskedbranch_timm"].materialize
        stateless = not any(uses_batch_stats(m) for m in bns)  # else: batch_norm="kept", training
        if residual:
            return add_residual(base, branch, p, True, mode, scale_by_keep, generator, "random", per_row, None,
                                None, materialize, module=False, owner=blk, stateless=stateless, read_params=read_params)
        return masked(blk, lead, branch, p, mode, scale_by_keep, generator, per_row[1:], read_params, output, stateless)

    call.__name__ = call.__qualname__ = "drop_path_" + dp_path.replace(".", "_")
    return call


def masked(blk, x, branch, p, mode, scale_by_keep, generator, rest, read_params, output, stateless=True) -> Tensor:
    """``drop_path(branch(x, *rest))`` without a residual: the branch runs on the kept rows,
    the dropped rows are zeros (timm's values, and zero gradients for the parameters). The draw
    and the compiled forms are the residual forms' (maskedbranch/residual.py, ``dispatch``).
    ``read_params()`` gives the branch's parameters."""
    compiling = torch.compiler.is_compiling()
    out, _, gate, scale = dispatch(_structure.CheckedBranch(branch, False), x, None, tuple(rest), {}, p, mode,
                                   scale_by_keep, generator, output[1], lambda: _unit.traced_tying(blk), stateless,
                                   output)
    if out is not None:
        return out
    tie = _unit.traced_tying(blk) if compiling else blk._unit.tying_here()  # the block's setting: zeros or none
    # compiled, every branch is in the graph
    params = read_params() if not compiling or tie is _unit.Tying.ALIASES else ()
    if not compiling and (gate == -1 if isinstance(gate, int) else not bool((gate >= 0).any())):
        out = torch.zeros((x.shape[0], *output[0]), dtype=output[1], device=x.device)
        return _route.tie_unrun(out, tie, params, (x, *rest))
    table = _structure.Branches([branch], params=[params])
    return _route.route(table, x, gate, tuple(rest), {}, _route.Call(tie, scale=scale, where="branch", drawn=True))[0]


def check_branches(block: nn.Module, slots: Sequence[_graph.Slot], name: str) -> None:
    for s in slots:
        _structure.check_skippable([block.get_submodule(m) for m in s.modules], f"{name}: the branch of {s.dp}")

