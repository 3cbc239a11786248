"""The compiled ops (``torch.ops.maskedbranch``): loading the library, the routing plan, shipping it
to the device, the parameter table, and the fake kernels that torch.compile, torch.export and
``opcheck`` trace with. What each op does, in the order data flows: docs/design.md, "Data flow";
their autograd: maskedbranch/_autograd.py.
"""
from __future__ import annotations

import glob
import os
import warnings
from typing import List, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _compat


def _load_library() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))
    if not found:
        raise ImportError(
            f"maskedbranch: the compiled library (_C*.so) is missing from {here}. Build and install "
            "the package (`pip install --no-build-isolation .` in a clone) and import it from outside "
            "the source tree."
        )
    torch.ops.load_library(found[0])


_load_library()
ops = torch.ops.maskedbranch

#: True when this build has CUDA kernels.
WITH_CUDA: bool = bool(ops.with_cuda())


class Plan(NamedTuple):
    """A routing plan for ``B`` rows and ``N`` branches with ``M`` live (row, branch) entries.

    ``counts`` (a list of ints) lives on the host, so splitting per branch never synchronizes;
    the tensors live on the device of the activations.
    """

    counts: List[int]  # rows per branch, length N
    rows: Tensor  # [M] row ids grouped by branch, ascending within a branch (CSR by branch)
    row_offsets: Tensor  # [B + 1] CSR by row
    row_branch: Tensor  # [M] branch of each entry, CSR by row
    row_pos: Tensor  # [M] packed position of each entry, CSR by row

    @property
    def num_rows(self) -> int:
        return self.row_offsets.shape[0] - 1

    @property
    def num_entries(self) -> int:
        return self.rows.shape[0]


def parameter_table(params: Sequence[Tensor]) -> "torch.ScriptObject":
    """Parameters by position, with the data-parallel layer's loops over them in C++
    (csrc/parameters.cpp: ``undefined(bits)``, ``to_none(bits)``, ``set(k, p)``)."""
    return torch.classes.maskedbranch.Parameters(list(params))


