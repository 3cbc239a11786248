"""Output signatures of routed branches: the trailing shape and dtype of an output where no row
reaches any branch (learned from earlier calls, else found on meta tensors), the check that
branches agree on them, and their common signature while a graph is traced (which a compiled
whole-batch choice needs). Used by maskedbranch/_route.py."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import _compat, _unit

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


def probe(branch: Callable, x: Tensor, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
          ) -> Optional[Tuple[tuple, torch.dtype, bool]]:
    """(trailing shape, dtype, whether it is ``x`` or a view of it) of ``branch``'s output, with
    no effect on parameters, buffers or random state: on meta tensors (no compute); under
    autocast, which does not apply to meta tensors, on two rows of zeros of x's device, with
    copies of the buffers. None when the branch runs on neither or does not keep x's rows."""
    rows = 2  # (a training BatchNorm refuses one)
    kwargs = kwargs or {}

    def meta(a: Any) -> Any:
        return a.to("meta") if isinstance(a, Tensor) else a

    def two_rows(a: Any) -> Any:
        if isinstance(a, Tensor) and is_per_row(a, x.shape[0]):
            return torch.zeros((rows, *a.shape[1:]), dtype=a.dtype, device=a.device)
        return a

    autocast = _autocast_dtype(x.device) is not None
    convert, buffer = (two_rows, lambda v: v.clone()) if autocast else (meta, meta)
    x_in = convert(x)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            if isinstance(branch, nn.Module):
                state = {k: meta(v) if not autocast else v for k, v in branch.named_parameters(remove_duplicate=False)}
                state.update({k: buffer(v) for k, v in branch.named_buffers(remove_duplicate=False)})
                y = torch.func.functional_call(branch, state, (x_in, *map(convert, args)),
                                               {k: convert(v) for k, v in kwargs.items()}, strict=False)
            else:
                y = branch(x_in, *map(convert, args), **{k: convert(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return None
    if not isinstance(y, Tensor) or y.dim() < 1 or y.shape[0] != x_in.shape[0]:
        return None
    return tuple(y.shape[1:]), y.dtype, _compat.is_view_of(y, x_in)


def check_agreement(table: Branches, live: Dict[int, Tensor], x, args, kwargs, signatures: Optional[Signatures], where: str) -> None:
    """A tensor gate combines the branches' rows: they must agree on trailing shape and dtype.
    The live ones are compared on every call; at the first call with inputs like these, the
    others too, on meta tensors (a branch that cannot run there is compared when it runs), so that
    a rarely chosen branch that disagrees fails at once, not hours into a job."""
    items = iter(live.items())
    i0, y0 = next(items)
    for i, y in items:
        if y.shape[1:] != y0.shape[1:] or y.dtype != y0.dtype:
            raise _mismatch(f"{where}[{i}]", y, f"{where}[{i0}]", (tuple(y0.shape[1:]), y0.dtype, i0))
    if signatures is not None:
        learn_signature(table, live, i0, y0, x, args, kwargs, signatures, where)


def learn_signature(table: Branches, live, i0: int, y0: Tensor, x, args, kwargs, signatures: Signatures, where: str) -> None:
    """Remember the output's signature for inputs like these; at the first call with them, check
    the branches that did not run on meta tensors (see :func:`check_agreement`)."""
    key = _input_key(x, args, kwargs)
    if key not in signatures.table:
        want = (tuple(y0.shape[1:]), y0.dtype)
        for i, branch in enumerate(table.branches):
            if i not in live:
                sig = probe(branch, x, args, kwargs)
                if sig is not None and sig[:2] != want:
                    raise _mismatch_probed(f"{where}[{i}]", sig, f"{where}[{i0}]", (*want, i0))
    signatures.learn(key, y0, i0, f"{where}[{i0}]")


def _dead_output_signature(
    table: Branches, signatures: Optional[Signatures], x: Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any], where: str
) -> Tuple[tuple, torch.dtype]:
    key = _input_key(x, args, kwargs)
    known = signatures.table.get(key) if signatures is not None else None
    if known is not None:
        return known[0], known[1]
    for i, branch in enumerate(table.branches):
        sig = probe(branch, x, args, kwargs)
        if sig is not None:
            if signatures is not None:  # probed once per input signature
                signatures.remember(key, sig[:2], i)
            return sig[:2]
    raise RuntimeError(
        f"{where}: no row reached any branch, and the output's trailing shape and dtype could not be "
        "inferred (no earlier call with inputs like these, and no branch runs on meta tensors). Make "
        "one call with at least one live row first."
    )


# ----------------------------------------------------------------------------------------------
# Compiled whole-batch choices (maskedbranch/_choice.py): the branches' common signature, found
# while a graph is traced.


def signature_of(branches: Sequence[Any], trailing: tuple, dtype: torch.dtype) -> Optional[Tuple[tuple, torch.dtype, Tuple[bool, ...]]]:
    """The branches' common output signature for an input of this trailing shape and dtype, and
    which of them return a view of their input; None when one cannot run on meta tensors or
    they disagree."""
    x = torch.empty((2, *trailing), dtype=dtype, device="meta")
    found = [probe(b, x) for b in branches]
    if any(f is None for f in found) or len({f[:2] for f in found}) != 1:
        return None
    return found[0][0], found[0][1], tuple(f[2] for f in found)


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


@torch.compiler.assume_constant_result
def _signature_while_tracing(key: int, trailing: tuple, dtype: str) -> Any:
    owner = _unit.module_by_id(key)
    if owner is None or dtype not in _DTYPES:
        return None
    found = signature_of(list(owner._unit_modules()), trailing, _DTYPES[dtype])
    return None if found is None else (found[0], str(found[1]), found[2])


def traced_signature(owner: nn.Module, x: Tensor) -> Optional[Tuple[tuple, torch.dtype, Tuple[bool, ...]]]:
    """:func:`signature_of` for ``owner``'s branches, answered while the graph is traced (a
    constant of the graph); None for symbolic trailing sizes or autocast (whose dtypes the meta
    run does not see)."""
    trailing = tuple(x.shape[1:])
    if any(type(d) is not int for d in trailing) or torch.is_autocast_enabled(x.device.type) or str(x.dtype) not in _DTYPES:
        return None
    found = _signature_while_tracing(id(owner), trailing, str(x.dtype))
    return None if found is None else (tuple(found[0]), _DTYPES[found[1]], tuple(found[2]))
