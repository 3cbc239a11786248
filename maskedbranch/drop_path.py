"""DropPath / stochastic depth: the two-branch special case of a masked layer.

A residual block ``out = x + drop_path(branch(x))`` is the routed layer ``base = x`` plus one
branch whose coefficient is ``mask[b] / keep_prob``. Two forms:

* :func:`drop_path` / :class:`DropPath` only see the branch output: drop-in replacements for
  timm's ``drop_path`` / ``DropPath`` (the same formula, draws, strides and repr) and
  torchvision's ``stochastic_depth`` (``mode="batch"``). The branch already ran, so they cannot
  skip its compute.
* :func:`drop_add_residual` / :class:`ResidualDropPath` own the branch: they run it on the kept
  rows only (``"row"``), or not at all when the whole batch is dropped (``"batch"``), through
  the routing path that MaskedBranch uses (maskedbranch/_route.py), and tie the branch's
  parameters into the graph when it did not run.

Semantics are timm's and torchvision's: Bernoulli(keep_prob) per row or per call, scaled by
``1 / keep_prob`` when ``scale_by_keep`` and ``keep_prob > 0``; the identity in eval mode or at
``drop_prob == 0``; ``drop_prob == 1`` drops everything.

Draws: :func:`drop_path` draws where timm does (a tensor on x's device, from that device's
default generator), so that the masks equal timm's for the same seed. The residual forms need
the kept count on the host, so they draw on the host from the default CPU generator (on a GPU,
timm would draw from the CUDA one). ``generator=`` (a CPU ``torch.Generator``) overrides both.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import _compat, _dead_grads, _draws, _route, _structure, unused_grads
from ._args import check_per_row_devices

__all__ = ["drop_path", "DropPath", "drop_add_residual", "ResidualDropPath"]

_MODES = ("row", "batch")


# ----------------------------------------------------------------------------------------------
# Argument checks.


def _check_drop_prob(drop_prob: Any) -> Any:
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
            f"generator: expected a CPU torch.Generator, got one on {generator.device}. Masks are drawn on "
            "the host so that the device never synchronizes; create it with torch.Generator()."
        )
    return generator


def _check_x(x: Any) -> None:
    if isinstance(x, torch.fx.Proxy):
        return  # symbolic tracing: shapes are unknown
    _route.check_x(x)
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor (float64, float32, float16 or bfloat16), got dtype {x.dtype}")


def _check_branch_output(y: Any, rows: int, x: Tensor) -> Tensor:
    if not isinstance(y, Tensor) or tuple(y.shape) != (rows, *x.shape[1:]):
        got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise ValueError(
            f"branch: a residual branch must return a tensor shaped like its input rows "
            f"({rows}, {', '.join(map(str, x.shape[1:]))}), got {got}"
        )
    return y


# ----------------------------------------------------------------------------------------------
# The timm-compatible form: scale an existing branch output.


def drop_path(
    x: Tensor,
    drop_prob: float = 0.0,
    training: bool = False,
    scale_by_keep: bool = True,
    mode: str = "row",
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Stochastic depth on a branch output ``x``: timm's ``drop_path`` (``mode="row"``, the
    default) and torchvision's ``stochastic_depth`` (``mode="batch"`` drops the whole tensor).

    Returns ``x`` itself in eval mode or at ``drop_prob == 0``; otherwise ``x * mask`` with the
    mask drawn and scaled exactly as timm draws and scales it (so the results are bitwise equal
    for the same seed, and the output keeps x's strides). ``generator``: a CPU
    ``torch.Generator`` to draw from instead (the mask is then shipped to x's device).

    The branch that produced ``x`` already ran: use :func:`drop_add_residual` to skip it.
    """
    _check_x(x)
    p = _check_drop_prob(drop_prob)
    _check_mode(mode)
    generator = _check_generator(generator)
    if p == 0.0 or not training:
        return x
    keep_prob = 1.0 - p
    shape = (x.shape[0],) + (1,) * (x.ndim - 1) if mode == "row" else (1,) * x.ndim
    if generator is None:
        mask = x.new_empty(shape).bernoulli_(keep_prob)
    else:
        mask = torch.empty(shape, dtype=x.dtype).bernoulli_(keep_prob, generator=generator)
        mask = mask.to(x.device, non_blocking=True)
    if keep_prob > 0.0 and scale_by_keep:
        # The result is used, so that a torch.fx graph keeps the division: dead-code
        # elimination (create_feature_extractor runs it) drops an in-place op whose result is unused.
        mask = mask.div_(keep_prob)
    return x * mask


