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

from . import _choice, _compat, _functional, _gate, _route, _structure, _traced, _unit
from ._signatures import Signatures
from ._unit import Tying, materialize, materialize_name

__all__ = ["MaskedBranch", "masked_branch"]


def _as_branch_list(branches: Any, callables: bool) -> List[Any]:
    """The branches in order: a list's items, or an ``nn.ModuleDict``'s (a mapping's) values in
    insertion order."""
    named = _structure.is_named(branches)
    if isinstance(branches, nn.Module) and not isinstance(branches, nn.ModuleList) and not named:
        raise TypeError(
            f"branches: expected an iterable of nn.Module (a list, an nn.ModuleList or an nn.ModuleDict), "
            f"got a single {type(branches).__name__}; wrap it in a list"
        )
    if isinstance(branches, (str, bytes)) or not (named or isinstance(branches, Iterable)):
        raise TypeError(f"branches: expected an iterable of nn.Module, got {type(branches).__name__}")
    items = list(branches.items()) if named else list(enumerate(branches))
    if not items:
        raise ValueError(f"branches: expected at least one branch, got {'an empty ' + type(branches).__name__ if named else 'none'}")
    for key, b in items:
        if named and not isinstance(key, str):
            raise TypeError(f"branches: the keys of a mapping name its branches' modules: expected strings, got {key!r}")
        if not (callable(b) if callables else isinstance(b, nn.Module)):
            raise TypeError(
                f"branches[{key!r}]: expected {'a callable' if callables else 'an nn.Module'}, got {type(b).__name__}"
            )
    return [b for _, b in items]


