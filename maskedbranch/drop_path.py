"""DropPath / stochastic depth: the two-branch special case of a masked layer.

A residual block ``out = x + drop_path(branch(x))`` is the masked layer ``base = x`` plus one
branch whose coefficient is ``mask[b] / keep_prob``. Two forms:

* :func:`drop_path` / :class:`DropPath` only see the branch output (drop-in replacements for
  timm's ``drop_path`` / ``DropPath``, plus torchvision's ``"batch"`` mode). The branch already
  ran, so they cannot skip compute; they draw the mask on the host and scale in one fused pass.
* :func:`drop_add_residual` / :class:`ResidualDropPath` own the branch: they run it on the kept
  rows only (``"row"``), or not at all when the whole batch is dropped (``"batch"``), and tie
  the branch's parameters into the graph when it did not run so that every parameter gets a
  gradient on every rank (DistributedDataParallel with ``find_unused_parameters=False``).

Semantics are those of timm / torchvision: Bernoulli(keep_prob) per row (``"row"``) or per call
(``"batch"``), scaled by ``1 / keep_prob`` when ``scale_by_keep`` and ``keep_prob > 0``, the
identity in eval mode or at ``drop_prob == 0``; ``drop_prob == 1`` drops everything (no
division by zero).

The mask is always drawn on the host from a CPU generator (torch's default one, or
``generator``) and shipped to the device asynchronously, so the CUDA path never synchronizes.
With the default generator, ranks draw whatever their seeding makes them draw (independent
when each rank seeds differently, as with timm). For identical draws on every rank, pass a CPU
``torch.Generator`` seeded with the same value on every rank and advanced in lockstep.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import _ops, _structure
from ._args import check_per_row_devices, route_args

__all__ = ["drop_path", "DropPath", "drop_add_residual", "ResidualDropPath"]

_MODES = ("row", "batch")


# ----------------------------------------------------------------------------------------------
# Argument checks and the host-side draw.


def _check_drop_prob(drop_prob: Any) -> float:
    if isinstance(drop_prob, Tensor):
        if drop_prob.numel() != 1:
            raise ValueError(f"drop_prob: expected a number in [0, 1], got a tensor of shape {tuple(drop_prob.shape)}")
        drop_prob = drop_prob.item()
    if isinstance(drop_prob, bool) or not isinstance(drop_prob, (int, float)):
        raise TypeError(f"drop_prob: expected a number in [0, 1], got {type(drop_prob).__name__}")
    p = float(drop_prob)
    if not (0.0 <= p <= 1.0):  # also rejects NaN
        raise ValueError(f"drop_prob: expected a probability in [0, 1], got {drop_prob}")
    return p


def _check_mode(mode: Any) -> str:
    if mode not in _MODES:
        raise ValueError(f"mode: expected 'row' (drop per sample) or 'batch' (drop the whole batch), got {mode!r}")
    return mode


def _check_generator(generator: Any) -> Optional[torch.Generator]:
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a CPU torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(
            f"generator: expected a CPU torch.Generator, got one on {generator.device}. The mask is "
            "drawn on the host so that the device never synchronizes; create the generator with "
            "torch.Generator() (device 'cpu')."
        )
    return generator


def _check_x(x: Any, name: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected at least one dimension (the batch first), got a 0-dim tensor")


def _check_floating(x: Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(
            "x: expected a floating-point tensor (float64, float32, float16 or bfloat16) to scale, "
            f"got dtype {x.dtype}"
        )


def _check_branch_output(y: Any, rows: int, x: Tensor) -> Tensor:
    if not isinstance(y, Tensor) or tuple(y.shape) != (rows, *x.shape[1:]):
        got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise ValueError(
            f"branch: a residual branch must return a tensor shaped like its input rows "
            f"({rows}, {', '.join(map(str, x.shape[1:]))}), got {got}"
        )
    return y


def _draw(n: int, keep_prob: float, generator: Optional[torch.Generator]) -> Tensor:
    """n Bernoulli(keep_prob) draws on the host as a float32 0/1 tensor. Same stream as timm's
    and torchvision's ``empty(...).bernoulli_(keep_prob)`` on a CPU tensor with the same seed."""
    return torch.empty(n, dtype=torch.float32).bernoulli_(keep_prob, generator=generator)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _keep_scale(keep_prob: float, scale_by_keep: bool, dtype: torch.dtype) -> float:
    """The factor of kept rows, rounded to ``dtype`` as timm and torchvision round it (they
    divide a mask of ``dtype`` by keep_prob), so that results match theirs bit for bit."""
    if not scale_by_keep or keep_prob == 0.0:
        return 1.0
    return _rounded_inverse(keep_prob, dtype)


