"""Thin wrappers over ``torch.ops.maskedbranch``: the routing plan, fake kernels for tracing and
autograd formulas (whose backwards are registered ops too).

The ops, in the order data flows through a masked layer (see DESIGN.md):

* :func:`make_plan` - gate -> routing plan (CSR by branch and by row);
* :func:`gather` - pack the rows of every branch into one buffer (:func:`gather_split`: and hand
  each branch its slice as a tensor of its own);
* :func:`combine` - ``out = base + sum_i w[:, i] * y_i`` read from the per-branch outputs;
* :func:`anchor` - tie parameters of branches that did not run into the graph;
* :func:`drop_path_scale` - ``out = base + scale[:, None] * y``, fused.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import _C

ops = torch.ops.maskedbranch

#: True when this build has CUDA kernels.
WITH_CUDA = bool(_C.WITH_CUDA)


class Plan(NamedTuple):
    """A routing plan for ``B`` rows and ``N`` branches with ``M`` live (row, branch) entries.

    ``counts`` (a list of ints) lives on the host, so slicing the packed buffer per branch
    never synchronizes; every tensor lives on the device of the activations.
    """

    counts: List[int]  # rows per branch, length N
    rows: Tensor  # [M] row ids grouped by branch, ascending within a branch
    row_offsets: Tensor  # [B + 1] CSR by row
    row_branch: Tensor  # [M] branch of each entry, CSR by row
    row_pos: Tensor  # [M] packed position of each entry, CSR by row

    @property
    def num_rows(self) -> int:
        return self.row_offsets.shape[0] - 1

    @property
    def num_entries(self) -> int:
        return self.rows.shape[0]


def check_device_supported(t: Tensor, name: str) -> None:
    """A clear error for a non-tensor, or for a CUDA tensor given to a CPU-only build."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.is_cuda and not WITH_CUDA:
        raise RuntimeError(
            f"{name}: got a CUDA tensor, but this maskedbranch build has no CUDA kernels (it was "
            "built without a CUDA-enabled torch or nvcc). Reinstall it where both are present, or "
            "with FORCE_CUDA=1 and TORCH_CUDA_ARCH_LIST set."
        )


def _ship(tensors: Sequence[Tensor], device: torch.device) -> List[Tensor]:
    """Copy host index tensors to ``device`` in one asynchronous transfer (pinned staging)."""
    if device.type == "cpu":
        return list(tensors)
    sizes = [t.numel() for t in tensors]
    host = torch.cat(list(tensors))
    if torch.cuda.is_available():
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split(sizes))


def make_plan(gate: Tensor, num_branches: int, device: Optional[torch.device] = None) -> Plan:
    """Build the routing plan of ``gate`` for ``num_branches`` branches.

    ``gate`` is either an integer tensor ``[B]`` of branch ids (-1 = no branch) or a bool or
    floating tensor ``[B, N]`` (nonzero = live). A host gate gives a host plan that is shipped to
    ``device`` without synchronizing; a device gate costs one readback (counts and validity).
    """
    if not isinstance(gate, Tensor):
        raise TypeError(f"gate: expected a tensor, got {type(gate).__name__}")
    check_device_supported(gate, "gate")
    offsets, rows, row_offsets, row_branch, row_pos = ops.plan(gate, num_branches)
    device = gate.device if device is None else torch.device(device)
    if device != gate.device:
        rows, row_offsets, row_branch, row_pos = _ship((rows, row_offsets, row_branch, row_pos), device)
    bounds = offsets.tolist()  # offsets always live on the host: no sync
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    return Plan(counts, rows, row_offsets, row_branch, row_pos)


def gather(x: Tensor, plan: Plan) -> Tensor:
    """Pack the routed rows of ``x``: ``packed[p] = x[plan.rows[p]]``; branch i owns the slice
    ``packed[start_i : start_i + counts[i]]``. Backward: a deterministic segmented sum."""
    check_device_supported(x, "x")
    return ops.gather(x, plan.rows, plan.row_offsets, plan.row_pos)


def gather_split(x: Tensor, plan: Plan) -> List[Tensor]:
    """Every branch's rows of ``x`` (``plan.counts[i]`` rows for branch i, in the plan's order),
    gathered by one kernel into one buffer; each slice is a tensor of its own, not a view, so a
    branch may modify it in place. Backward: one combine of the slices' gradients."""
    check_device_supported(x, "x")
    return ops.gather_split(x, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos, plan.counts)


def split_packed(packed: Tensor, plan: Plan) -> List[Tensor]:
    """Views of every branch's rows in a packed buffer."""
    return list(packed.split(plan.counts))


def combine(
    ys: Sequence[Tensor],
    plan: Plan,
    weights: Optional[Tensor] = None,
    base: Optional[Tensor] = None,
) -> Tensor:
    """``out[b] = base[b] + sum over row b's live branches i of weights[b, i] * ys[i][local]``.

    ``ys[i]`` holds branch i's outputs for its ``plan.counts[i]`` rows (in the plan's order).
    ``weights`` ``[B, N]`` defaults to 1 (id and bool gates); it receives gradients at live
    entries and zero elsewhere.
    """
    ys = list(ys)
    if len(ys) != len(plan.counts):
        raise ValueError(f"ys: expected one output per branch ({len(plan.counts)}), got {len(ys)}")
    for i, y in enumerate(ys):
        check_device_supported(y, f"ys[{i}]")
        if y.shape[0] != plan.counts[i]:
            raise ValueError(
                f"ys[{i}]: branch {i} was given {plan.counts[i]} rows but returned {y.shape[0]}; "
                "a branch must return one row per input row"
            )
    if base is not None:
        check_device_supported(base, "base")
    return ops.combine(base, ys, weights, plan.rows, plan.row_offsets, plan.row_branch, plan.row_pos)