class DropPath(nn.Module):
    """Module form of :func:`drop_path`; a drop-in swap for timm's ``DropPath`` (same attributes,
    repr and results) with torchvision's ``mode="batch"`` as well. ``generator``: an optional CPU
    ``torch.Generator`` the masks are drawn from.

    ``torch.jit.script`` compiles the module itself (as it compiles timm's): the same formula,
    drawing from the default generator of x's device. Symbolic tracing (``torch.fx``) records
    the formula's ops, as for timm's.
    """

    def __init__(
        self,
        drop_prob: float = 0.0,
        scale_by_keep: bool = True,
        mode: str = "row",
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        self.drop_prob = _check_drop_prob(drop_prob)
        self.scale_by_keep = scale_by_keep
        self.mode = _check_mode(mode)
        self.generator = _check_generator(generator)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone
            return _scriptable_drop_path(x, float(self.drop_prob), self.training, self.scale_by_keep, self.mode)
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep, self.mode, self.generator)

    def extra_repr(self) -> str:
        s = f"drop_prob={round(self.drop_prob, 3):0.3f}"
        return s if self.mode == "row" else s + f", mode={self.mode}"

    def __prepare_scriptable__(self) -> nn.Module:
        # The module scripts as it is (a replacement returned here would also take its place in
        # the Python model). TorchScript types attributes by value: a numpy scalar has no type.
        if not isinstance(self.drop_prob, (int, float)):
            self.drop_prob = float(self.drop_prob)
        return self


