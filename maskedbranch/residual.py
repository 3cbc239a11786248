"""The residual drop paths, which own their branch and so skip its compute:
``x + drop_path(branch(x))`` as the routed layer ``base = x`` plus one branch whose coefficient
is ``mask[b] / keep_prob`` (maskedbranch/_route.py).

* ``kept="random"`` (default): timm's and torchvision's distribution, each row kept with
  probability ``1 - drop_prob`` (``mode="row"``) or the whole batch (``"batch"``). The mask is
  drawn on the host (torch's default CPU generator, or ``generator=``), the kept rows are
  gathered, the branch runs on them and the scaled result is added back in one pass.
* ``kept="fixed"``: exactly ``max(1, round(B * (1 - drop_prob)))`` rows, chosen at random on x's
  device, scaled by ``B / kept`` (DINOv2's ``drop_add_residual_stochastic_depth``): static
  shapes, no host read, so a compiled model can be captured in a CUDA graph. A different
  distribution of the kept count than timm's, so opt-in.

When the branch does not run, its parameters get zero gradients by default, as timm's dense
formula gives them. Settings after ``drop_prob`` / ``training`` are keyword-only
(maskedbranch/_drop_args.py).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import _choice, _compat, _draws, _functional, _route, _structure, _unit, _warn
from ._args import check_per_row_devices, route_args
from ._drop_args import (
    check_bool,
    check_drop_prob,
    check_generator,
    check_kept,
    check_mode,
    check_x,
    refuse_positional,
    training_flag,
)
from ._unit import Tying, materialize, materialize_name
from .drop_path import DropPath, _drop, _drop_path

__all__ = ["drop_add_residual", "ResidualDropPath"]


def _branch_params(branch: Callable, params: Optional[Iterable[Tensor]]) -> Tuple[Tensor, ...]:
    if params is not None:
        return tuple(params)
    if isinstance(branch, nn.Module):
        return tuple(branch.parameters())
    owner = getattr(branch, "__self__", None)  # a bound method of a module
    return tuple(owner.parameters()) if isinstance(owner, nn.Module) else ()


def _fixed(x: Tensor, branch: Callable, args, kwargs, keep_prob: float, scale_by_keep: bool, generator) -> Tensor:
    """``kept="fixed"``: exactly k random rows through the branch, added back scaled by B / k
    (index_add with distinct rows: each output row gets one addition, so the result is
    deterministic)."""
    batch = x.shape[0]
    k = max(1, int(batch * keep_prob + 0.5))
    if generator is None:
        idx = torch.randperm(batch, device=x.device)[:k]
    else:
        idx = torch.randperm(batch, generator=generator)[:k].to(x.device, non_blocking=True)
    a, kw = route_args(args, kwargs, batch, lambda t: t.index_select(0, idx))
    y = branch(x.index_select(0, idx), *a, **kw)
    return torch.index_add(x, 0, idx, y.to(x.dtype), alpha=batch / k if scale_by_keep else 1.0)


def _residual(
    x: Tensor, table: _structure.Branches, args: Tuple[Any, ...], kwargs: Dict[str, Any], drop_prob: Any,
    training: bool, mode: str, scale_by_keep: bool, generator: Optional[torch.Generator], kept: str,
    tie: Callable[[], Tying], reducer: Any = None, stateless: Optional[bool] = None,
) -> Tuple[Tensor, Any]:
    """The output, and which groups ran (for the unit's record). ``tie()``: the unit's tying
    (maskedbranch/_unit.py), asked once the call routes."""
    if drop_prob == 0.0 or not training or isinstance(x, torch.fx.Proxy):
        # Nothing dropped, or symbolic tracing (which cannot follow data-dependent routing): the
        # dense formula. Under tracing shapes are unknown: the branch itself, without the check
        # of its output's shape.
        branch = table.branches[0]
        if isinstance(x, torch.fx.Proxy):
            branch = branch.branch
        y = branch(x, *args, **kwargs)
        return x + _drop(y, drop_prob, training, scale_by_keep, mode, generator), 1
    if args or kwargs:  # before the draw: a refused call leaves the generator where it was
        check_per_row_devices(args, kwargs, x)
    if kept == "fixed":
        return _fixed(x, table.branches[0], args, kwargs, 1.0 - float(drop_prob), scale_by_keep, generator), 1
    out, ran, gate, scale = dispatch(table.branches[0], x, x, args, kwargs, drop_prob, mode, scale_by_keep,
                                     generator, x.dtype, tie, stateless)
    if out is not None:
        return out, ran
    return _route.route(table, x, gate, args, kwargs,
                        _route.Call(tie(), base=x, scale=scale, where="branch", reducer=reducer, drawn=True))


# ----------------------------------------------------------------------------------------------
# The draw, and under torch.compile which form a drop path takes (docs/guides/compile.md).

_ROWS, _COND, _DENSE = 0, 1, 2


def dispatch(branch: _structure.CheckedBranch, x: Tensor, base: Optional[Tensor], args: Tuple[Any, ...],
             kwargs: Dict[str, Any], drop_prob: Any, mode: str, scale_by_keep: bool,
             generator: Optional[torch.Generator], dtype: torch.dtype, tie: Callable[[], Tying],
             stateless: Optional[bool], signature: Optional[Tuple[tuple, torch.dtype]] = None,
             ) -> Tuple[Optional[Tensor], Any, Any, Any]:
    """One drop path's draw and, compiled, its computation: the one dispatch of the residual forms
    (``base``: x) and the timm patch's drop path without a residual (``base`` None: the branch's
    output on the kept rows, zeros elsewhere, of ``signature``, (trailing shape, dtype)).

    Returns ``(out, ran, None, None)`` when the output is computed here (compiled: the forms of
    :func:`compiled_form`), else ``(None, None, gate, scale)``: the routing gate (0: run, -1: not;
    one per row or for the batch) and the factor of kept rows, rounded in ``dtype``, for the
    caller's :func:`maskedbranch._route.route` (eager mode, a user's generator, DDP's Python
    reducer). ``branch``: the branch with the residual's output check (applied where ``base``
    is given)."""
    keep_prob = 1.0 - float(drop_prob)
    if not torch.compiler.is_compiling():
        gate, scale = _draws.host_routing(mode, x.shape[0], keep_prob, scale_by_keep, dtype, generator)
        return None, None, gate, scale
    if generator is not None:  # a generator object cannot enter a graph: this draw runs eagerly (a graph break)
        gate, scale = _draws.host_routing_outside_graphs(mode, x.shape[0], keep_prob, scale_by_keep, dtype, generator)
        return None, None, gate, scale
    fn, run = branch.branch, (branch if base is not None else branch.branch)
    module = fn if branch.is_module else None
    form = compiled_form(mode, tie, fn, stateless, branch.is_module)
    keep = _draws.draw(x.shape[0] if mode == "row" else 1, keep_prob)
    if form == _DENSE:  # timm's formula with this draw
        y = _drop_path(run(x, *args, **kwargs), drop_prob, True, scale_by_keep, mode, keep)
        return (y if base is None else base + y), (keep != 0).any().reshape(1), None, None
    scale = _draws.traced_scale(keep_prob, scale_by_keep, dtype)
    if form == _COND:
        kept = keep.reshape(()) != 0
        if base is None:
            return _choice.masked(fn, x, kept, tuple(args), scale, signature), kept.reshape(1), None, None
        return _choice.residual(fn, module, x, kept, args, kwargs, scale, branch.check), kept.reshape(1), None, None
    keep = keep if mode == "row" else keep.expand(x.shape[0])
    if tie() is not Tying.ALIASES:
        out, ran = _route.drop_rows(run, module, x, keep, scale, tuple(args), kwargs, base, "branch")
        return out, ran, None, None
    return None, None, keep.to(torch.int64) - 1, scale


def compiled_form(mode: str, tie: Callable[[], Tying], branch: Any, stateless: Optional[bool], module: bool) -> int:
    """How a drop path computes in a compiled graph:

    * ``_COND``: "batch" mode, one ``torch.cond`` that runs the branch or not (torch >= 2.13; a
      module branch's buffers carried, a function branch only when known to change no state);
    * ``_ROWS``: the routed rows (the kept rows only), where this trace captures data-dependent
      row counts (the two capture flags, or fullgraph on torch >= 2.13), and for a branch that
      normalizes over the batch (training modules with buffers: BatchNorm), which the dense
      formula would give every row;
    * ``_DENSE``: otherwise, timm's formula ``x + branch(x) * mask / keep_prob`` with the same
      draw: no data-dependent size, no graph break, every row computed (warned once). A
      function branch of unknown state is taken to treat rows independently, as
      :func:`drop_add_residual` asks of it for results equal to the dense formula.

    ``module``: whether ``branch`` is a module (known to the caller)."""
    if mode == "batch" and (module or stateless is True) and _choice.cond_available() and not _route._exporting():
        if tie() is not Tying.ALIASES:
            return _COND
    if (module and _batch_state(branch)) or stateless is False or rows_captured():
        return _ROWS
    return _DENSE


def _batch_state(module: nn.Module) -> bool:
    return any(m.training and len(m._buffers) > 0 for m in module.modules())


@torch.compiler.assume_constant_result
def rows_captured() -> bool:
    """While torch.compile traces: whether routed rows can be captured (maskedbranch/_compat.py),
    and when not, the warning, once per process."""
    captured = _compat.captures_data_dependent()
    if not captured:
        _warn.warn_once(
            "dense drop path",
            "maskedbranch: torch.compile traces a drop path without torch._dynamo.config.capture_scalar_outputs "
            "and capture_dynamic_output_shape_ops, so its branch runs on every row (timm's dense formula, with "
            "the same draws and results as eager mode): no graph break, but no compute skipped. Set both to True "
            "before compiling (or compile with fullgraph=True on torch >= 2.13) to run the branch on the kept "
            "rows only (docs/guides/compile.md).",
        )
    return captured


def _settings(mode: Any, scale_by_keep: Any, generator: Any, kept: Any):
    mode = check_mode(mode)
    return mode, check_bool(scale_by_keep, "scale_by_keep"), check_generator(generator), check_kept(kept, mode)


def drop_add_residual(
    x: Tensor,
    branch: Callable[..., Tensor],
    drop_prob: float,
    training: bool,
    *extra: Any,
    mode: str = "row",
    scale_by_keep: bool = True,
    generator: Optional[torch.Generator] = None,
    kept: str = "random",
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    params: Optional[Iterable[Tensor]] = None,
    materialize_grads: Any = True,
) -> Tensor:
    """``x + drop_path(branch(x), drop_prob, training, mode=mode, scale_by_keep=scale_by_keep)``,
    computing the branch only where it counts.

    * ``mode="row"`` (default): the branch runs on the kept rows only (gathered into one batch),
      and the scaled add is fused into one pass. Nothing dropped: ``x + scale * branch(x)``, no
      gather. Everything dropped: the branch does not run. ``kept="fixed"``: see the module's
      docstring (DINOv2's fixed kept count).
    * ``mode="batch"``: the branch runs on the whole batch or not at all.

    When the branch does not run, its parameters (``branch.parameters()`` for a module or a
    bound method of one, else ``params``) still get a gradient: zeros, exactly what the dense
    formula gives them (``materialize_grads=True``, the default; in every setting, one process
    included), so training equals timm's and DDP works with ``find_unused_parameters=False``.
    ``materialize_grads=False``: undefined gradients (DDP fills zeros); ``None``: as
    :class:`maskedbranch.MaskedBranch` (if/else: no gradient in one process; under a
    data-parallel wrapper, gradients of branches no rank ran are reset to ``None`` before the
    step). ``args`` / ``kwargs`` go to the branch; tensors whose first dimension is the batch are
    routed with ``x``. The mask is drawn on the host (``generator``: a CPU ``torch.Generator``;
    default: torch's default CPU generator). The branch must treat rows independently for the
    result to equal the dense formula (BatchNorm in training mode sees only the kept rows).
    """
    check_x(x)
    p = check_drop_prob(drop_prob)
    training = training_flag(training, "drop_add_residual")  # first: torchvision's order has a string here
    refuse_positional("drop_add_residual", extra)
    mode, scale_by_keep, generator, kept = _settings(mode, scale_by_keep, generator, kept)
    return add_residual(x, branch, p, training, mode, scale_by_keep, generator, kept, args, kwargs, params,
                        materialize(materialize_grads))


def add_residual(x, branch, p, training, mode, scale_by_keep, generator, kept, args, kwargs, params, materialize_grads,
                 module: Optional[bool] = None, owner: Optional[nn.Module] = None, stateless: Optional[bool] = None,
                 read_params: Optional[Callable[[], Tuple[Tensor, ...]]] = None) -> Tensor:
    """:func:`drop_add_residual` with checked arguments (the timm patch calls it directly, with
    ``module=False`` for its closures, which Dynamo before 2.7 cannot take isinstance of,
    ``owner``, its block, whose unit decides, ``stateless``, whether its function branch
    changes no module state (no BatchNorm in training; None: not known), and ``read_params``,
    which reads the branch's parameters in place of ``params`` when a call needs them)."""
    if module is None:
        if not callable(branch):
            raise TypeError(f"branch: expected a callable (a module or a function), got {type(branch).__name__}")
        module = isinstance(branch, nn.Module)
    if training and p > 0 and module:
        _structure.check_skippable([branch], "branch")  # the policy of every routing module

    def branch_params() -> Tuple[Tensor, ...]:
        return tuple(read_params()) if read_params is not None else _branch_params(branch, params)

    if torch.compiler.is_compiling():
        # Every branch is in the graph: only DDP's Python reducer needs the tying and the
        # parameters (aliases). Not read otherwise: Dynamo would trace the module walk per call.
        traced = _unit.traced_tying(owner) if owner is not None else Tying.SKIP
        table = _structure.Branches([_structure.CheckedBranch(branch, module)],
                                    params=[branch_params() if traced is Tying.ALIASES else ()])
        return _residual(x, table, tuple(args), dict(kwargs or {}), p, training, mode, scale_by_keep, generator,
                         kept, lambda: traced, stateless=stateless)[0]
    table = _structure.Branches([_structure.CheckedBranch(branch, module)], params=[branch_params()])
    if owner is not None:
        unit = owner._unit
    else:
        unit = _functional.unit_for(branch, "drop_add_residual") if module else _functional.FUNCTIONS

    def tie() -> Tying:
        unit.tying_here()
        return unit.tying_for(materialize_grads)

    out, ran = _residual(x, table, tuple(args), dict(kwargs or {}), p, training, mode, scale_by_keep, generator,
                         kept, tie, unit.reducer)
    if materialize_grads is None and module and owner is None:
        _route.record(unit, ran)  # for the reset of unused gradients
    return out


class ResidualDropPath(_unit.UnitOwner, _structure.CacheOwner, nn.Module):
    """``x + drop_path(branch(x, *args, **kwargs))`` with the branch run only on the kept rows
    (``mode="row"``) or skipped when the batch is dropped (``mode="batch"``):
    ``ResidualDropPath(branch, drop_prob=0.0, *, mode="row", scale_by_keep=True, kept="random",
    generator=None, materialize_grads=True)``. See :func:`drop_add_residual`.

    Extra positional / keyword tensors whose first dimension is the batch are routed with ``x``
    (an attention mask, per-sample conditioning); other arguments pass through unchanged.
    ``generator``: an optional CPU ``torch.Generator`` for the masks. ``materialize_grads``: as
    for :func:`drop_add_residual` (default ``True``: a skipped branch's parameters get zero
    gradients, as timm's dense formula gives them).

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
        *extra: Any,
        mode: str = "row",
        scale_by_keep: bool = True,
        kept: str = "random",
        generator: Optional[torch.Generator] = None,
        materialize_grads: Any = True,
    ) -> None:
        super().__init__()
        refuse_positional("ResidualDropPath", extra)
        if not isinstance(branch, nn.Module):
            raise TypeError(f"branch: expected an nn.Module, got {type(branch).__name__}")
        self.branch = branch
        self.drop_prob = check_drop_prob(drop_prob)
        self.mode, self.scale_by_keep, self.generator, self.kept = _settings(mode, scale_by_keep, generator, kept)
        self._own_unit(materialize(materialize_grads))

    @property
    def materialize_grads(self) -> Optional[bool]:
        return self._unit.materialize

    @materialize_grads.setter
    def materialize_grads(self, value: Any) -> None:
        self._unit.materialize = materialize(value)
        self._unit.forget()

    def _drop_caches(self) -> None:
        unit = self.__dict__.get("_unit")
        if unit is not None:
            unit.forget()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "branch" and "_unit" in self.__dict__:
            self._drop_caches()

    def _checked(self) -> _structure.CheckedBranch:
        """The branch with its output check: one object while the branch stays, since compiled
        frames guard on its identity (a new one per call recompiled whenever its address changed)."""
        checked = self._checked_branch
        if checked.branch is not self.branch:
            checked = _structure.CheckedBranch(self.branch)
            if not torch.compiler.is_compiling():
                self._checked_branch = checked
        return checked

    def _table(self) -> _structure.Branches:
        """The branch table, cached in the unit; built afresh while torch.compile or a torch.func
        transform runs (MaskedBranch._branches)."""
        unit = self._unit
        table = unit.table
        if table is None or _compat.tracing():
            table = _structure.Branches([self._checked()], params=[tuple(self.branch.parameters())], modules=[self.branch])
            if not _compat.tracing():
                unit.table = table
        return table

    def _tie(self) -> Tying:
        return _unit.traced_tying(self) if torch.compiler.is_compiling() else self._unit.tying_here()

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        p = check_drop_prob(self.drop_prob)
        mode = check_mode(self.mode)
        kept = check_kept(self.kept, mode)
        check_x(x)
        unit = self._unit
        compiling = torch.compiler.is_compiling()
        table = self._table()
        if self.training and p > 0 and table.skippable is None:
            self._check_skippable()  # once per table (decisions are made in any mode)
            table.skippable = True
        out, ran = _residual(
            x, table, args, kwargs, p, self.training, mode, self.scale_by_keep, self.generator, kept,
            self._tie, None if compiling else unit.reducer,
        )
        if not isinstance(x, torch.fx.Proxy):
            _route.record(unit, ran)
        return out

    # The routing unit's owner (maskedbranch/_unit.py): one group, the branch.
    def _unit_groups(self) -> List[Sequence[Tensor]]:
        return [tuple(self.branch.parameters())]

    def _check_skippable(self) -> None:
        if self.training and self.drop_prob > 0:
            _structure.check_skippable([self.branch], "branch")

    def _unit_modules(self) -> List[nn.Module]:
        return [self.branch]

    def extra_repr(self) -> str:
        s = f"drop_prob={round(self.drop_prob, 3):0.3f}, mode={self.mode}"
        if not self.scale_by_keep:
            s += ", scale_by_keep=False"
        if self.kept != "random":
            s += f", kept={self.kept}"
        if self.materialize_grads is not True:
            s += f", materialize_grads={materialize_name(self.materialize_grads)}"
        return s

    _derived = ("_checked_branch",)  # a wrapper of the branch: a pickle holds the branch only

    def _own_unit(self, materialize_grads: Any) -> None:
        self._checked_branch = _structure.CheckedBranch(self.branch)
        self._unit = _unit.RoutingUnit(self, "ResidualDropPath", materialize_grads)

    def __prepare_scriptable__(self) -> nn.Module:
        drop = DropPath(self.drop_prob, scale_by_keep=self.scale_by_keep, mode=self.mode).train(self.training)
        return _ScriptableResidual(self.branch, drop)


class _ScriptableResidual(nn.Module):
    """What ``torch.jit.script`` compiles in place of :class:`ResidualDropPath`: the dense formula."""

    def __init__(self, branch: nn.Module, drop: nn.Module):
        super().__init__()
        self.branch = branch
        self.drop = drop

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(self.branch(x))
