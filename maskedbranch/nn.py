"""User-facing routing module :class:`MaskedBranch` and its functional form :func:`masked_branch`.

``MaskedBranch(branches)(x, gate)`` computes ``y[b] = sum_i g[b, i] * branch_i(x[b])`` while
feeding each branch only the rows it serves, and keeps every branch's parameters in the autograd
graph, so that DistributedDataParallel works with ``find_unused_parameters=False`` even when the
ranks route differently. The routing itself is maskedbranch/_route.py; docs/design.md has the
semantics.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from . import _autograd, _compat, _dead_grads, _route, _structure, _usage, _wiring, unused_grads

__all__ = ["MaskedBranch", "masked_branch"]


def _as_branch_list(branches: Any, callables: bool) -> List[Any]:
    if isinstance(branches, nn.Module) and not isinstance(branches, nn.ModuleList):
        raise TypeError(
            f"branches: expected an iterable of nn.Module (a list or an nn.ModuleList), got a single "
            f"{type(branches).__name__}; wrap it in a list"
        )
    if isinstance(branches, (str, bytes)) or not isinstance(branches, Iterable):
        raise TypeError(f"branches: expected an iterable of nn.Module, got {type(branches).__name__}")
    out = list(branches)
    if not out:
        raise ValueError("branches: expected at least one branch, got none")
    for i, b in enumerate(out):
        if not (callable(b) if callables else isinstance(b, nn.Module)):
            raise TypeError(f"branches[{i}]: expected {'a callable' if callables else 'an nn.Module'}, got {type(b).__name__}")
    return out


class MaskedBranch(_structure.RoutingModuleList):
    r"""An ``nn.ModuleList`` of branches that runs each row through the branches its gate selects,
    and only those: ``y[b] = sum_i g[b, i] * branch_i(x[b], ...)``.

    It is a drop-in for the ``nn.ModuleList`` an if/else model routes between: the state_dict
    keys are the ModuleList's (``choices.0.weight``), and indexing, ``len`` and iteration behave
    as before, so checkpoints load both ways.

    Args:
        branches: an iterable of ``nn.Module``. Every branch maps ``r`` rows to ``r`` rows; all
            branches return the same trailing shape and dtype. Branches that run collectives
            (``nn.SyncBatchNorm``, DDP- or FSDP-wrapped modules, DTensor parameters) are refused:
            skipped on one rank, their collective would hang the others.
        materialize_grads: what the parameters of branches that did not run receive.
            ``"auto"`` / ``None`` (default): what the if/else code gives them, in every training
            setting (docs/guides/ddp.md): nothing in one process (``.grad`` stays ``None``);
            under a data-parallel wrapper a gradient that the wrapper can reduce, reset to
            ``None`` before the optimizer step where no rank used them. ``"zeros"`` / ``True``:
            always zero gradients; ``"none"`` / ``False``: never a gradient from the routing
            (DDP fills zeros itself); both without the reset.

    ``forward(x, gate, *args, **kwargs)``, where ``x`` is ``[B, ...]`` and ``gate`` is:

    * an ``int`` k: the whole batch runs branch k, on ``x`` itself (-1: no branch);
    * an integer tensor ``[B]``: one branch id per row, -1 = no branch for that row;
    * a bool or floating tensor ``[B, N]``: any subset of branches per row, the value being the
      weight. Floating weights that require grad get gradients at their nonzero entries and zero
      at zero entries (the branch never ran there).

    A gate on the CPU with ``x`` on a GPU is the fast case (the plan is built on the host and
    shipped asynchronously); a GPU gate costs one readback. Extra tensor arguments whose first
    dimension is ``B`` are routed with ``x``; anything else passes through unchanged.

    When no row reaches any branch the output is zeros ``[B, *trailing]``, shaped as the branches
    returned for inputs like these before, or as a branch returns on meta tensors.

    Graphs: ``torch.export.export`` keeps the routing: an int gate's branch, or for a tensor
    gate every branch on its rows, none included (non-strict export only, ``strict=False``;
    not on torch 2.6, whose fake tensors cannot size the routed rows). ``torch.fx.symbolic_trace`` cannot see which rows go where: it records a constant
    int gate's branch, and for any other gate the dense formula ``sum_i g[:, i] * branch_i(x)``
    (every branch on every row: the same output for branches that treat rows independently).
    ``torch.jit.script`` is refused with a message (see ``__prepare_scriptable__``).
    """

    def __init__(self, branches: Iterable[nn.Module], *, materialize_grads: Any = None):
        mods = _as_branch_list(branches, callables=False)
        super().__init__(mods)
        self.materialize_grads = _dead_grads.materialize(materialize_grads)
        self._cache: Optional[_structure.Branches] = None
        self._signatures = _route.Signatures()
        self._usage = _usage.Usage()
        self._usage.ensure(len(mods))
        self.register_load_state_dict_pre_hook(_load_old_layout)
        unused_grads.register(self)

    @property
    def num_branches(self) -> int:
        return len(self._modules)

    def _drop_caches(self) -> None:
        self._cache = None

    def _branches(self) -> _structure.Branches:
        if _compat.tracing():
            # Built afresh (see _compat.tracing): under torch.compile a cache read would become
            # a guard, and torch.func.functional_call swaps parameters in for one call.
            _structure.check_skippable(list(self._modules.values()), "branches")
            return _structure.Branches(self._modules.values())
        cache = self._cache
        if cache is None or not cache.same_branches(self._modules) or not cache.still_valid(_dead_grads.epoch()):
            _structure.check_skippable(list(self._modules.values()), "branches")
            if cache is not None:
                _wiring.forget_layouts()  # the units changed: wrappers make their layouts again
            cache = _structure.Branches(self._modules.values())
            cache.still_valid(_dead_grads.epoch())
            self._usage.ensure(len(cache.branches))
            if not torch.compiler.is_compiling():  # torch.export (strict) refuses module mutation
                self._cache = cache
        return cache

    def _unit_modules(self) -> List[nn.Module]:
        """The units whose use ``_usage`` records (bit i: branch i), for the reset of unused
        gradients (maskedbranch/unused_grads.py)."""
        return list(self._modules.values())

    def _units(self) -> List[Sequence[Tensor]]:
        return [tuple(b.parameters()) for b in self._modules.values()]

    def forward(self, x: Tensor, gate: Any, *args: Any, **kwargs: Any) -> Tensor:
        if type(gate) is int and not args and not kwargs and type(x) is Tensor and not _compat.tracing() and self._cache is not None:
            # The per-batch int gate, the common case of routed layers, straight to the branch:
            # route()'s own int path less its argument handling, which costs more than the rest
            # of the call for small branches. The policy first: a new wrapper makes the cache
            # check itself in depth.
            grad = torch.is_grad_enabled()
            usage = self._usage
            zeros = _dead_grads.tie_policy(self.materialize_grads, "MaskedBranch", usage) if grad else None
            cache = self._cache
            if (
                cache.epoch == _dead_grads.epoch() and cache.same_branches(self._modules)
                and 0 <= gate < len(cache.branches) and x.dim() > 0
                and not (zeros and _dead_grads.canonical_order(usage))  # else route() runs on aliases
            ):
                y = cache.branches[gate](x)
                if type(y) is not Tensor or y.dim() == 0 or y.shape[0] != x.shape[0]:
                    _route.check_output(y, f"branches[{gate}]", x.shape[0])
                if grad:
                    if zeros is not None:
                        tied = _route._tied(cache, 1 << gate, zeros)
                        if tied:
                            y = _autograd.tie(y, tied, zeros)
                        _dead_grads.after_call(usage, y)
                    usage.bits |= 1 << gate
                return y
        if _route.traced(x, gate):
            return _route.route_traced(list(self._modules.values()), x, gate, args, kwargs)
        _route.check_x(x)
        zeros = _dead_grads.tie_policy(self.materialize_grads, "MaskedBranch", self._usage, self)
        table = self._branches()
        out, ran = _route.route(
            table, x, gate, args, kwargs, zeros=zeros, signatures=self._signatures, where="branches",
            usage=self._usage, module=self,
        )
        if torch.is_grad_enabled():
            _route.record(self._usage, ran)
            if zeros is not None and not torch.compiler.is_compiling():
                _dead_grads.after_call(self._usage, out)
        return out

    def __prepare_scriptable__(self) -> nn.Module:
        raise RuntimeError(
            "MaskedBranch: torch.jit.script cannot compile it (its forward takes a gate of several "
            "kinds and extra arguments, and routes on the gate's values). For a graph of the model use "
            "torch.export.export(model.eval(), args) or torch.compile(model); torch.fx.symbolic_trace "
            "records the dense formula (every branch on every row)."
        )

    def extra_repr(self) -> str:
        return "" if self.materialize_grads is None else f"materialize_grads={_dead_grads.materialize_name(self.materialize_grads)}"

    def __repr__(self) -> str:
        # nn.ModuleList's repr lists the children only: the setting goes on the first line
        text, extra = super().__repr__(), self.extra_repr()
        if not extra:
            return text
        head, sep, rest = text.partition("(\n")
        return f"{head}({extra}\n{rest}" if sep else f"{type(self).__name__}({extra})"

    def __setstate__(self, state) -> None:
        # copy.deepcopy and pickle: caches and usage start fresh, and the copy is registered
        super().__setstate__(state)
        self._cache = None
        self._usage = _usage.Usage()
        self._usage.ensure(len(self._modules))
        unused_grads.register(self)


def _load_old_layout(module, state_dict, prefix, *_args) -> None:
    """Checkpoints of maskedbranch < 0.2 stored the branches under ``branches.``: map them to the
    ModuleList layout (``prefix.0.weight``)."""
    old = prefix + "branches."
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old):]] = state_dict.pop(key)


def masked_branch(branches: Sequence[Callable], x: Tensor, gate: Any, *args: Any, **kwargs: Any) -> Tensor:
    """Functional form of :class:`MaskedBranch`: ``branches`` is a sequence of callables
    (modules or functions; the parameters of ``nn.Module`` branches are tied in, with the
    automatic gradient policy). Without a module to remember them, output signatures are not
    kept: a call where no row reaches any branch infers the output shape on meta tensors."""
    branch_list = _as_branch_list(branches, callables=True)
    if _route.traced(x, gate):
        return _route.route_traced(branch_list, x, gate, args, kwargs)
    _route.check_x(x)
    _structure.check_skippable(branch_list, "branches")
    zeros = _dead_grads.tie_policy(None, "masked_branch")
    out, ran = _route.route(_structure.Branches(branch_list), x, gate, args, kwargs, zeros=zeros)
    if zeros is not None and torch.is_grad_enabled():
        _usage.record_functional(branch_list, ran, out)  # for the reset of unused gradients
    return out
