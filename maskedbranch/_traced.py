"""Symbolic tracing (torch.fx): the dense formula ``sum_i g[:, i] * branch_i(x, ...)``, every branch
on every row, since which rows reach which branch is data the trace cannot see (docs/design.md,
"Data flow" and "Semantics"). The two helpers are wrapped, so each is one graph node and reads the
gate when the graph runs."""
from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

import torch
from torch import Tensor

from ._gate import normalize_gate


def dense_weights(gate: Any, x: Tensor, n: int) -> Tensor:
    """The gate as ``[B, n]`` coefficients in x's dtype (checked as :func:`route` checks it)."""
    kind, gate = normalize_gate(gate, x, n)
    if kind == "int":
        w = x.new_zeros((x.shape[0], n))
        if gate >= 0:
            w[:, gate] = 1
        return w
    if gate.dim() == 1:
        if gate.numel() and not bool(((gate >= -1) & (gate < n)).all()):
            raise IndexError(f"gate: branch ids must lie in -1 (no branch) to {n - 1}")
        gate = gate.to(x.device)[:, None] == torch.arange(n, device=x.device)
    return gate.to(device=x.device, dtype=x.dtype)


def dense_term(w: Tensor, i: int, y: Tensor) -> Tensor:
    """``w[:, i] * y``, broadcast over y's trailing dimensions."""
    return y * w[:, i].to(y.dtype).reshape((-1,) + (1,) * (y.dim() - 1))


torch.fx.wrap("dense_weights")
torch.fx.wrap("dense_term")


def traced(x: Any, gate: Any) -> bool:
    return isinstance(x, torch.fx.Proxy) or isinstance(gate, torch.fx.Proxy)


def route_traced(branches: Sequence[Callable], x: Any, gate: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The graph of :func:`route` under symbolic tracing: a constant int gate runs its branch,
    any other gate the dense formula."""
    if type(gate) is int and 0 <= gate < len(branches):
        return branches[gate](x, *args, **kwargs)
    w = dense_weights(gate, x, len(branches))
    out = None
    for i, branch in enumerate(branches):
        term = dense_term(w, i, branch(x, *args, **kwargs))
        out = term if out is None else out + term
    return out
