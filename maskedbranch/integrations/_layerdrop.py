"""The machinery behind maskedbranch.integrations.transformers.patch: the layer list that draws
LayerDrop as HF does (:class:`LayerDropList`), the stand-in for a dropped layer, and the owner's
hooks that hold HF's own probability at a neutral value and record which units ran, for the
reset of unused gradients (maskedbranch/_reducer.py).

Units of an owner, for the reset: each layer, and the owner's other parameters. A forward's
units count as used at the owner's next forward or when the wrapper takes them, unless a consumer
did not use the owner's output: a decoder that dropped every layer only tied the encoder's
output in (so that DDP and FSDP2 see its parameters), and the encoder's units then count only
if that output got a gradient from elsewhere (nonzero gradients, read at the step), as the
graph walk of find_unused_parameters=True decides.
"""
from __future__ import annotations

import contextlib
import random
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from .. import _compat, _structure, _unit
from .._route import tie_unrun
from .._unit import RoutingUnit, Tying
from ._transformers_rules import Rule

# ----------------------------------------------------------------------------------------------
# HF's own probability reads a neutral value while an owner runs. Owners that share a config
# (or threads running replicas of one model, as nn.DataParallel does) count their holds, so the
# value is restored once, by the last one out.
#
# Only a config needs the lock: replicas share their config, while an owner's own attribute
# belongs to one module, which one thread runs. A lock there too would break a compiled graph at
# every hold and release (Dynamo cannot enter a threading.Lock).

_lock = threading.Lock()
_held: Dict[Tuple[int, str], List[Any]] = {}  # (id(holder), name) -> [holds, real value]


def _holder(owner: nn.Module, source: str) -> Tuple[Any, str]:
    if source.startswith("config."):
        return owner.config, source[len("config."):]
    return owner, source


def _guard(obj: Any) -> Any:
    return contextlib.nullcontext() if isinstance(obj, nn.Module) else _lock


def _real(obj: Any, name: str) -> Any:
    with _guard(obj):
        entry = _held.get((id(obj), name))
        return entry[1] if entry is not None else getattr(obj, name)


def _hold(obj: Any, name: str, neutral: float) -> None:
    with _guard(obj):
        entry = _held.get((id(obj), name))
        if entry is None:
            entry = _held[(id(obj), name)] = [0, getattr(obj, name)]
            setattr(obj, name, neutral)
        entry[0] += 1


def _release(obj: Any, name: str) -> None:
    with _guard(obj):
        entry = _held[(id(obj), name)]
        entry[0] -= 1
        if entry[0] == 0:
            del _held[(id(obj), name)]
            setattr(obj, name, entry[1])


# ----------------------------------------------------------------------------------------------
# The draws, as HF makes them.


def _peek(get, set_, draw):
    """The number ``draw()`` gives next, leaving the generator as it was: HF draws it itself."""
    state = get()
    value = draw()
    set_(state)
    return value


def _dropped(rule: Rule, p: float) -> bool:
    kind = rule.draw
    if kind == "torch":
        u = torch.rand([])
    elif kind == "torch-always":
        u = _peek(torch.get_rng_state, torch.set_rng_state, lambda: torch.rand([]))
    elif kind == "numpy-random":
        u = _peek(np.random.get_state, np.random.set_state, np.random.random)
    elif kind == "numpy-uniform":
        u = _peek(np.random.get_state, np.random.set_state, lambda: np.random.uniform(0, 1))
    else:  # python-uniform
        u = _peek(random.getstate, random.setstate, lambda: random.uniform(0, 1))
    return bool(u <= p) if rule.inclusive else bool(u < p)


# ----------------------------------------------------------------------------------------------
# The layer list.


