"""Output signatures of routed branches: the trailing shape and dtype of an output where no row
reaches any branch (learned from earlier calls, else found on meta tensors), and the check that
branches agree on them. Used by maskedbranch/_route.py."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ._args import is_per_row
from ._structure import Branches



def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    try:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    except (RuntimeError, TypeError, ValueError):  # a device type without autocast
        return None


def _input_key(x: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> tuple:
    def sig(a: Any) -> Any:
        if isinstance(a, Tensor):
            return (tuple(a.shape[1:]) if is_per_row(a, x.shape[0]) else tuple(a.shape), a.dtype)
        return a if a is None or isinstance(a, (bool, int, float, str)) else type(a)

    key: tuple = (tuple(x.shape[1:]), x.dtype, _autocast_dtype(x.device))
    if args or kwargs:
        key += tuple(sig(a) for a in args) + tuple((k, sig(v)) for k, v in kwargs.items())
    return key


class Signatures:
    """Input signature -> (trailing shape, dtype, branch that produced it), learned from calls
    (bounded: inputs of ever-changing shapes would grow it without limit)."""

    def __init__(self, size: int = 32):
        self.size = size
        self.table: Dict[tuple, Tuple[tuple, torch.dtype, int]] = {}

    def learn(self, key: tuple, y: Tensor, branch: int, label: str) -> None:
        known = self.table.get(key)
        if known is None:
            self.remember(key, (tuple(y.shape[1:]), y.dtype), branch)
        elif (known[0], known[1]) != (tuple(y.shape[1:]), y.dtype) and known[2] != branch:
            raise _mismatch(label, y, f"{label.split('[')[0]}[{known[2]}] (in an earlier call with inputs like these)", known)


    def remember(self, key: tuple, signature: Tuple[tuple, torch.dtype], branch: int) -> None:
        if len(self.table) >= self.size:
            self.table.pop(next(iter(self.table)))
        self.table[key] = (*signature, branch)


def _mismatch(label: str, y: Tensor, other: str, ref: Tuple[tuple, torch.dtype, Any]) -> ValueError:
    return ValueError(
        f"{label} returns rows of shape {list(y.shape[1:])} and dtype {y.dtype}, {other} rows of shape "
        f"{list(ref[0])} and dtype {ref[1]}; every branch must return the same trailing shape and dtype"
    )


def _mismatch_probed(label: str, sig: Tuple[tuple, torch.dtype], other: str, ref: Tuple[tuple, torch.dtype, Any]) -> ValueError:
    return ValueError(
        f"{label} would return rows of shape {list(sig[0])} and dtype {sig[1]} (checked on meta tensors at the "
        f"first call with inputs like these), {other} returns rows of shape {list(ref[0])} and dtype {ref[1]}; "
        "with a tensor gate every branch must return the same trailing shape and dtype (an int gate returns "
        "what its branch returns, as if/else does)"
    )


def _probe(branch: Callable, x: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[tuple, torch.dtype]]:
    """(trailing shape, dtype) of ``branch``'s output, with no effect on parameters, buffers or
    random state: on meta tensors (no compute); under autocast, which does not apply to meta
    tensors, on two rows of zeros of x's device, with copies of the buffers. None when the branch
    runs on neither."""
    rows = 2  # (a training BatchNorm refuses one)

    def meta(a: Any) -> Any:
        return a.to("meta") if isinstance(a, Tensor) else a

    def two_rows(a: Any) -> Any:
        if isinstance(a, Tensor) and is_per_row(a, x.shape[0]):
            return torch.zeros((rows, *a.shape[1:]), dtype=a.dtype, device=a.device)
        return a

    autocast = _autocast_dtype(x.device) is not None
    convert, buffer = (two_rows, lambda v: v.clone()) if autocast else (meta, meta)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            if isinstance(branch, torch.nn.Module):
                state = {k: meta(v) if not autocast else v for k, v in branch.named_parameters(remove_duplicate=False)}
                state.update({k: buffer(v) for k, v in branch.named_buffers(remove_duplicate=False)})
                y = torch.func.functional_call(branch, state, (convert(x), *map(convert, args)),
                                               {k: convert(v) for k, v in kwargs.items()}, strict=False)
            else:
                y = branch(convert(x), *map(convert, args), **{k: convert(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return None
    if not isinstance(y, Tensor) or y.dim() < 1:
        return None
    return tuple(y.shape[1:]), y.dtype


def _dead_output_signature(
    table: Branches, signatures: Optional[Signatures], x: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any], where: str
) -> Tuple[tuple, torch.dtype]:
    key = _input_key(x, args, kwargs)
    known = signatures.table.get(key) if signatures is not None else None
    if known is not None:
        return known[0], known[1]
    for i, branch in enumerate(table.branches):
        sig = _probe(branch, x, args, kwargs)
        if sig is not None:
            if signatures is not None:  # probed once per input signature
                signatures.remember(key, sig, i)
            return sig
    raise RuntimeError(
        f"{where}: no row reached any branch, and the output's trailing shape and dtype could not be "
        "inferred (no earlier call with inputs like these, and no branch runs on meta tensors). Make "
        "one call with at least one live row first."
    )
