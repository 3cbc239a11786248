"""Routing of extra forward arguments alongside x (shared by MaskedBranch and ResidualDropPath)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from torch import Tensor


def is_per_row(value: Any, batch: int) -> bool:
    """A tensor argument whose first dimension is the batch is routed with x."""
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == batch


def route_args(
    args: Tuple[Any, ...], kwargs: Dict[str, Any], batch: int, select: Callable[[Tensor], Tensor]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Apply ``select`` (a row selection) to every per-row tensor; pass the rest through."""
    routed = tuple(select(a) if is_per_row(a, batch) else a for a in args)
    routed_kwargs = {k: select(v) if is_per_row(v, batch) else v for k, v in kwargs.items()}
    return routed, routed_kwargs


def check_per_row_devices(args: Tuple[Any, ...], kwargs: Dict[str, Any], x: Tensor) -> None:
    """Per-row arguments are routed with x, so they must live on x's device."""
    batch = x.shape[0]
    named = [(f"args[{j}]", a) for j, a in enumerate(args)] + list(kwargs.items())
    for name, a in named:
        if is_per_row(a, batch) and a.device != x.device:
            raise ValueError(
                f"{name}: a per-row argument (first dimension {batch}, routed with x) must live on "
                f"x's device {x.device}, got {a.device}"
            )