class LayerDropList(_unit.UnitOwner, _structure.RoutingModuleList):
    """The ``layers`` of a patched owner: the same layer objects (``state_dict`` keys
    ``layers.0.weight``, indexing and ``len`` as before). Outside the owner's training forward,
    iterating yields the layers; inside, it draws LayerDrop as HF does and yields, for each
    dropped layer, a stand-in that does not run it."""

    def __init__(self, layers: Sequence[nn.Module] = (), rule: Rule = Rule(), where: str = "layers",
                 materialize_grads: Optional[bool] = None):
        super().__init__(layers)
        self.rule = rule
        self.where = where
        self._own_unit(materialize_grads)

    @property
    def materialize_grads(self) -> Optional[bool]:
        return self._unit.materialize

    @materialize_grads.setter
    def materialize_grads(self, value: Optional[bool]) -> None:
        self._unit.materialize = value
        self._unit.forget()

    def _reset_forward_state(self) -> None:
        self._owner: Optional[weakref.ref] = None  # set by the owner's pre-hook (copies re-learn it)
        self._fwd: Optional[int] = None  # the units the current forward ran (None: not recorded)
        self._extras: List[Tensor] = []  # other inputs that dropped layers tied in

    # The unit's groups (maskedbranch/_unit.py): each layer, then the owner's other parameters
    # (embeddings, norms: the owner's output may go unused, see _leave), which nested LayerDrop
    # owners keep as groups of their own.
    def _owner_module(self) -> Optional[nn.Module]:
        return None if self._owner is None else self._owner()

    def _unit_modules(self) -> List[nn.Module]:
        owner = self._owner_module()
        return list(self._modules.values()) + ([] if owner is None else [owner])

    def _unit_groups(self) -> List[Sequence[Tensor]]:
        groups = [tuple(m.parameters()) for m in self._modules.values()]
        owner = self._owner_module()
        if owner is not None:
            groups.append(tuple(_own_parameters(owner)))
        return groups

    def _check_skippable(self) -> None:
        fsdp = _compat.fsdp_module_type()
        # A layer that is an FSDP2 unit is entered even when dropped (see _Dropped); its inner
        # modules are checked there, once its parameters are gathered.
        _structure.check_skippable([m for m in self._modules.values() if fsdp is None or not isinstance(m, fsdp)], self.where)

    def _drop_caches(self) -> None:
        self._tables = None
        unit = self.__dict__.get("_unit")
        if unit is not None:
            unit.forget()

    def _table(self, i: int) -> _structure.Branches:
        tables = self._tables
        if tables is None or len(tables) != len(self._modules) or tables[i].branches[0] is not self._modules[str(i)]:
            self._check_skippable()
            tables = self._tables = [_structure.Branches([m]) for m in self._modules.values()]
        return tables[i]

    def __iter__(self):
        if self._p is None:
            return iter(self._modules.values())
        return self._draw(self._p)

    def _draw(self, p: float):
        rule = self.rule
        tying = self._unit.tying_here()
        for i, layer in enumerate(list(self._modules.values())):
            if i >= rule.first and _dropped(rule, p):
                yield _Dropped(self, i, layer, tying)
            else:
                if self._fwd is not None:
                    self._fwd |= 1 << i
                yield layer

    def extra_repr(self) -> str:
        return f"LayerDrop of {self.where}" + ("" if self.materialize_grads is None else f", materialize_grads={self.materialize_grads}")

    _derived = ("_p", "_tables")

    def _own_unit(self, materialize_grads: Optional[bool]) -> None:
        self._p: Optional[float] = None  # the probability while the owner's training forward runs
        self._tables: Optional[List[_structure.Branches]] = None
        self._unit = _unit.RoutingUnit(self, self.where, materialize_grads)
        self._reset_forward_state()


def _own_parameters(owner: nn.Module) -> List[Tensor]:
    """The owner's parameters outside its layers and outside nested LayerDrop owners."""
    out, stack = [], [owner]
    while stack:
        m = stack.pop()
        if m is not owner and (isinstance(m, LayerDropList) or isinstance(getattr(m, "layers", None), LayerDropList)):
            continue
        out.extend(m.parameters(recurse=False))
        stack.extend(m.children())
    return list({id(p): p for p in out}.values())


