"""The gate's and the branches' argument checks, shared by every routing form: each names the
argument, and a call that fails leaves the caller's module as it was."""
from __future__ import annotations

import operator
from typing import Any, Tuple

import torch
from torch import Tensor

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_x(x: Any, name: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected at least one dimension (rows first), got a 0-d tensor")
    return x


def normalize_gate(gate: Any, x: Tensor, n: int) -> Tuple[str, Any]:
    """("int", k) for a whole-batch branch id (-1: none), else ("tensor", gate), after checking
    type, rank, shape, dtype and device."""
    if type(gate) is int and -1 <= gate < n:
        return "int", gate
    if isinstance(gate, bool):
        raise TypeError(f"gate: got a bool; pass an int branch id, an integer tensor [B] of ids or a bool tensor [B, {n}]")
    if not isinstance(gate, Tensor):
        try:
            k = operator.index(gate)  # numpy integers too
        except TypeError:
            raise TypeError(
                f"gate: expected an int branch id, an integer tensor [B] of branch ids or a bool/"
                f"floating tensor [B, {n}], got {type(gate).__name__}"
            ) from None
        if not -1 <= k < n:
            raise IndexError(f"gate: branch id {k} is out of range; expected -1 (no branch) to {n - 1}")
        return "int", k
    batch = x.shape[0]
    if gate.is_complex():
        raise TypeError(f"gate: complex gates are not supported, got dtype {gate.dtype}")
    if gate.device.type != "cpu" and gate.device != x.device:
        raise ValueError(
            f"gate: a device gate must live on x's device ({x.device}), got one on {gate.device}; "
            "a CPU gate works with any x (its plan is built on the host and shipped asynchronously)"
        )
    if gate.dim() == 0:
        if gate.dtype not in INT_DTYPES:
            raise TypeError(f"gate: a 0-d gate must be an integer branch id, got dtype {gate.dtype}")
        if gate.device.type == "cpu" and not torch.compiler.is_compiling():
            return normalize_gate(int(gate), x, n)
        # A device scalar (read back once by the plan), or data to torch.compile: the kernel
        # checks the id's range.
        return "tensor", gate.expand(batch)
    if gate.dim() == 1:
        if gate.dtype not in INT_DTYPES:
            hint = f"; for a mask use shape [B, {n}]" if gate.dtype == torch.bool else ""
            raise TypeError(f"gate: a 1-D gate holds one integer branch id per row (-1 = no branch), got dtype {gate.dtype}{hint}")
        if gate.shape[0] != batch:
            raise ValueError(f"gate: expected {batch} branch ids (one per row of x), got shape {tuple(gate.shape)}")
        return "tensor", gate
    if gate.dim() == 2:
        if tuple(gate.shape) != (batch, n):
            raise ValueError(f"gate: expected shape [{batch}, {n}] (rows of x, branches), got {tuple(gate.shape)}")
        if gate.dtype != torch.bool and gate.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"gate: a 2-D gate must be bool (a mask) or floating (weights), got dtype {gate.dtype}")
        return "tensor", gate
    raise ValueError(f"gate: expected an int, branch ids [B] or a mask/weights [B, {n}], got shape {tuple(gate.shape)}")


def check_output(y: Any, label: str, rows: int) -> Tensor:
    if not isinstance(y, Tensor):
        raise TypeError(f"{label}: expected the branch to return a tensor, got {type(y).__name__}")
    if y.dim() < 1 or y.shape[0] != rows:
        raise ValueError(
            f"{label}: the branch was given {rows} rows and returned shape {tuple(y.shape)}; a branch "
            "must return one row per input row"
        )
    return y
