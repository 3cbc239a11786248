"""Readable pure-PyTorch references of every op and of the masked-branch semantics.

The tests compare the fused kernels against these. They favour clarity over speed.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def live_mask(gate: Tensor, num_branches: int) -> Tensor:
    """The bool [B, N] matrix of live (row, branch) entries of a gate."""
    if gate.dim() == 1:
        ids = gate.long()
        return (ids[:, None] == torch.arange(num_branches, device=gate.device)[None, :])
    return gate != 0


def plan(gate: Tensor, num_branches: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``maskedbranch::plan`` (no validation; see the op for errors)."""
    live = live_mask(gate, num_branches).cpu()
    counts = live.sum(0)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    branch_then_row = live.t().nonzero()  # sorted by branch, then row: CSR by branch
    rows = branch_then_row[:, 1]
    row_then_branch = live.nonzero()  # sorted by row, then branch: CSR by row
    row_offsets = torch.cat([counts.new_zeros(1), live.sum(1).cumsum(0)])
    row_branch = row_then_branch[:, 1]
    # packed position of (b, i) = offsets[i] + rank of b among branch i's rows
    rank = live.long().cumsum(0) - 1
    row_pos = offsets[row_branch] + rank[row_then_branch[:, 0], row_branch]
    dev = gate.device
    return offsets, rows.to(dev), row_offsets.to(dev), row_branch.to(dev), row_pos.to(dev)


def _row_ids(row_offsets: Tensor) -> Tensor:
    """The row of each CSR-by-row entry."""
    rows = torch.arange(row_offsets.shape[0] - 1, device=row_offsets.device)
    return rows.repeat_interleave(row_offsets.diff())


def _weights_as(weights: Tensor, like: Tensor) -> Tensor:
    """Per-entry weights broadcast over a row's trailing dimensions."""
    return weights.reshape(-1, *([1] * (like.dim() - 1)))


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops weight and sum in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather(x: Tensor, rows: Tensor, weights: Optional[Tensor], counts: Sequence[int]) -> List[Tensor]:
    """Reference of ``maskedbranch::gather``: branch i gets ``x[rows[start_i : start_i + counts[i]]]``,
    each row scaled by ``weights[row, i]`` when weights are given (in opmath, rounded once)."""
    out, start = [], 0
    opmath = opmath_dtype(x.dtype)
    for i, c in enumerate(counts):
        r = rows[start : start + c]
        start += c
        part = x.index_select(0, r)
        if weights is not None:
            part = (part.to(opmath) * _weights_as(weights[r, i].to(opmath), part)).to(x.dtype)
        out.append(part)
    return out


def combine(
    base: Optional[Tensor],
    ys: Sequence[Tensor],
    weights: Optional[Tensor],
    row_offsets: Tensor,
    row_branch: Tensor,
    row_pos: Tensor,
) -> Tensor:
    """Reference of ``maskedbranch::combine``: ``out[b] = base[b] + sum over row b's entries e of
    weights[b, i] * ys[i][row_pos[e] - start_i]`` with ``i = row_branch[e]`` (weights default 1),
    summed in opmath and rounded once."""
    ref = base if base is not None else ys[0]
    opmath = opmath_dtype(ref.dtype)
    packed = torch.cat([y.reshape(y.shape[0], *ref.shape[1:]) for y in ys]).to(opmath)
    entry_rows = _row_ids(row_offsets)
    contrib = packed.index_select(0, row_pos)
    if weights is not None:
        contrib = contrib * _weights_as(weights[entry_rows, row_branch].to(opmath), contrib)
    out = torch.zeros((row_offsets.shape[0] - 1, *ref.shape[1:]), dtype=opmath, device=ref.device)
    if base is not None:
        out = out + base.to(opmath)
    return out.index_add(0, entry_rows, contrib).to(ref.dtype)