def _dropped_output(rule: Rule, x: Tensor, kwargs: Dict[str, Any]) -> Any:
    """What HF's loop has after a dropped layer: the hidden states it had before."""
    if rule.out == "position_bias":
        return x, kwargs.get("position_bias")
    if rule.out == "trend":
        return x, 0  # the loop adds it to its trend
    return (x,) + (None,) * (rule.out - 1) if rule.out else x


class _Dropped:
    """Stands in for a dropped layer in HF's loop: called like the layer, it returns the hidden
    states it is given (with the layer's parameters tied in, when the job needs them to get a
    gradient) without running the layer."""

    __slots__ = ("owner", "index", "layer", "tying")

    def __init__(self, owner: LayerDropList, index: int, layer: nn.Module, tying: Tying):
        self.owner, self.index, self.layer, self.tying = owner, index, layer, tying

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        rule = owner.rule
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, Tensor):
            raise TypeError(f"{owner.where}[{self.index}]: expected the hidden states as the first argument, got {type(x).__name__}")
        if rule.attentions and kwargs.get("output_attentions"):
            raise ValueError(
                f"{owner.where}: output_attentions=True in training. HF's loop leaves a dropped layer out "
                "of the attention outputs, which the patched loop cannot do; ask for attentions in eval "
                "mode, or unpatch the model"
            )
        fsdp = _compat.fsdp_module_type()
        if fsdp is not None and isinstance(self.layer, fsdp):
            return self._through_unit(args, kwargs)
        tying = self.tying
        if tying.ties_inputs and torch.is_grad_enabled():
            params: Sequence[Tensor] = ()
            if tying.call_ties is not None:  # else the wrapper ties the layer's parameters (Tying.AT_WRAPPER)
                table = owner._table(self.index)
                params = table.tied(0)
                if params is None:  # a parameter of the layer was replaced
                    table.refresh()
                    params = table.tied(0)
            x = tie_unrun(x, tying, params, _other_inputs(owner, args, kwargs, tying))
        return _dropped_output(rule, x, kwargs)

    def _through_unit(self, args, kwargs) -> Any:
        """A dropped layer that is its own FSDP2 unit: every rank must gather and reduce its
        parameters, so the unit's hooks run around a forward that only ties them in (with zero
        gradients, which FSDP2 reduces). It takes the hidden states from its own arguments: the
        unit's hooks hand it tensors that lead its backward to the reduction."""
        layer, owner = self.layer, self.owner

        def forward(*args, **kwargs):
            _structure.check_skippable(list(layer.children()), f"{owner.where}[{self.index}]")
            x = args[0] if args else kwargs["hidden_states"]
            x = tie_unrun(x, Tying.ZEROS, list(layer.parameters()), _other_inputs(owner, args, kwargs, Tying.ZEROS))
            return _dropped_output(owner.rule, x, kwargs)

        layer.forward = forward  # an instance attribute: nn.Module.__call__ runs it inside the hooks
        try:
            return nn.Module.__call__(layer, *args, **kwargs)
        finally:
            del layer.forward


def _other_inputs(owner: LayerDropList, args: tuple, kwargs: Dict[str, Any], tying: Tying) -> List[Tensor]:
    """The dropped layer's other inputs that need a gradient (a decoder's encoder output), to tie
    into the hidden states: a rank that drops every layer of a decoder would otherwise leave the
    encoder's parameters out of the backward, and DDP or FSDP2 waiting for them. They are noted
    for the owner's post-hook (_leave). None in one process (nothing waits for them)."""
    if not (dist.is_available() and dist.is_initialized()) or not tying.ties_inputs:
        return []
    given = args[0] if args else kwargs.get("hidden_states")
    others = [t for t in (*args[1:], *kwargs.values()) if isinstance(t, Tensor) and t is not given and t.requires_grad]
    owner._extras.extend(others)
    return others


