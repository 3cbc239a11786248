"""A routing module's state, in one object: :class:`RoutingUnit` (docs/design.md, "Words"): the
tying decided for the wrapper it runs under, its usage record, its branch table, its branches'
output signatures and compiled choice. The decision belongs to the data-parallel layer, which
plugs it into :data:`DATA_PARALLEL`; nothing here imports that layer. Per call, a unit only
compares the wrapper whose forward runs (:func:`current_wrapper`) with the one it decided for.

Records: ``bits``, a Python int, in eager calls; ``seen``, a small CPU tensor, in compiled graphs
(an in-place op is data to torch.compile, where a Python attribute written per call would become a
guard and recompile whenever the routing changes); ``cond``, groups used only conditionally;
``held``, a record its maker settles when the record is taken (``held.settle(unit)``: LayerDrop).
"""
from __future__ import annotations

import enum
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _compat

_MIN_SLOTS = 64  # seen's size at least: groups appended later rarely need a new tensor


class Tying(enum.IntEnum):
    """What the parameters of a unit's branches that did not run receive, and where they are tied
    into the autograd graph (docs/design.md, "The decision table")."""

    SKIP = 0  # not tied: .grad stays as it was, as with if/else
    AT_WRAPPER = 1  # tied once per forward by the wrapper's reducer, no gradient; calls only record
    AT_WRAPPER_ZEROS = 2  # as AT_WRAPPER, zero gradients (static_graph needs defined ones)
    NONE = 3  # tied by each call, no gradient
    ZEROS = 4  # tied by each call, zero gradients
    ALIASES = 5  # each call runs its branches on aliases made by one node: same order on every rank

    @property
    def call_ties(self) -> Optional[bool]:
        """What a call's own tie gives the dead parameters: None (no tie), False (no gradient), True
        (zeros)."""
        return _CALL_TIES[self]

    @property
    def ties_inputs(self) -> bool:
        """Whether a call where no row reaches any branch ties its inputs (x, the gate's weights)
        into its output, so that whatever produced them (a router) is reached on every rank."""
        return self is not Tying.SKIP


_CALL_TIES = {Tying.SKIP: None, Tying.AT_WRAPPER: None, Tying.AT_WRAPPER_ZEROS: None,
              Tying.NONE: False, Tying.ZEROS: True, Tying.ALIASES: True}


_SPELLINGS = {"auto": None, "zeros": True, "none": False}
_NAMES = {None: "auto", True: "zeros", False: "none"}


def materialize(value: Any, allow_auto: bool = True) -> Optional[bool]:
    """``materialize_grads`` as a unit stores it: ``"auto"`` / None, ``"zeros"`` / True or
    ``"none"`` / False (docs/design.md, "Dead parameters")."""
    if isinstance(value, str) and value in _SPELLINGS:
        value = _SPELLINGS[value]
    if (value is None and allow_auto) or isinstance(value, bool):
        return value
    allowed = "'auto' (None), 'zeros' (True) or 'none' (False)" if allow_auto else "'zeros' (True) or 'none' (False)"
    raise TypeError(f"materialize_grads: expected {allowed}, got {value!r}")


def materialize_name(value: Optional[bool]) -> str:
    return _NAMES[value]


# ----------------------------------------------------------------------------------------------
# Which wrapper's forward runs.


def current_wrapper(look_on_stack: bool = False) -> Any:
    """The wrapper whose forward runs, the one way to find it: the innermost with a reducer (they
    push themselves), else the DDP module whose forward runs (DDP's record); with
    ``look_on_stack``, in a distributed job, a DDP or FSDP2 module whose forward is on the Python
    stack (a wrapper built before any routing module; a look made when a unit decides)."""
    running = DATA_PARALLEL.running
    if running:
        return running[-1]
    w = _compat.active_ddp()
    if w is None and look_on_stack and distributed():
        w = _compat.wrapper_on_stack()
    return w


def distributed() -> bool:
    """A process group exists: a wrapper may run the routing (or be built around it) later."""
    return dist.is_available() and dist.is_initialized()


# ----------------------------------------------------------------------------------------------
# The seam to the data-parallel layer.


def _decide_alone(unit: "RoutingUnit", wrapper: Any) -> Tying:
    """Without the data-parallel layer (never the case once maskedbranch is imported)."""
    unit.settle(None, 0, (Tying.SKIP, Tying.ZEROS, Tying.NONE))
    return unit.tying


class _DataParallelLayer:
    """The seam to the data-parallel layer: ``running``, the wrappers whose forward runs, innermost
    last; and what the layer plugs in when imported: ``decide(unit, wrapper) -> Tying``
    (maskedbranch/_reducer.py), ``created(unit)`` and ``needed()`` (something needs the optimizer
    step pre-hook; maskedbranch/unused_grads.py)."""

    decide: Callable[["RoutingUnit", Any], Tying] = staticmethod(_decide_alone)
    created: Callable[["RoutingUnit"], None] = staticmethod(lambda unit: None)
    needed: Callable[[], None] = staticmethod(lambda: None)

    def __init__(self) -> None:
        self.running: List[Any] = []