class MaskedBranch(_unit.UnitOwner, _structure.RoutingModuleList):
    r"""An ``nn.ModuleList`` of branches that runs each row through the branches its gate selects,
    and only those: ``y[b] = sum_i g[b, i] * branch_i(x[b], ...)``.

    It is a drop-in for the ``nn.ModuleList`` an if/else model routes between: the state_dict
    keys are the ModuleList's (``choices.0.weight``), and indexing, ``len`` and iteration behave
    as before, so checkpoints load both ways. Built from an ``nn.ModuleDict``, it keeps the dict's
    keys (``experts.expert_0.weight``): branch i is the dict's i-th value in insertion order, and
    ``[name]``, ``keys()`` and ``items()`` work as on the dict.

    Args:
        branches: an iterable of ``nn.Module``, or an ``nn.ModuleDict``. Every branch maps ``r``
            rows to ``r`` rows; all branches return the same trailing shape and dtype. Branches
            that run collectives (``nn.SyncBatchNorm``, DDP- or FSDP-wrapped modules, DTensor
            parameters) are refused: skipped on one rank, their collective would hang the others.
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
        super().__init__(branches if _structure.is_named(branches) else mods)  # a ModuleDict keeps its keys
        self._own_unit(materialize(materialize_grads))

    @property
    def materialize_grads(self) -> Optional[bool]:
        return self._unit.materialize

    @materialize_grads.setter
    def materialize_grads(self, value: Any) -> None:
        self._unit.materialize = materialize(value)
        self._unit.forget()

    @property
    def num_branches(self) -> int:
        return len(self._modules)

    def _drop_caches(self) -> None:
        unit = self.__dict__.get("_unit")
        if unit is not None:
            unit.forget()
            unit.ensure(len(self._modules))

    # The routing unit's owner (maskedbranch/_unit.py): a group per branch.
    def _unit_groups(self) -> List[Sequence[Tensor]]:
        return [tuple(b.parameters()) for b in self._modules.values()]

    def _unit_modules(self) -> List[nn.Module]:
        return list(self._modules.values())

    def _check_skippable(self) -> None:
        _structure.check_skippable(list(self._modules.values()), "branches")

    def _branches(self) -> _structure.Branches:
        """The branch table: cached in the unit (dropped when the list, ``.to()`` or
        ``load_state_dict`` changes it); built afresh while torch.compile or a torch.func
        transform runs (Dynamo would guard on the cache, and ``functional_call`` swaps parameters
        in for one call)."""
        unit = self._unit
        table = unit.table
        if table is None or _compat.tracing():
            table = _structure.Branches(self._modules.values())
            if not _compat.tracing():
                unit.table = table
        return table

    def forward(self, x: Tensor, gate: Any, *args: Any, **kwargs: Any) -> Tensor:
        unit = self._unit
        if type(gate) is int and not args and not kwargs and not torch.compiler.is_compiling():
            # The per-batch int gate: the chosen branch, as if/else calls it, and the record;
            # the parameters of the others are tied by the wrapper, if at all (Tying).
            if unit.tying_here().call_ties is None and 0 <= gate < len(self._modules):
                y = self._branch_at(gate)(x)
                unit.bits |= 1 << gate
                return y
        if _traced.traced(x, gate):
            return _traced.route_traced(list(self._modules.values()), x, gate, args, kwargs)
        _gate.check_x(x)
        compiling = torch.compiler.is_compiling()
        tying = _unit.traced_tying(self) if compiling else unit.tying_here()
        if unit.signatures is None and not compiling:
            unit.signatures = Signatures()
        if compiling:
            if type(gate) is int and not args and not kwargs:  # as if/else compiles it: a graph per choice
                _gate.normalize_gate(gate, x, len(self._modules))  # a bad id fails as in eager mode
                inlined = _choice.inline(self, list(self._modules.values()), x, gate, tying)
                if inlined is not None:
                    out, ran = inlined
                    _route.record(unit, ran, inlined=True)
                    return out if ran else _route.tie_unrun(out, tying, inputs=(x,))
            chosen = _route.choose(self, list(self._modules.values()), x, gate, args, kwargs, tying)
            if chosen is not None:  # an int or 0-d gate: the chosen branch alone, in one graph
                _route.record(unit, chosen[1])
                return chosen[0]
        call = _route.Call(tying, signatures=None if compiling else unit.signatures,
                           reducer=None if compiling else unit.reducer)
        out, ran = _route.route(self._branches(), x, gate, args, kwargs, call)
        _route.record(unit, ran)
        return out

    def __prepare_scriptable__(self) -> nn.Module:
        raise RuntimeError(
            "MaskedBranch: torch.jit.script cannot compile it (its forward takes a gate of several "
            "kinds and extra arguments, and routes on the gate's values). For a graph of the model use "
            "torch.export.export(model.eval(), args) or torch.compile(model); torch.fx.symbolic_trace "
            "records the dense formula (every branch on every row)."
        )

    def extra_repr(self) -> str:
        return "" if self.materialize_grads is None else f"materialize_grads={materialize_name(self.materialize_grads)}"

    def __repr__(self) -> str:
        # nn.ModuleList's repr lists the children only: the setting goes on the first line
        text, extra = super().__repr__(), self.extra_repr()
        if not extra:
            return text
        head, sep, rest = text.partition("(\n")
        return f"{head}({extra}\n{rest}" if sep else f"{type(self).__name__}({extra})"

    def _own_unit(self, materialize_grads: Any) -> None:
        self._unit = _unit.RoutingUnit(self, "MaskedBranch", materialize_grads)
        self._unit.ensure(len(self._modules))


def masked_branch(branches: Sequence[Callable], x: Tensor, gate: Any, *args: Any, **kwargs: Any) -> Tensor:
    """Functional form of :class:`MaskedBranch`: ``branches`` is a sequence of callables
    (modules or functions; the parameters of ``nn.Module`` branches are tied in, with the
    automatic gradient policy, each module branch being a routing unit of its own). Without a
    module to remember them, output signatures are not kept: a call where no row reaches any
    branch infers the output shape on meta tensors."""
    branch_list = _as_branch_list(branches, callables=True)
    if _traced.traced(x, gate):
        return _traced.route_traced(branch_list, x, gate, args, kwargs)
    _gate.check_x(x)
    _structure.check_skippable(branch_list, "branches")
    compiling = torch.compiler.is_compiling()
    # compiled: every branch in the graph
    tying = Tying.SKIP if compiling else _functional.tying_here(branch_list, "masked_branch")
    if tying is None:  # no module branch (no parameters to tie): a router's output is tied under a wrapper
        local = _unit.current_wrapper() is None and not _unit.distributed()
        tying = Tying.SKIP if local else Tying.NONE
    out, ran = _route.route(_structure.Branches(branch_list), x, gate, args, kwargs, _route.Call(tying))
    _functional.record(branch_list, ran, "masked_branch")
    return out
