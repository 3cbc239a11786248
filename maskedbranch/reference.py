"""Readable pure-PyTorch references of every op and of the masked-branch semantics.

The tests compare the fused kernels against these. They favour clarity over speed.
"""
from __future__ import annotations

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


def gather(x: Tensor, rows: Tensor) -> Tensor:
    return x.index_select(0, rows)


def gather_split(x: Tensor, rows: Tensor, counts: Sequence[int]) -> List[Tensor]:
    """Each branch's rows of x (copies, differentiable)."""
    return [part.clone() for part in x.index_select(0, rows).split(list(counts))]


def gather_backward(grad: Tensor, rows: Tensor, num_rows: int) -> Tensor:
    return grad.new_zeros((num_rows, *grad.shape[1:])).index_add_(0, rows, grad)


def combine(
    base: Optional[Tensor], ys: Sequence[Tensor], weights: Optional[Tensor], rows: Tensor, num_rows: int
) -> Tensor:
    """``out = base + sum_i weights[:, i] * scatter(ys[i])`` with the rows of branch i being
    ``rows[start_i : start_i + len(ys[i])]``."""
    ref = base if base is not None else ys[0]
    out = torch.zeros((num_rows, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
    if base is not None:
        out = out + base
    start = 0
    for i, y in enumerate(ys):
        r = rows[start : start + y.shape[0]]
        start += y.shape[0]
        contrib = y
        if weights is not None:
            w = weights[r, i].to(y.dtype)
            contrib = y * w.reshape(-1, *([1] * (y.dim() - 1)))
        out = out.index_add(0, r, contrib)
    return out


def drop_path_scale(base: Optional[Tensor], y: Tensor, scale: Tensor) -> Tensor:
    out = y * scale.to(y.dtype).reshape(-1, *([1] * (y.dim() - 1)))
    return out if base is None else base + out


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