def check_tensor(t, name: str) -> Tensor:
    """A clear error for a non-tensor, or for a CUDA tensor given to a CPU-only build."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.is_cuda and not WITH_CUDA:
        raise RuntimeError(
            f"{name}: got a CUDA tensor, but this maskedbranch build has no CUDA kernels (it was "
            "built without a CUDA-enabled torch or nvcc). Reinstall it where both are present, or "
            "with FORCE_CUDA=1 and TORCH_CUDA_ARCH_LIST set."
        )
    return t


def normalize_device(device: Union[str, torch.device, int, None], default: torch.device) -> torch.device:
    """``device`` with its index filled in: an unindexed "cuda" means the current CUDA device."""
    if device is None:
        return default
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def shipping(sources: Sequence[torch.device], device: torch.device) -> str:
    """How plan tensors on ``sources`` reach ``device`` (normalized): ``"none"`` (already there),
    ``"pinned"`` (host tensors bound for a GPU: one pinned, asynchronous copy, no host wait) or
    ``"plain"`` (``.to``: GPU to host, GPU to GPU, other devices, and under torch.compile)."""
    if all(d == device for d in sources):
        return "none"
    if device.type == "cuda" and all(d.type == "cpu" for d in sources) and not torch.compiler.is_compiling():
        return "pinned"
    return "plain"


def to_device(tensors: Sequence[Tensor], device: torch.device) -> List[Tensor]:
    """Move plan tensors to ``device`` (normalized), as :func:`shipping` says."""
    tensors = list(tensors)
    how = shipping([t.device for t in tensors], device)
    if how == "none":
        return tensors
    if device.type == "cuda" and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
        # A captured copy would replay from a host buffer that is reused after capture.
        raise RuntimeError(
            "make_plan: a plan cannot be moved to the GPU during CUDA graph capture. Make the plan "
            "before capturing (gather and combine with it can be captured)."
        )
    if how == "pinned":
        sizes = [t.numel() for t in tensors]
        host = torch.cat(tensors).pin_memory()
        return list(host.to(device, non_blocking=True).split(sizes))
    return [t.to(device) for t in tensors]


def make_plan(gate: Tensor, num_branches: int, device=None) -> Plan:
    """Build the routing plan of ``gate`` for ``num_branches`` branches, on ``device`` (default:
    the gate's device).

    ``gate`` is an integer tensor ``[B]`` of branch ids (-1 = no branch) or a bool or floating
    tensor ``[B, N]`` (nonzero = live). A host gate gives a host plan that is shipped to the
    device asynchronously; a device gate costs one readback (the counts and the validity check).
    ``device`` may be unindexed ("cuda" = the current CUDA device).

    Under torch.compile the counts are symbolic (unbacked SymInts, bounded by the rows of the
    gate): the graph holds every branch, run on however many rows the plan gives it.

    Under CUDA graph capture no plan can be made for a GPU (the readback, or the shipping from
    the host, cannot be captured): make it before capturing; gather and combine with it capture.
    """
    return plan_and_offsets(gate, num_branches, device)[0]


def plan_and_offsets(gate: Tensor, num_branches: int, device=None, at_least_one: bool = False):
    """:func:`make_plan`, and the host tensor of its CSR offsets (``counts`` as data).
    ``at_least_one``: the caller guarantees every branch a row (compiled code knows it then)."""
    check_tensor(gate, "gate")
    offsets, rows, row_offsets, row_branch, row_pos = ops.plan(gate.detach(), num_branches)
    target = normalize_device(device, gate.device)
    rows, row_offsets, row_branch, row_pos = to_device((rows, row_offsets, row_branch, row_pos), target)
    if torch.compiler.is_compiling():
        # One branch: its count is the number of entries (one unbacked size, not two).
        counts = [rows.shape[0]] if num_branches == 1 else offsets.diff().tolist()
        limit = gate.shape[0]
        for c in counts:  # what the kernel guarantees, for the shapes of the branches' rows
            torch._check(c >= (1 if at_least_one else 0))
            torch._check(c <= limit)
    else:
        bounds = offsets.tolist()  # offsets always live on the host: no sync
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
    return Plan(counts, rows, row_offsets, row_branch, row_pos), offsets


def kept_plan(mask: Tensor, device: torch.device) -> Plan:
    """Under torch.compile: the plan of one branch fed the rows where ``mask`` (bool ``[B]``, at
    least one true: the caller pads) holds, on ``device``. :func:`plan_and_offsets` of
    ``mask[:, None]`` in fewer traced steps: its one count is the number of entries (one
    data-dependent size)."""
    _, rows, row_offsets, row_branch, row_pos = ops.plan(mask.unsqueeze(1), 1)
    if mask.device != device:
        rows, row_offsets, row_branch, row_pos = rows.to(device), row_offsets.to(device), row_branch.to(device), row_pos.to(device)
    count = rows.shape[0]
    torch._check(count >= 1)
    torch._check(count <= mask.shape[0])
    return Plan([count], rows, row_offsets, row_branch, row_pos)


# ----------------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes, devices and layouts as the real kernels produce them.


def _trailing_dense(t: Tensor, dims) -> bool:
    expected = 1
    for d in dims:
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected = expected * t.shape[d]
    return True


def row_format(t: Tensor) -> torch.memory_format:
    """The layout the kernels give their outputs (csrc/row_layout.h): channels_last stays
    channels_last. Read from the trailing strides only, so the answer never depends on the row
    count (unknown while torch.compile traces)."""
    if t.dim() == 4 and not _trailing_dense(t, (3, 2, 1)) and _trailing_dense(t, (1, 3, 2)):
        return torch.channels_last
    if t.dim() == 5 and not _trailing_dense(t, (4, 3, 2, 1)) and _trailing_dense(t, (1, 4, 3, 2)):
        return torch.channels_last_3d
    return torch.contiguous_format


def _empty_rows(rows, like: Tensor, fmt: torch.memory_format) -> Tensor:
    sizes = (rows, *like.shape[1:])
    if (fmt == torch.channels_last and len(sizes) != 4) or (fmt == torch.channels_last_3d and len(sizes) != 5):
        fmt = torch.contiguous_format
    return torch.empty(sizes, dtype=like.dtype, device=like.device, memory_format=fmt)


def _check_devices(ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    """Mixed devices, as the kernels report them (the fake kernels also answer meta tensors)."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: expected a tensor on {ref.device} like {ref_name}, got one on {t.device}")


@torch.library.register_fake("maskedbranch::plan")
def _plan_fake(gate, num_branches):
    entries = torch.library.get_ctx().new_dynamic_size()
    index = dict(dtype=torch.int64, device=gate.device)
    return (
        torch.empty(num_branches + 1, dtype=torch.int64, device="cpu"),
        torch.empty(entries, **index),
        torch.empty(gate.shape[0] + 1, **index),
        torch.empty(entries, **index),
        torch.empty(entries, **index),
    )


