"""The routing ops as differentiable functions, for building routing of your own (MaskedBranch
and ResidualDropPath are built on them; see maskedbranch/_route.py)::

    plan = maskedbranch.make_plan(gate, num_branches)     # gate -> which rows go where
    xs = maskedbranch.gather(x, plan)                      # one tensor of rows per branch
    ys = [branch(xi) for branch, xi in zip(branches, xs)]  # (skip branches with no rows)
    out = maskedbranch.combine(ys, plan, weights=gate)     # scatter back, weighted
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from torch import Tensor

from . import _autograd
from ._ops import Plan, check_tensor

__all__ = ["tie", "combine", "gather"]


def _check_plan(plan) -> Plan:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a maskedbranch.Plan (from make_plan), got {type(plan).__name__}")
    return plan


def gather(x: Tensor, plan: Plan) -> List[Tensor]:
    """Each branch's rows of ``x``: ``plan.counts[i]`` rows for branch i, in the plan's order,
    each a new tensor (a branch may modify it in place). One kernel for all branches; backward:
    a deterministic segmented sum back to rows."""
    check_tensor(x, "x")
    _check_plan(plan)
    return _autograd.gather(x, plan)


def combine(
    ys: Sequence[Tensor],
    plan: Plan,
    weights: Optional[Tensor] = None,
    base: Optional[Tensor] = None,
    *,
    tied: Sequence[Tensor] = (),
    materialize_grads: bool = False,
) -> Tensor:
    """``out[b] = base[b] + sum over row b's live branches i of weights[b, i] * ys[i][...]``.

    ``ys[i]`` holds branch i's outputs for its ``plan.counts[i]`` rows. ``weights`` ``[B, N]``
    defaults to 1; it gets gradients at live entries and zero elsewhere. ``tied``: tensors
    (typically the parameters of branches that did not run) tied into the output's graph: their
    gradient is undefined, or zeros with ``materialize_grads=True``.
    """
    _check_plan(plan)
    ys = list(ys)
    if len(ys) != len(plan.counts):
        raise ValueError(f"ys: expected one output per branch ({len(plan.counts)}), got {len(ys)}")
    for i, y in enumerate(ys):
        check_tensor(y, f"ys[{i}]")
        if y.dim() < 1 or y.shape[0] != plan.counts[i]:
            raise ValueError(
                f"ys[{i}]: branch {i} was given {plan.counts[i]} rows but returned shape {tuple(y.shape)}; "
                "a branch must return one row per input row"
            )
    if base is not None:
        check_tensor(base, "base")
    if weights is not None:
        check_tensor(weights, "weights")
    tied = [check_tensor(t, f"tied[{k}]") for k, t in enumerate(tied)]
    return _autograd.combine(ys, plan, weights=weights, base=base, tied=tied, zeros=bool(materialize_grads))


def tie(x: Tensor, params: Sequence[Tensor], materialize: bool = False) -> Tensor:
    """A copy of ``x`` whose backward also reaches ``params``: they get an undefined gradient
    (``materialize=False``; DDP's hooks still fire and it fills zeros) or zeros. A copy rather
    than a view, so that the caller may modify it in place."""
    check_tensor(x, "x")
    params = [check_tensor(p, f"params[{k}]") for k, p in enumerate(params)]
    params = [p for p in params if p.requires_grad]
    return _autograd.tie(x, params, bool(materialize)) if params else x
