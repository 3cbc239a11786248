"""Argument checks shared by the four drop-path forms (maskedbranch/drop_path.py,
maskedbranch/residual.py), and the deprecation path of their positional settings.

One order everywhere: ``drop_prob`` and ``training`` (the functional forms) are positional;
``mode``, ``scale_by_keep``, ``generator`` and the rest are keyword-only. Release 0.2 took some
of them positionally, in two different orders; those calls still work, with a
``DeprecationWarning``, as long as each value has the type of the setting it lands in (a string
where a bool belongs, torchvision's ``stochastic_depth(x, p, mode, training)`` order, is a
``TypeError`` that says what to write instead).
"""
from __future__ import annotations

import numbers
import warnings
from typing import Any, Dict, Optional, Sequence

import torch
from torch import Tensor

from . import _route

MODES = ("row", "batch")
KEPT = ("random", "fixed")


def check_drop_prob(drop_prob: Any) -> Any:
    """A probability in [0, 1]; returned as given (timm keeps ``DropPath(1).drop_prob == 1``)."""
    if isinstance(drop_prob, Tensor):
        if drop_prob.numel() != 1:
            raise ValueError(f"drop_prob: expected a number in [0, 1], got a tensor of shape {tuple(drop_prob.shape)}")
        drop_prob = drop_prob.item()
    if isinstance(drop_prob, bool) or not isinstance(drop_prob, numbers.Real):
        raise TypeError(f"drop_prob: expected a number in [0, 1], got {type(drop_prob).__name__}")
    if not (0.0 <= float(drop_prob) <= 1.0):  # also rejects NaN
        raise ValueError(f"drop_prob: expected a probability in [0, 1], got {drop_prob}")
    return drop_prob


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ == "bool_")


def check_bool(value: Any, name: str, hint: str = "") -> bool:
    if not _is_bool(value):
        got = f"{type(value).__name__} {value!r}" if isinstance(value, (str, int, float)) else type(value).__name__
        raise TypeError(f"{name}: expected a bool, got {got}{hint}")
    return bool(value)


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected 'row' (drop per sample) or 'batch' (drop the whole batch), got {mode!r}")
    return mode


def check_kept(kept: Any, mode: str) -> str:
    if kept not in KEPT:
        raise ValueError(f"kept: expected 'random' (each row kept with probability 1 - drop_prob) or 'fixed' "
                         f"(exactly round(B * (1 - drop_prob)) rows), got {kept!r}")
    if kept == "fixed" and mode != "row":
        raise ValueError("kept='fixed' drops rows, so it needs mode='row' (mode='batch' keeps all rows or none)")
    return kept


def check_generator(generator: Any) -> Optional[torch.Generator]:
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a CPU torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(
            f"generator: expected a CPU torch.Generator, got one on {generator.device}. Masks are drawn on "
            "the host so that the device never synchronizes; create it with torch.Generator()."
        )
    return generator


def check_x(x: Any) -> None:
    if isinstance(x, torch.fx.Proxy):
        return  # symbolic tracing: shapes are unknown
    _route.check_x(x)
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor (float64, float32, float16 or bfloat16), got dtype {x.dtype}")


_ORDERS = {  # the positional order of each form, named when a string lands in `training`
    "drop_path": "drop_path(x, drop_prob, training, *, mode=..., scale_by_keep=...)",
    "drop_add_residual": "drop_add_residual(x, branch, drop_prob, training, *, mode=..., scale_by_keep=...)",
}


def take_positional(where: str, names: Sequence[str], values: Sequence[Any], given: Dict[str, Any]) -> Dict[str, Any]:
    """Settings passed positionally after the positional ones (deprecated): checked by type,
    merged into ``given`` (the keywords), with one ``DeprecationWarning``."""
    if not values:
        return given
    if len(values) > len(names):
        raise TypeError(f"{where}: takes at most {len(names)} settings after the positional arguments, got {len(values)}")
    out = dict(given)
    for name, value in zip(names, values):
        if name in ("scale_by_keep",) and not _is_bool(value):
            raise TypeError(
                f"{where}: {name}: expected a bool, got {type(value).__name__} {value!r}. The settings after "
                f"drop_prob are keyword-only: write {where}(..., mode={value!r})" if isinstance(value, str) else
                f"{where}: {name}: expected a bool, got {type(value).__name__}"
            )
        if name == "mode" and not isinstance(value, str):
            raise TypeError(f"{where}: mode: expected 'row' or 'batch', got {type(value).__name__}; pass the settings by name")
        if out.get(name, _UNSET) is not _UNSET:
            raise TypeError(f"{where}: got {name} both positionally and by name")
        out[name] = value
    warnings.warn(
        f"{where}: passing {', '.join(names[:len(values)])} positionally is deprecated; pass "
        f"{'it' if len(values) == 1 else 'them'} by name ({', '.join(f'{n}=...' for n in names[:len(values)])})",
        DeprecationWarning,
        stacklevel=3,
    )
    return out


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
UNSET = _UNSET


def training_flag(training: Any, where: str) -> bool:
    hint = ""
    if isinstance(training, str) and where in _ORDERS:
        hint = (f"; the argument order is {_ORDERS[where]} (torchvision's stochastic_depth(x, p, mode, "
                "training) order does not apply: pass mode by name)")
    return check_bool(training, f"{where}: training", hint)