def _scriptable_drop_path(x: Tensor, drop_prob: float, training: bool, scale_by_keep: bool, mode: str) -> Tensor:
    """:func:`drop_path` as TorchScript compiles it: the same formula, from the default generator."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1.0 - drop_prob
    shape = [1] * x.dim()
    if mode == "row":
        shape[0] = x.shape[0]
    mask = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        mask = mask.div_(keep_prob)
    return x * mask


# ----------------------------------------------------------------------------------------------
# The residual form: owns the branch, so it can skip the dropped rows.


def _branch_params(branch: Callable, params: Optional[Iterable[Tensor]]) -> Tuple[Tensor, ...]:
    if params is not None:
        return tuple(params)
    if isinstance(branch, nn.Module):
        return tuple(branch.parameters())
    owner = getattr(branch, "__self__", None)  # a bound method of a module
    return tuple(owner.parameters()) if isinstance(owner, nn.Module) else ()


class _Checked:
    """The branch, with the residual form's check of its output (shaped like its input rows)."""

    __slots__ = ("branch",)

    def __init__(self, branch: Callable):
        self.branch = branch

    def __call__(self, h: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self.check(self.branch(h, *args, **kwargs), h)

    def check(self, y: Any, h: Tensor) -> Tensor:
        return _check_branch_output(y, h.shape[0], h)


def _residual(
    x: Tensor,
    table: _structure.Branches,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    drop_prob: float,
    training: bool,
    mode: str,
    scale_by_keep: bool,
    generator: Optional[torch.Generator],
    materialize: Optional[bool],
    where: str,
) -> Tuple[Tensor, bool]:
    """The output, and whether the branch ran."""
    if drop_prob == 0.0 or not training or isinstance(x, torch.fx.Proxy):
        # Nothing dropped, or symbolic tracing (which cannot follow data-dependent routing): the
        # dense formula. Under tracing shapes are unknown: the branch itself, without the check
        # of its output's shape.
        branch = table.branches[0]
        if isinstance(x, torch.fx.Proxy):
            branch = branch.branch
        y = branch(x, *args, **kwargs)
        return x + drop_path(y, drop_prob, training, scale_by_keep, mode, generator), True
    if args or kwargs:  # before the draw: a refused call leaves the generator where it was
        check_per_row_devices(args, kwargs, x)
    keep_prob = 1.0 - float(drop_prob)
    host = _draws.host_routing_outside_graphs if torch.compiler.is_compiling() else _draws.host_routing
    gate, scale = host(mode, x.shape[0], keep_prob, scale_by_keep, x.dtype, generator)
    zeros = _dead_grads.tie_policy(materialize, where)
    out, live = _route.route(table, x, gate, args, kwargs, zeros=zeros, base=x, scale=scale, where="branch")
    return out, bool(live)


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
    materialize_grads: Optional[bool] = True,
) -> Tensor:
    """``x + drop_path(branch(x), drop_prob, training, scale_by_keep, mode)``, computing the
    branch only where it counts.

    * ``"row"``: the branch runs on the kept rows only (gathered into one batch), and the scaled
      add is fused into one pass. Nothing dropped: ``x + scale * branch(x)``, no gather.
      Everything dropped: the branch does not run.
    * ``"batch"``: the branch runs on the whole batch or not at all.

    When the branch does not run, its parameters (``branch.parameters()`` for a module or a
    bound method of one, else ``params``) still get a gradient: zeros, exactly what the dense
    formula gives them (``materialize_grads=True``, the default; in every setting, one process
    included), so training equals timm's and DDP works with ``find_unused_parameters=False``.
    ``materialize_grads=False``: undefined gradients (DDP fills zeros); ``None``: as
    :class:`MaskedBranch` (if/else semantics: no gradient in one process, and unused branches'
    gradients reset to ``None`` before distributed optimizer steps).
    ``args`` / ``kwargs`` go to the branch; tensors whose first dimension is the batch are
    routed with ``x``. The mask is drawn on the host (``generator``: a CPU ``torch.Generator``;
    default: torch's default CPU generator). The branch must treat rows independently for the
    result to equal the dense formula (BatchNorm in training mode sees only the kept rows).
    """
    _check_x(x)
    p = _check_drop_prob(drop_prob)
    _check_mode(mode)
    generator = _check_generator(generator)
    if not callable(branch):
        raise TypeError(f"branch: expected a callable (a module or a function), got {type(branch).__name__}")
    if training and p > 0 and isinstance(branch, nn.Module):
        _structure.check_skippable([branch], "branch")  # the policy of every routing module
    table = _structure.Branches([_Checked(branch)], params=[_branch_params(branch, params)])
    out, ran = _residual(
        x, table, tuple(args), dict(kwargs or {}), p, training, mode, scale_by_keep, generator,
        materialize_grads, "drop_add_residual",
    )
    if materialize_grads is None and isinstance(branch, nn.Module) and torch.is_grad_enabled() and _dead_grads.distributed():
        unused_grads.record_functional([branch], int(ran))  # for the step-time pruning
    return out