def combine_weights_backward(
    grad: Tensor, ys: Sequence[Tensor], row_offsets: Tensor, row_branch: Tensor, row_pos: Tensor
) -> Tensor:
    """Reference of ``maskedbranch::combine_weights_backward``: ``<grad[b], ys[i][...]>`` at each
    live entry (b, i), zero elsewhere; [B, N] in float64 for float64 inputs, else float32."""
    dtype = opmath_dtype(grad.dtype)
    d = math.prod(grad.shape[1:])
    packed = torch.cat([y.reshape(y.shape[0], d) for y in ys]).to(dtype)
    entry_rows = _row_ids(row_offsets)
    dots = (grad.reshape(grad.shape[0], d).to(dtype)[entry_rows] * packed[row_pos]).sum(1)
    out = torch.zeros((row_offsets.shape[0] - 1, len(ys)), dtype=dtype, device=grad.device)
    out[entry_rows, row_branch] = dots
    return out


def pick(tensors: Sequence[Tensor], index: Tensor, branches: int) -> List[Tensor]:
    """Reference of ``maskedbranch::pick``: copies (contiguous) of the chosen branch's tensors;
    ``tensors`` holds k per branch, branch after branch."""
    k = len(tensors) // branches
    i = int(index.reshape(()))
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors[i * k:(i + 1) * k]]


def pick_backward(grads: Sequence[Tensor], index: Tensor, branches: int) -> List[Tensor]:
    """Reference of ``maskedbranch::pick_backward``: ``grads`` for the chosen branch, zeros for
    the others, branch after branch (contiguous)."""
    i = int(index.reshape(()))
    return [(g.clone(memory_format=torch.contiguous_format) if b == i else torch.zeros_like(g, memory_format=torch.contiguous_format))
            for b in range(branches) for g in grads]


def put_(tensors: Sequence[Tensor], index: Tensor, branches: int, values: Sequence[Tensor]) -> None:
    """Reference of ``maskedbranch::put_``: ``values`` written into the chosen branch's tensors;
    nothing for index -1."""
    k = len(values)
    i = int(index.reshape(()))
    if i >= 0:
        for t, v in zip(tensors[i * k:(i + 1) * k], values):
            t.copy_(v)


def masked_branch_dense(
    branches: Sequence[Callable[[Tensor], Tensor]], x: Tensor, gate, num_branches: Optional[int] = None
) -> Tensor:
    """The dense 0/1-coefficient formula: every branch runs on every row,
    ``y = sum_i g[:, i] * branch_i(x)``. (Equal to masked routing for row-wise branches, except
    that zero gate entries get the gradient <grad_out, branch_i(x)> here and zero there.)"""
    n = len(branches) if num_branches is None else num_branches
    if isinstance(gate, int):
        return branches[gate](x)
    g = gate.to(x.dtype) if gate.dim() == 2 else live_mask(gate, n).to(x.dtype)
    outs = [br(x) for br in branches]
    shape = (-1,) + (1,) * (outs[0].dim() - 1)
    return sum(g[:, i].reshape(shape) * outs[i] for i in range(n))


def masked_branch_ifelse(
    branches: Sequence[Callable[[Tensor], Tensor]], x: Tensor, gate, num_branches: Optional[int] = None
) -> Tensor:
    """The if/else formula: each branch runs on exactly its rows (index_select / index_add).
    Dead branches are not in the graph (what breaks DDP). None when no row reaches any branch
    (the output's shape is then unknown to an if/else)."""
    n = len(branches) if num_branches is None else num_branches
    if isinstance(gate, int):
        if gate < 0:  # -1: no branch for any row (None: no graph, like an if/else that ran nothing)
            return None
        return branches[gate](x)
    live = live_mask(gate, n)
    out = None
    for i in range(n):
        r = live[:, i].nonzero().flatten()
        if r.numel() == 0:
            continue
        y = branches[i](x.index_select(0, r))
        if gate.dim() == 2 and gate.dtype != torch.bool:
            y = y * gate[r, i].to(y.dtype).reshape(-1, *([1] * (y.dim() - 1)))
        if out is None:
            out = y.new_zeros((x.shape[0], *y.shape[1:]))
        out = out.index_add(0, r, y)
    return out