class Held:
    """The groups one forward of an owner ran, as its unit's pending record (``unit.held``):
    used, unless a later forward that dropped every layer used this one's output only through
    its tie (``conditional``: used only if a gradient reaches it from elsewhere)."""

    __slots__ = ("bits", "conditional")

    def __init__(self, bits: int) -> None:
        self.bits, self.conditional = bits, False

    def settle(self, unit: RoutingUnit) -> None:
        if self.conditional:
            unit.cond |= self.bits
        else:
            unit.bits |= self.bits


def _hold_record(unit: RoutingUnit, bits: int) -> Held:
    unit.settle_held()
    held = unit.held = Held(bits)
    return held


# Each owner's output (its first tensor), while alive: id -> (weakref, the units its forward ran).
_produced: Dict[int, Tuple[weakref.ref, Held]] = {}


def _first_tensor(output: Any) -> Optional[Tensor]:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) or hasattr(output, "to_tuple"):
        first = output[0] if len(output) else None
        return first if isinstance(first, Tensor) else None
    return None


def _note_output(t: Tensor, held: Held) -> None:
    key = id(t)

    def forget(ref, key=key):
        if _produced.get(key, (None,))[0] is ref:
            del _produced[key]

    _produced[key] = (weakref.ref(t, forget), held)


def _make_conditional(extras: List[Tensor]) -> None:
    """A forward that dropped every layer used its other inputs only through the tie: the units
    of the owner that produced one (an encoder) count only if its output gets a gradient from
    elsewhere, as with if/else and find_unused_parameters=True (maskedbranch/_reducer.py reads
    that from the gradients at the step)."""
    for t in {id(t): t for t in extras}.values():
        entry = _produced.get(id(t))
        if entry is not None and entry[0]() is t:
            entry[1].conditional = True


# ----------------------------------------------------------------------------------------------
# The owner's hooks: module-level functions (copies and pickles of the model keep them), bound to
# the name of the owner's layer list.


def _enter(owner: nn.Module, args: Any) -> None:
    layers = getattr(owner, "layers", None)
    if not isinstance(layers, LayerDropList) or layers._p is not None:
        return
    if layers._owner_module() is not owner:
        layers._owner = weakref.ref(owner)
        layers._unit.forget()  # the owner's parameters became a group: reducers make their layouts again
    n = len(layers._modules)
    # What the forward runs: the owner's own parameters (unit n), and every layer unless it draws.
    layers._fwd = (1 << n) | ((1 << n) - 1) if torch.is_grad_enabled() else None
    layers._extras = []
    if layers._fwd is not None:
        layers._unit.tying_here()  # decides under the wrapper running it
    if not owner.training:
        return
    obj, name = _holder(owner, layers.rule.source)
    p = float(_real(obj, name))
    if p <= 0.0:
        return
    layers._fwd = None if layers._fwd is None else 1 << n
    if is_deepspeed_zero3_enabled():
        raise RuntimeError(
            f"{layers.where}: LayerDrop under DeepSpeed ZeRO-3, which gathers each layer's parameters in "
            "the layer's own forward: a layer dropped on one rank would leave the others waiting. HF runs "
            "every layer there; unpatch the model (maskedbranch.integrations.transformers.unpatch) to do so"
        )
    _hold(obj, name, layers.rule.neutral)
    layers._p = p


def _leave(owner: nn.Module, args: Any, output: Any) -> None:
    layers = getattr(owner, "layers", None)
    if not isinstance(layers, LayerDropList):
        return
    if layers._p is not None:
        layers._p = None
        _release(*_holder(owner, layers.rule.source))
    fwd, extras = layers._fwd, layers._extras
    layers._fwd, layers._extras = None, []
    if fwd is None:
        return
    n = len(layers._modules)
    if extras and not fwd & ((1 << n) - 1):
        _make_conditional(extras)
    held = _hold_record(layers._unit, fwd)
    first = _first_tensor(output)
    if first is not None and first.requires_grad:
        _note_output(first, held)
        reducer = layers._unit.reducer
        if getattr(reducer, "needs_first", False):  # its wrapper got its reducer during this forward
            reducer.first_forward_hook(first)


_HOOKED = "_maskedbranch_layerdrop_hooks"  # set on an owner once its hooks are registered