class ResidualDropPath(_structure.InvalidatesOnApply, nn.Module):
    """``x + drop_path(branch(x, *args, **kwargs))`` with the branch run only on the kept rows
    (``mode="row"``) or skipped when the batch is dropped (``mode="batch"``). See
    :func:`drop_add_residual`.

    Extra positional / keyword tensors whose first dimension is the batch are routed with ``x``
    (an attention mask, per-sample conditioning); other arguments pass through unchanged.
    ``generator`` (keyword only): an optional CPU ``torch.Generator`` for the masks.
    ``materialize_grads`` (keyword only): as for :func:`drop_add_residual` (default ``True``: a
    skipped branch's parameters get zero gradients, as timm's dense formula gives them).

    Branches that run collectives (``SyncBatchNorm``, DDP/FSDP units, DTensor parameters) cannot
    be skipped on one rank while the others run them; they are refused in training with
    ``drop_prob > 0``. Symbolic tracing (``torch.fx``) records the dense formula
    ``x + drop_path(branch(x))`` (which rows are kept is data the trace cannot see).
    ``torch.jit.script`` compiles that dense formula for ``forward(x)``; as for any module with
    ``__prepare_scriptable__``, torch also puts the dense form in this module's place in the
    Python model it was given, so script a ``copy.deepcopy`` of a model you keep training.
    """

    def __init__(
        self,
        branch: nn.Module,
        drop_prob: float = 0.0,
        mode: str = "row",
        scale_by_keep: bool = True,
        *,
        generator: Optional[torch.Generator] = None,
        materialize_grads: Optional[bool] = True,
    ) -> None:
        super().__init__()
        if not isinstance(branch, nn.Module):
            raise TypeError(f"branch: expected an nn.Module, got {type(branch).__name__}")
        self.branch = branch
        self.drop_prob = _check_drop_prob(drop_prob)
        self.mode = _check_mode(mode)
        self.scale_by_keep = scale_by_keep
        self.generator = _check_generator(generator)
        if materialize_grads is not None and not isinstance(materialize_grads, bool):
            raise TypeError(f"materialize_grads: expected None (automatic), True or False, got {type(materialize_grads).__name__}")
        self.materialize_grads = materialize_grads
        self._cache: Optional[_structure.Branches] = None
        self._checked_branch = _Checked(branch)
        self._usage = unused_grads.Usage()
        unused_grads.register(self)

    def _checked(self) -> _Checked:
        """The branch with its output check: one object while the branch stays, since compiled
        frames guard on its identity (a new one per call recompiled whenever its address changed)."""
        checked = self._checked_branch
        if checked.branch is not self.branch:
            checked = _Checked(self.branch)
            if not torch.compiler.is_compiling():
                self._checked_branch = checked
        return checked

    def _table(self) -> _structure.Branches:
        if _compat.tracing():  # built afresh (MaskedBranch._branches)
            return _structure.Branches([self._checked()], params=[tuple(self.branch.parameters())])
        cache = self._cache
        if not _structure.current(cache):
            cache = _structure.Branches([self._checked()], _structure.version(), [tuple(self.branch.parameters())])
            if not torch.compiler.is_compiling():  # torch.export (strict) refuses module mutation
                self._cache = cache
        return cache

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        p = _check_drop_prob(self.drop_prob)
        _check_mode(self.mode)
        _check_x(x)
        table = self._table()
        if self.training and p > 0 and table.skippable is None:
            _structure.check_skippable([self.branch], "branch")
            table.skippable = True
        out, ran = _residual(
            x, table, args, kwargs, p, self.training, self.mode, self.scale_by_keep, self.generator,
            self.materialize_grads, "ResidualDropPath",
        )
        if torch.is_grad_enabled() and not isinstance(x, torch.fx.Proxy):
            self._usage.record(int(ran))  # also when dropped: it notes the DDP model around
        return out

    def _unit_modules(self) -> List[nn.Module]:
        return [self.branch]

    def _units(self) -> List[Sequence[Tensor]]:
        return [tuple(self.branch.parameters())]

    def extra_repr(self) -> str:
        s = f"drop_prob={round(self.drop_prob, 3):0.3f}, mode={self.mode}"
        return s if self.scale_by_keep else s + ", scale_by_keep=False"

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._cache = None
        self._checked_branch = _Checked(self.branch)  # also for modules pickled without it
        self._usage = unused_grads.Usage()
        unused_grads.register(self)

    def __prepare_scriptable__(self) -> nn.Module:
        return _ScriptableResidual(self.branch, DropPath(self.drop_prob, self.scale_by_keep, self.mode).train(self.training))


class _ScriptableResidual(nn.Module):
    """What ``torch.jit.script`` compiles in place of :class:`ResidualDropPath`: the dense formula."""

    def __init__(self, branch: nn.Module, drop: nn.Module):
        super().__init__()
        self.branch = branch
        self.drop = drop

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.branch(x))