def anchor(x: Tensor, params: Sequence[Tensor], materialize: bool = False) -> Tensor:
    """Identity on ``x`` (a view) that gives ``params`` a gradient when ``x``'s graph is
    differentiated: undefined (``materialize=False``; DDP's reducer fills zeros into its
    buckets, no kernel per parameter) or zeros from one batched fill (``materialize=True``; what
    FSDP2 needs, since it reduces only defined gradients)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"params[{i}]: expected a tensor, got {type(p).__name__}")
    params = [p for p in params if p.requires_grad]
    if not params or not torch.is_grad_enabled():
        return x
    return ops.anchor(x, params, materialize)


def drop_path_scale(y: Tensor, scale: Tensor, base: Optional[Tensor] = None) -> Tensor:
    """``out[b] = base[b] + scale[b] * y[b]`` in one pass (``base`` optional)."""
    check_device_supported(y, "y")
    return ops.drop_path_scale(base, y, scale)


# ----------------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes, devices and layouts as the real kernels produce them.


def _row_format(t: Tensor) -> torch.memory_format:
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _check_devices(ref_name: str, ref: Tensor, **others) -> None:
    """Mixed devices, as the C++ kernels report them (these fake kernels also answer meta)."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: expected a tensor on {ref.device} like {ref_name}, got one on {t.device}")


def _empty_rows(rows, trailing, like: Tensor, fmt: torch.memory_format, dtype=None) -> Tensor:
    sizes = (rows, *trailing)
    if (fmt == torch.channels_last and len(sizes) != 4) or (fmt == torch.channels_last_3d and len(sizes) != 5):
        fmt = torch.contiguous_format
    return torch.empty(sizes, dtype=dtype or like.dtype, device=like.device, memory_format=fmt)


@torch.library.register_fake("maskedbranch::plan")
def _plan_fake(gate, num_branches):
    entries = torch.library.get_ctx().new_dynamic_size()
    index = dict(dtype=torch.int64, device=gate.device)
    return (
        torch.empty(num_branches + 1, dtype=torch.int64, device="cpu"),
        torch.empty(entries, **index),
        torch.empty(gate.shape[0] + 1, **index),
        torch.empty(entries, **index),
        torch.empty(entries, **index),
    )


@torch.library.register_fake("maskedbranch::gather")
def _gather_fake(x, rows, row_offsets, row_pos):
    _check_devices("x", x, rows=rows, row_offsets=row_offsets, row_pos=row_pos)
    return _empty_rows(rows.shape[0], x.shape[1:], x, _row_format(x))


@torch.library.register_fake("maskedbranch::gather_split")
def _gather_split_fake(x, rows, row_offsets, row_branch, row_pos, counts):
    _check_devices("x", x, rows=rows, row_offsets=row_offsets, row_branch=row_branch, row_pos=row_pos)
    fmt = _row_format(x)
    return [_empty_rows(c, x.shape[1:], x, fmt) for c in counts]


@torch.library.register_fake("maskedbranch::gather_backward")
def _gather_backward_fake(grad, row_offsets, row_pos):
    return _empty_rows(row_offsets.shape[0] - 1, grad.shape[1:], grad, _row_format(grad))


@torch.library.register_fake("maskedbranch::combine")
def _combine_fake(base, ys, weights, rows, row_offsets, row_branch, row_pos):
    ref = base if base is not None else ys[0]
    ref_name = "base" if base is not None else "ys[0]"
    _check_devices(ref_name, ref, weights=weights, rows=rows, row_offsets=row_offsets, row_branch=row_branch)
    _check_devices(ref_name, ref, **{f"ys[{i}]": y for i, y in enumerate(ys)})
    return _empty_rows(row_offsets.shape[0] - 1, ref.shape[1:], ref, _row_format(ref))


@torch.library.register_fake("maskedbranch::combine_backward_ys")
def _combine_backward_ys_fake(grad, weights, rows, counts):
    return _empty_rows(rows.shape[0], grad.shape[1:], grad, _row_format(grad))


@torch.library.register_fake("maskedbranch::combine_backward_weights")
def _combine_backward_weights_fake(grad, ys, row_offsets, row_branch, row_pos, dtype):
    return grad.new_empty((row_offsets.shape[0] - 1, len(ys)), dtype=dtype)


@torch.library.register_fake("maskedbranch::drop_path_scale")
def _drop_path_scale_fake(base, y, scale):
    _check_devices("y", y, base=base, scale=scale)
    return _empty_rows(y.shape[0], y.shape[1:], y, _row_format(y))


# ----------------------------------------------------------------------------------------------
# Autograd lives in csrc/autograd.cpp (C++ autograd Functions at the Autograd key): its backward
# formulas call the registered backward ops, at a few microseconds per call.
