"""Argument checks shared by the four drop-path forms (maskedbranch/drop_path.py,
maskedbranch/residual.py).

One order everywhere: ``drop_prob`` and ``training`` (the functional forms) are positional;
``mode``, ``scale_by_keep``, ``generator`` and the rest are keyword-only. Two misreadings get a
``TypeError`` that says what to write, where Python's own would leave the user guessing or a
call would run in another mode: a setting passed positionally, and torchvision's
``stochastic_depth(x, p, mode, training)`` order (a string where ``training`` belongs).
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import _gate

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
    _gate.check_x(x)
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor (float64, float32, float16 or bfloat16), got dtype {x.dtype}")


_ORDERS = {  # the positional order of each form, named when a call misreads it
    "drop_path": "drop_path(x, drop_prob, training, scale_by_keep, *, mode=..., generator=...)",
    "drop_add_residual": "drop_add_residual(x, branch, drop_prob, training, *, mode=..., scale_by_keep=..., ...)",
    "DropPath": "DropPath(drop_prob, scale_by_keep, *, mode=..., generator=...)",
    "ResidualDropPath": "ResidualDropPath(branch, drop_prob, *, mode=..., scale_by_keep=..., kept=..., ...)",
}


_LAST_POSITIONAL = {"drop_path": "scale_by_keep", "DropPath": "scale_by_keep",  # timm's signatures
                    "drop_add_residual": "training", "ResidualDropPath": "drop_prob"}


def _setting_for(value: Any) -> str:
    """The setting a positional value was most likely meant for, by its type."""
    if isinstance(value, str):
        return "kept" if value in KEPT else "mode"
    if _is_bool(value):
        return "scale_by_keep"
    if value is None or isinstance(value, torch.Generator):
        return "generator"
    return "<setting>"


def refuse_positional(where: str, extra: Tuple[Any, ...]) -> None:
    """The settings are keyword-only: a call that passes some positionally (``extra``, what the
    form's ``*extra`` caught) gets a TypeError that names the setting each value looks meant for,
    not Python's count of positional arguments."""
    if not extra:
        return
    named = ", ".join(f"{_setting_for(v)}={v!r}" for v in extra)
    last = _LAST_POSITIONAL[where]
    raise TypeError(f"{where}: the settings after {last} are keyword-only: write {where}(..., {named}); "
                    f"the argument order is {_ORDERS[where]}")


def training_flag(training: Any, where: str) -> bool:
    hint = ""
    if isinstance(training, str) and where in ("drop_path", "drop_add_residual"):
        hint = (f"; the argument order is {_ORDERS[where]} (torchvision's stochastic_depth(x, p, mode, "
                "training) order does not apply: pass mode by name)")
    return check_bool(training, f"{where}: training", hint)