DATA_PARALLEL = _DataParallelLayer()


# ----------------------------------------------------------------------------------------------
# The unit.


class RoutingUnit:
    """The state of one routing module. ``owner`` provides ``_unit_groups()`` (the parameters of
    each group), ``_unit_modules()`` (the groups' modules; none for bare parameters) and
    ``_check_skippable()`` (raises for branches that run collectives); ``where`` names it in
    messages; ``materialize``: its ``materialize_grads`` (None, True, False)."""

    __slots__ = (
        "owner", "where", "materialize",
        "wrapper_id", "tying", "row", "reducer", "probe", "version",
        "bits", "called", "cond", "held", "seen", "zeros", "inlined",
        "table", "signatures", "choice", "int_graphs", "__weakref__",
    )

    def __init__(self, owner: Any, where: str, materialize: Optional[bool]):
        self.owner = weakref.ref(owner)
        self.where = where
        self.materialize = materialize
        self.wrapper_id = 0
        self.tying: Optional[Tying] = None  # None: not decided (the next call decides)
        self.row: tuple = ()  # the decided tyings for "auto", "zeros", "none" (a str: refused)
        self.reducer: Any = None  # the reducer of the wrapper decided for (maskedbranch/_reducer.py)
        self.probe: Optional[Tuple[dict, str, Any]] = None
        self.version = 0  # advanced by every change of the owner: a reducer's layout of it is stale
        self.bits = 0
        self.called = False  # a call ran no group (no row reached a branch): nonzero bits say it otherwise
        self.cond = 0
        self.held: Any = None  # an object with settle(unit), or None
        self.seen = torch.zeros(_MIN_SLOTS, dtype=torch.uint8)
        # Set by compiled code, which also writes seen: a graph of this unit held every branch,
        # the dead ones getting zero gradients there (the step sets them back to None; a wrapper
        # need not tie them), from then on; a call since the last take inlined an int choice,
        # its graph holding the chosen branch only (the others keep None, or a wrapper ties them).
        self.zeros = False
        self.inlined = False
        self.table: Any = None  # the owner's branch table (maskedbranch/_structure.py), or None
        self.signatures: Any = None  # the branches' output signatures (maskedbranch/_signatures.py)
        self.choice: Optional[int] = None  # the compiled form of a whole-batch choice (maskedbranch/_choice.py)
        self.int_graphs = 0  # graphs traced with an int choice inlined (maskedbranch/_choice.py, inline)
        if isinstance(owner, nn.Module):
            note_module(owner)
        DATA_PARALLEL.created(self)

    # -- the decision ----------------------------------------------------------------------------

    def tying_here(self) -> Tying:
        """The tying of this call: the decided one under the wrapper decided for; under no wrapper,
        the decided one too (a checkpoint's recomputation keeps a live wrapper's decision) unless
        the owner's first parameter was replaced since (``fully_shard``); else decided now."""
        w = current_wrapper()
        tying = self.tying
        if w is None:
            if tying is not None and (self.reducer is None or self.reducer.alive()):
                probe = self.probe
                if probe is None or probe[0].get(probe[1]) is probe[2]:
                    return tying
        elif self.wrapper_id == id(w) and tying is not None:
            return tying
        return DATA_PARALLEL.decide(self, w)

    def settle(self, reducer: Any, wrapper_id: int, row: tuple) -> None:
        """Store a decision: ``row``, the tyings for "auto", "zeros", "none" (a string: a refusal's
        message), of which the unit's setting picks one."""
        self.tying = None
        tying = tying_in(row, self.materialize, self.where)
        self.reducer, self.wrapper_id, self.row, self.tying = reducer, wrapper_id, row, tying
        self.probe = _probe_of(self.owner())

    def tying_for(self, materialize: Optional[bool]) -> Tying:
        """The tying for another setting under the same decision (a functional call's own
        ``materialize_grads``), after :meth:`tying_here`."""
        return tying_in(self.row, materialize, self.where)

    def forget(self) -> None:
        """The owner changed (a branch added or replaced, ``.to()``, ``load_state_dict``) or the
        wrapper decided for is gone: decide again, with a new branch table and layouts."""
        self.reducer = None
        self.tying = None
        self.table = None
        self.choice = None
        self.version += 1

    def check_skippable(self) -> None:
        owner = self.owner()
        if owner is not None:
            owner._check_skippable()

    # -- groups ----------------------------------------------------------------------------------

    def groups(self) -> List[Sequence[Tensor]]:
        owner = self.owner()
        return [] if owner is None else owner._unit_groups()

    def group_modules(self) -> List[nn.Module]:
        owner = self.owner()
        return [] if owner is None else owner._unit_modules()

    # -- the record ------------------------------------------------------------------------------

    def record(self, live_mask: int) -> None:
        """Eager calls, whatever the grad mode (a reentrant checkpoint's forward runs under
        no_grad). The int gate's path writes ``bits`` itself."""
        self.bits |= live_mask
        self.called = True

    def record_live(self, live: Tensor) -> None:
        """Compiled calls: ``live`` is a bool or integer tensor [groups] (nonzero: ran)."""
        n = live.shape[0]
        self.seen[:n].bitwise_or_(live.to(torch.uint8))
        self.zeros = True

    def record_traced_mask(self, live_mask: int, inlined: bool = False) -> None:
        """Compiled calls whose groups are known while tracing (a constant mask); ``inlined``: the
        graph holds the chosen branch only."""
        i = 0
        while live_mask:
            if live_mask & 1:
                self.seen[i : i + 1].fill_(1)
            live_mask >>= 1
            i += 1
        self.called = True  # (stores, run again after each call of the graph: no guard)
        if inlined:
            self.inlined = True
        else:
            self.zeros = True

    def clear(self) -> None:
        """Forget the record unread (calls outside a wrapper's forward; inlined calls no one
        takes). A held record is dropped unsettled: settling it would write only these bits."""
        self.held = None
        self.bits = self.cond = 0
        self.called = False
        if self.zeros or self.inlined:  # (compiled calls wrote seen)
            self.inlined = False
            self.seen.zero_()

    def ensure(self, groups: int) -> None:
        """Eager: room for ``groups`` in ``seen`` (a module that grew)."""
        if groups > self.seen.shape[0]:
            grown = torch.zeros(max(groups, 2 * self.seen.shape[0]), dtype=torch.uint8)
            grown[: self.seen.shape[0]] = self.seen
            self.seen = grown

    def settle_held(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.settle(self)

    def take(self) -> Tuple[int, int, bool]:
        """(groups that ran, groups that ran only conditionally, whether the owner was called)
        since the last take; clears them."""
        if self.held is not None:
            self.settle_held()
        bits, cond, called = self.bits, self.cond, self.called
        self.bits = self.cond = 0
        self.called = False
        if self.zeros or self.inlined:
            self.inlined = False
            seen = self.seen.tolist()  # one read: a step takes every unit
            if any(seen):
                for i, v in enumerate(seen):
                    if v:
                        bits |= 1 << i
                self.seen.zero_()
        return bits, cond & ~bits, called or bool(bits or cond)


def _probe_of(owner: Any) -> Optional[Tuple[dict, str, Any]]:
    """Where the owner's first parameter is registered, to see it replaced (``fully_shard``,
    ``setattr``) with one dict lookup per call."""
    if not isinstance(owner, nn.Module):
        return None
    for m in owner.modules():
        for k, p in m._parameters.items():
            if p is not None:
                return m._parameters, k, p
    return None


_TYINGS = tuple(Tying)


def tying_in(row: tuple, materialize: Optional[bool], where: str) -> Tying:
    entry = row[0 if materialize is None else 1 if materialize else 2]
    if isinstance(entry, str):
        raise RuntimeError(f"{where}: {entry}")
    return entry


@torch.compiler.assume_constant_result
def _tying_while_tracing(key: int, wrapper_key: Optional[int]) -> int:
    """:meth:`RoutingUnit.tying_here` run while torch.compile traces, once per graph (modules by
    id: torch 2.6 takes only constants here; the wrapper key makes another wrapper's forward
    another graph). A module copied without its state (torch.export's copies) gives SKIP: its
    graph holds every branch."""
    owner = module_by_id(key)
    if owner is None:
        return int(Tying.SKIP)
    DATA_PARALLEL.needed()  # the graph gives dead branches zeros: the step resets them
    return int(owner._unit.tying_here())


def traced_tying(owner: nn.Module) -> Tying:
    """The tying of ``owner``'s unit inside a compiled graph: a constant of the graph."""
    w = current_wrapper()
    return _TYINGS[_tying_while_tracing(id(owner), None if w is None else id(w))]


class UnitOwner:
    """Mixin of the modules that own a routing unit (before ``nn.Module`` in the bases): a copy
    (``copy.deepcopy``, pickling) gets a fresh unit from ``_own_unit``; ``_derived`` attributes
    are not copied."""

    _derived: Tuple[str, ...] = ()

    def _own_unit(self, materialize_grads: Any) -> None:
        raise NotImplementedError

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in self._derived}
        state["_materialize_grads"] = state.pop("_unit").materialize
        return state

    def __setstate__(self, state) -> None:
        materialize_grads = state.pop("_materialize_grads")
        super().__setstate__(state)  # type: ignore[misc]
        self._own_unit(materialize_grads)


def forget_all(units: Any) -> None:
    for u in list(units):
        u.forget()


def routing_modules(root: nn.Module) -> List[nn.Module]:
    """The modules in ``root`` that own a routing unit, in ``modules()`` order (the same on every
    rank)."""
    return [m for m in root.modules() if isinstance(getattr(m, "_unit", None), RoutingUnit)]


_by_id: "dict[int, weakref.ref]" = {}


def note_module(module: Any) -> None:
    """Findable by id (compiled code hands modules to trace-time functions by id)."""
    _by_id[id(module)] = weakref.ref(module, lambda ref, key=id(module): _by_id.pop(key, None) if _by_id.get(key) is ref else None)


def module_by_id(key: Optional[int]) -> Any:
    ref = _by_id.get(key) if key is not None else None
    return None if ref is None else ref()