class RoutedConvLayoutWarning(UserWarning):
    """CPU inductor's layout optimization on a graph that routes image-like rows with a
    data-dependent count (see :func:`_warn_routed_convolutions`)."""


def _data_dependent(count) -> bool:
    """Whether a row count is data-dependent while tracing (an unbacked symbol: no example value)."""
    if not isinstance(count, torch.SymInt):
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(count))


def _warn_routed_convolutions(x: Tensor, counts) -> None:
    """Warn (once per process), while CPU inductor compiles with its layout optimization, that a
    convolution on these rows (a data-dependent count) will fail inductor's stride check when the
    compiled step runs (docs/design.md, "CPU inductor convolutions"). A warning, not an error: a
    routed branch without a convolution is not affected. Runs in the fake kernel only: the
    compiled step pays nothing."""
    if x.dim() not in (4, 5) or x.device.type != "cpu" or not any(_data_dependent(c) for c in counts):
        return
    if not _compat.inductor_layout_optimization():
        return
    warnings.warn(
        f"maskedbranch: CPU inductor compiles with its layout optimization (channels_last convolutions) "
        f"a graph that routes rows of shape {(counts[0], *x.shape[1:])}, a data-dependent row count. If a "
        "branch runs a convolution on them, the compiled step fails inductor's stride check "
        "(AssertionError: expected size ..., stride ... 'most often comes from a incorrect fake (aka "
        "meta) kernel for a custom op': the cause is PyTorch's fake convolution, which gives contiguous "
        "strides for a data-dependent batch). Compile with "
        'torch.compile(model, options={"layout_optimization": False}) (docs/guides/compile.md).',
        RoutedConvLayoutWarning,
        stacklevel=2,
    )


@torch.library.register_fake("maskedbranch::gather")
def _gather_fake(x, rows, weights, counts):
    _check_devices("x", x, rows=rows, weights=weights)
    fmt = row_format(x)
    _warn_routed_convolutions(x, counts)
    return [_empty_rows(c, x, fmt) for c in counts]


@torch.library.register_fake("maskedbranch::combine")
def _combine_fake(base, ys, weights, row_offsets, row_branch, row_pos):
    ref, ref_name = (base, "base") if base is not None else (ys[0], "ys[0]")
    _check_devices(ref_name, ref, weights=weights, row_offsets=row_offsets, row_branch=row_branch, row_pos=row_pos)
    _check_devices(ref_name, ref, **{f"ys[{i}]": y for i, y in enumerate(ys)})
    return _empty_rows(row_offsets.shape[0] - 1, ref, row_format(ref))


@torch.library.register_fake("maskedbranch::combine_weights_backward")
def _combine_weights_backward_fake(grad, ys, row_offsets, row_branch, row_pos):
    dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return grad.new_empty((row_offsets.shape[0] - 1, len(ys)), dtype=dtype)


def _per_branch(tensors, branches: int, name: str) -> int:
    """k, the tensors per branch (checked as the kernels check it)."""
    if branches < 1:
        raise ValueError(f"branches: expected at least 1, got {branches}")
    if len(tensors) % branches:
        raise ValueError(f"{name}: expected the same number of tensors for each of the {branches} branches, "
                         f"got {len(tensors)} tensors")
    return len(tensors) // branches


def _contiguous_like(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@torch.library.register_fake("maskedbranch::pick")
def _pick_fake(tensors, index, branches):
    k = _per_branch(tensors, branches, "tensors")
    return [_contiguous_like(t) for t in tensors[:k]]


@torch.library.register_fake("maskedbranch::pick_backward")
def _pick_backward_fake(grads, index, branches):
    if branches < 1:
        raise ValueError(f"branches: expected at least 1, got {branches}")
    return [_contiguous_like(g) for _ in range(branches) for g in grads]


@torch.library.register_fake("maskedbranch::put_")
def _put_fake(tensors, index, branches, values):
    if _per_branch(tensors, branches, "tensors") != len(values):
        raise ValueError(f"values: expected one tensor per tensor of a branch ({len(tensors) // branches}), "
                         f"got {len(values)}")
    return None


@torch.library.register_fake("maskedbranch::keep_draw")
def _keep_draw_fake(order, n, keep_prob):
    return torch.empty(n, dtype=torch.float32, device="cpu")
