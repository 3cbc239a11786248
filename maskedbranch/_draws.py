"""The drop paths' host draw and the factor of kept rows (docs/design.md, "Host-side drop masks for
the residual form"): the masks come from timm's and torchvision's stream and the factor is rounded
as they round it, so that results match theirs bit for bit. The only other draw is on x's device,
in ``drop_path._drop_path``, where timm draws."""
from __future__ import annotations

import math
import struct
from typing import Any, Optional, Tuple

import torch
from torch import Tensor


# The token that every compiled draw (the op keep_draw) mutates, keeping the draws in program order
# (docs/design.md, "The compiled draw is an op").
_ORDER = torch.zeros(1, dtype=torch.int64)


def draw(n: Any, keep_prob: float, generator: Optional[torch.Generator] = None) -> Tensor:
    """n Bernoulli(keep_prob) draws on the host as a float32 0/1 tensor ``[n]``: the one host
    draw. Same stream as timm's and torchvision's ``empty(...).bernoulli_(keep_prob)`` on a CPU
    tensor with the same seed; inside a compiled graph (no ``generator``), the op keep_draw."""
    if generator is None and torch.compiler.is_compiling():
        # The rate as a tensor made by arithmetic, never a float that the compile caches could
        # specialize and serve to other rates (docs/design.md, "The compiled draw is an op").
        rate = torch.ones((), dtype=torch.float64) * keep_prob
        return torch.ops.maskedbranch.keep_draw(_ORDER, n, rate)
    return torch.empty(n, dtype=torch.float32).bernoulli_(keep_prob, generator=generator)


def host_routing(
    mode: str, batch: int, keep_prob: float, scale_by_keep: bool, dtype: torch.dtype, generator: Optional[torch.Generator]
) -> Tuple[Any, float]:
    """The routing gate of one call (0: the branch runs, -1: it does not; for the batch, or one
    per row) and the factor of kept rows."""
    scale = keep_scale(keep_prob, scale_by_keep, dtype)
    if mode == "batch":
        return (0 if bool(draw(1, keep_prob, generator)[0]) else -1), scale
    return draw(batch, keep_prob, generator).to(torch.int64).sub_(1), scale  # 0 kept, -1 dropped


def traced_scale(keep_prob: float, scale_by_keep: bool, dtype: torch.dtype) -> Any:
    """:func:`keep_scale` inside a compiled graph: a 0-d tensor op (or 1.0), torch's own rounding
    (timm's division of a mask of the dtype by keep_prob), so that no float is computed in
    Python while tracing."""
    if not scale_by_keep or keep_prob == 0.0:
        return 1.0
    return torch.ones((), dtype=dtype) / keep_prob


# A user's generator cannot enter a graph: with one, the draw runs eagerly (a graph break).
# Eager mode calls host_routing directly, without the disable wrapper's cost per call.
host_routing_outside_graphs = torch.compiler.disable(host_routing)


def keep_scale(keep_prob: float, scale_by_keep: bool, dtype: torch.dtype) -> float:
    """The factor of kept rows, rounded to ``dtype`` as timm and torchvision round it (they
    divide a mask of ``dtype`` by keep_prob), so that results match theirs bit for bit."""
    if not scale_by_keep or keep_prob == 0.0:
        return 1.0
    return rounded_inverse(keep_prob, dtype)


def to_float32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def rounded_inverse(keep_prob: float, dtype: torch.dtype) -> float:
    """``torch.ones((), dtype=dtype).div_(keep_prob).item()`` in plain Python (no tensor, no
    ``.item()``, no device sync). float32, float16 and bfloat16 tensors divide in
    float32 by ``float32(keep_prob)``; the float32 quotient is then rounded to the dtype. The
    quotient of two float32 numbers computed in float64 and rounded to float32 is the correctly
    rounded float32 quotient (float64 has more than 2 * 24 + 2 bits), so this is exact."""
    if dtype == torch.float64:
        return 1.0 / keep_prob
    q = to_float32(1.0 / to_float32(keep_prob))
    if dtype == torch.float16:  # from float32, as torch rounds (not from the exact quotient)
        try:
            return struct.unpack("e", struct.pack("e", q))[0]
        except OverflowError:  # beyond float16's range
            return math.inf
    if dtype == torch.bfloat16:  # round float32 to nearest even on the upper 16 bits
        bits = struct.unpack("I", struct.pack("f", q))[0]
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return struct.unpack("f", struct.pack("I", bits & 0xFFFFFFFF))[0]
    if dtype == torch.float32:
        return q
    return torch.ones((), dtype=dtype).div_(keep_prob).item()  # other dtypes: ask torch