def _to_float32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


@torch.compiler.assume_constant_result  # Dynamo runs it once per (keep_prob, dtype)
def _rounded_inverse(keep_prob: float, dtype: torch.dtype) -> float:
    """``torch.ones((), dtype=dtype).div_(keep_prob).item()`` in plain Python (no tensor, no
    ``.item()``: torch.compile sees a constant). float32, float16 and bfloat16 tensors divide in
    float32 by ``float32(keep_prob)``; the float32 quotient is then rounded to the dtype. The
    quotient of two float32 numbers computed in float64 and rounded to float32 is the correctly
    rounded float32 quotient (float64 has more than 2 * 24 + 2 bits), so this is exact."""
    if dtype == torch.float64:
        return 1.0 / keep_prob
    q = _to_float32(1.0 / _to_float32(keep_prob))
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


# ----------------------------------------------------------------------------------------------
# The timm-compatible form: scale an existing branch output.


def drop_path(
    x: Tensor,
    drop_prob: float = 0.0,
    training: bool = False,
    scale_by_keep: bool = True,
    mode: str = "row",
    *,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Stochastic depth on a branch output ``x`` (timm's ``drop_path`` plus torchvision's modes).

    ``"row"``: each row of ``x`` is kept with probability ``1 - drop_prob``; ``"batch"``: the whole
    tensor is kept or zeroed at once. Kept values are scaled by ``1 / (1 - drop_prob)`` when
    ``scale_by_keep`` (and ``drop_prob < 1``). Returns ``x`` itself in eval mode or at
    ``drop_prob == 0``. The mask is drawn on the host (``generator``: an optional CPU
    ``torch.Generator``) and applied in one fused pass without synchronizing the device.

    The branch that produced ``x`` already ran, so nothing is saved but the multiply; use
    :func:`drop_add_residual` to skip the branch on dropped rows.
    """
    _check_x(x)
    p = _check_drop_prob(drop_prob)
    _check_mode(mode)
    generator = _check_generator(generator)
    if p == 0.0 or not training:
        return x
    _check_floating(x)
    keep_prob = 1.0 - p
    scaled = scale_by_keep and keep_prob > 0.0
    # The factors are made as timm and torchvision make them (a 0/1 mask of x's dtype divided by
    # keep_prob), on the host: the same values bit for bit, and no data-dependent Python.
    if mode == "batch":
        noise = _draw(1, keep_prob, generator).to(x.dtype).reshape(())
        if scaled:
            noise.div_(keep_prob)
        return x * noise  # a 0-dim host tensor is read on the host: no device sync
    mask = _draw(x.shape[0], keep_prob, generator).to(x.dtype)
    if scaled:
        mask.div_(keep_prob)
    (mask,) = _ops._ship([mask.to(_opmath(x.dtype))], x.device)
    return _ops.drop_path_scale(x, mask)


class DropPath(nn.Module):
    """Module form of :func:`drop_path`; a drop-in swap for timm's ``DropPath`` (the identity in
    eval mode, same ``extra_repr``), with torchvision's ``mode="batch"`` as well.

    ``generator`` (keyword only): an optional CPU ``torch.Generator`` the masks are drawn from.
    """

    def __init__(
        self,
        drop_prob: float = 0.0,
        scale_by_keep: bool = True,
        mode: str = "row",
        *,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        self.drop_prob = _check_drop_prob(drop_prob)
        self.scale_by_keep = scale_by_keep
        self.mode = _check_mode(mode)
        self.generator = _check_generator(generator)

    def forward(self, x: Tensor) -> Tensor:
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep, self.mode, generator=self.generator)

    def extra_repr(self) -> str:
        s = f"drop_prob={round(self.drop_prob, 3):0.3f}"
        if self.mode != "row":
            s += f", mode={self.mode}"
        return s


# ----------------------------------------------------------------------------------------------
# The residual form: owns the branch, so it can skip the dropped rows.


def _branch_params(branch: Callable, params: Optional[Iterable[Tensor]]) -> List[Tensor]:
    if params is not None:
        return list(params)
    if isinstance(branch, nn.Module):
        return list(branch.parameters())
    owner = getattr(branch, "__self__", None)  # a bound method of a module
    if isinstance(owner, nn.Module):
        return list(owner.parameters())
    return []


def _select_rows(plan: _ops.Plan) -> Callable[[Tensor], Tensor]:
    def select(t: Tensor) -> Tensor:
        if t.is_floating_point():
            return _ops.gather(t, plan)  # deterministic backward
        return t.index_select(0, plan.rows)  # masks, ids: no gradient

    return select


def _skipped(x: Tensor, branch: Callable, params: Optional[Iterable[Tensor]], materialize: bool = False) -> Tensor:
    """``x`` when the branch does not run at all: the branch's parameters are tied into the
    graph, with undefined gradients (DDP's hooks fire and fill zeros for them) or, with
    ``materialize``, zero tensors (what FSDP2 and DDP's ``static_graph`` need). ``anchor``
    returns a view of its input; the clone gives callers a fresh tensor (as
    ``x + 0 * branch(x)`` would) that they may modify in place, e.g. with ``relu_``."""
    return _ops.anchor(x, _branch_params(branch, params), materialize).clone()


@torch.compiler.disable
def _row_plan(
    batch: int, keep_prob: float, generator: Optional[torch.Generator], device: torch.device
) -> Tuple[int, Optional[_ops.Plan]]:
    """Draw the row mask on the host and build the routing plan of the kept rows (None when all
    or none are kept). The kept count decides what runs: data-dependent Python, so under
    torch.compile this helper is the one graph break of a row-mode call."""
    mask = _draw(batch, keep_prob, generator)
    kept = int(mask.sum())  # a host tensor: no device sync
    if kept == batch or kept == 0:
        return kept, None
    ids = mask.to(torch.int64).sub_(1)  # 0 = kept (branch 0), -1 = dropped
    return kept, _ops.make_plan(ids, 1, device=device)


def _residual(
    x: Tensor,
    branch: Callable,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    drop_prob: float,
    training: bool,
    mode: str,
    scale_by_keep: bool,
    generator: Optional[torch.Generator],
    params: Optional[Iterable[Tensor]],
    materialize: bool = False,
) -> Tuple[Tensor, bool]:
    """The output, and whether the branch ran."""
    if drop_prob == 0.0 or not training:
        return x + branch(x, *args, **kwargs), True
    _check_floating(x)
    check_per_row_devices(args, kwargs, x)
    keep_prob = 1.0 - drop_prob
    scale = _keep_scale(keep_prob, scale_by_keep, x.dtype)
    batch = x.shape[0]

    if mode == "batch":
        if not bool(_draw(1, keep_prob, generator)[0]):
            return _skipped(x, branch, params, materialize), False
        return torch.add(x, _check_branch_output(branch(x, *args, **kwargs), batch, x), alpha=scale), True

    kept, plan = _row_plan(batch, keep_prob, generator, x.device)
    if kept == batch:  # nothing dropped: no gather, no plan; add and scale in one pass
        return torch.add(x, _check_branch_output(branch(x, *args, **kwargs), batch, x), alpha=scale), True
    if kept == 0:  # everything dropped: the branch does not run
        return _skipped(x, branch, params, materialize), False

    select = _select_rows(plan)
    args, kwargs = route_args(args, kwargs, batch, select)
    y = _check_branch_output(branch(select(x), *args, **kwargs), kept, x)
    base = x
    if y.dtype != x.dtype:  # autocast: a low-precision branch on a float32 residual stream
        dtype = torch.promote_types(x.dtype, y.dtype)
        base, y = x.to(dtype), y.to(dtype)
    weights = None
    if scale != 1.0:
        weights = torch.full((batch, 1), scale, dtype=_opmath(y.dtype), device=x.device)
    return _ops.combine([y], plan, weights=weights, base=base), True


def drop_add_residual(
    x: Tensor,
    branch: Callable[..., Tensor],
    drop_prob: float,
    training: bool,
    mode: str = "row",
    scale_by_keep: bool = True,
    generator: Optional[torch.Generator] = None,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    params: Optional[Iterable[Tensor]] = None,
    materialize_grads: bool = False,
) -> Tensor:
    """``x + drop_path(branch(x), drop_prob, training, scale_by_keep, mode)``, computing the
    branch only where it counts.

    * ``"row"``: the branch runs on the kept rows only (gathered into one packed batch); the
      scaled add is fused into one pass. Nothing dropped: ``x + scale * branch(x)`` in one pass,
      no gather. Everything dropped: the branch does not run.
    * ``"batch"``: the branch runs on the whole batch or not at all.

    When the branch does not run, its parameters (``branch.parameters()`` for a module or a
    bound method of one, else ``params``) still receive a gradient, so DistributedDataParallel
    with ``find_unused_parameters=False`` works: undefined (DDP fills zeros; no kernel per
    parameter), or zero tensors with ``materialize_grads=True`` (for FSDP2, which reduces only
    defined gradients, and DDP with ``static_graph=True``).
    ``args`` / ``kwargs`` are passed to the branch; tensors whose first dimension is the batch
    are routed with ``x`` (only the kept rows reach the branch).

    The mask is drawn on the host from ``generator`` (a CPU ``torch.Generator``; default: torch's
    default CPU generator). The branch must treat rows independently for the result to equal
    the dense formula (BatchNorm in training mode sees only the kept rows).
    """
    _check_x(x)
    p = _check_drop_prob(drop_prob)
    _check_mode(mode)
    generator = _check_generator(generator)
    if not callable(branch):
        raise TypeError(f"branch: expected a callable (a module or a function), got {type(branch).__name__}")
    return _residual(
        x, branch, tuple(args), dict(kwargs or {}), p, training, mode, scale_by_keep, generator, params,
        bool(materialize_grads),
    )[0]


def _runs_collectives(module: nn.Module) -> Optional[str]:
    for name, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm):
            return f"{type(m).__name__} at {name!r}" if name else type(m).__name__
    return None


class ResidualDropPath(_structure.InvalidatesOnApply, nn.Module):
    """``x + drop_path(branch(x, *args, **kwargs))`` with the branch run only on the kept rows
    (``mode="row"``) or skipped when the batch is dropped (``mode="batch"``). See
    :func:`drop_add_residual`.

    Extra positional / keyword tensors whose first dimension is the batch are routed with ``x``
    (an attention mask, per-sample conditioning); other arguments pass through unchanged.
    ``generator`` (keyword only): an optional CPU ``torch.Generator`` for the masks; seed it
    identically on every rank for identical draws across ranks. ``materialize_grads`` (keyword
    only): a skipped branch's parameters get zero tensors rather than undefined gradients (for
    FSDP2 and DDP's ``static_graph=True``; plain DDP fills the undefined ones itself).

    Branches that run collectives (``SyncBatchNorm``) cannot be skipped on one rank while the
    others run them (the collective would hang); they are refused in training with
    ``drop_prob > 0``. With :func:`maskedbranch.unused_grads_to_none`, a branch dropped on every
    rank gets ``None`` gradients, so the optimizer skips it.
    """

    def __init__(
        self,
        branch: nn.Module,
        drop_prob: float = 0.0,
        mode: str = "row",
        scale_by_keep: bool = True,
        *,
        generator: Optional[torch.Generator] = None,
        materialize_grads: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(branch, nn.Module):
            raise TypeError(f"branch: expected an nn.Module, got {type(branch).__name__}")
        self.branch = branch
        self.drop_prob = _check_drop_prob(drop_prob)
        self.mode = _check_mode(mode)
        self.scale_by_keep = scale_by_keep
        self.generator = _check_generator(generator)
        self.materialize_grads = bool(materialize_grads)
        self._usage = _structure.Usage()
        self._facts: _structure.StructureCache[Tuple[Optional[str], Tuple[Tensor, ...]]] = _structure.StructureCache()

    def _branch_facts(self) -> Tuple[Optional[str], Tuple[Tensor, ...]]:
        """(the collective the branch runs or None, its parameters), walked again only after the
        module structure may have changed (convert_sync_batchnorm typically runs after
        construction)."""
        facts = self._facts.peek()
        if facts is None:
            facts = self._facts.get(lambda: (_runs_collectives(self.branch), tuple(self.branch.parameters())))
        return facts

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        p = _check_drop_prob(self.drop_prob)
        _check_mode(self.mode)
        collective, params = self._branch_facts()
        if collective is not None and self.training and p > 0.0:
            raise RuntimeError(
                f"ResidualDropPath: the branch contains {collective}, which runs collectives; "
                "skipping it on some ranks only would hang the others. Use BatchNorm (or another "
                "per-rank layer) in a branch that can be dropped, or set drop_prob=0."
            )
        _check_x(x)
        out, ran = _residual(
            x, self.branch, args, kwargs, p, self.training, self.mode, self.scale_by_keep, self.generator, params,
            self.materialize_grads,
        )
        if ran and torch.is_grad_enabled():
            self._usage.bits = 1
        return out

    def _units(self) -> List[Tuple[nn.Module, Tuple[Tensor, ...]]]:
        """The branch and its parameters: the one unit whose use ``_usage`` records, for
        :func:`maskedbranch.unused_grads_to_none`."""
        return [(self.branch, self._branch_facts()[1])]

    def extra_repr(self) -> str:
        s = f"drop_prob={round(self.drop_prob, 3):0.3f}, mode={self.mode}"
        if not self.scale_by_keep:
            s += ", scale_by_keep=False"
        return s
