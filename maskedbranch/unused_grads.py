"""Before an optimizer step, gradients that if/else routing would have left ``None`` are set back
to ``None``, so that the optimizer skips those parameters exactly as with if/else and
``DistributedDataParallel(find_unused_parameters=True)``.

Which parameters no rank used is decided where every rank takes part, after each forward of the
wrapper (maskedbranch/_reducer.py); the step only reads it, so no collective runs in
``optimizer.step()`` (ZeRO, several optimizers, optimizers stepped on some ranks, LBFGS closures
all work). A gradient is set to ``None`` only where if/else leaves ``None``: the zero tensors of
``zero_grad(set_to_none=False)`` stay. Used means called with autograd enabled since that
parameter's previous step (gradient accumulation keeps everything its micro-batches used); a step
that GradScaler skips runs no hook, so its calls count towards the next.

One optimizer step pre-hook is installed while something needs it (docs/design.md, "One optimizer
step pre-hook, scoped"); :func:`unused_grads_to_none` attaches to one optimizer and one model
instead, and ``materialize_grads=True`` / ``False`` on a module opts it out.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.optim import optimizer as _optimizer

from . import _functional, _unit, _reducer
from ._unit import RoutingUnit

__all__ = ["UnusedGradsToNone", "unused_grads_to_none", "uninstall"]

class _StepHook:
    """The one optimizer step pre-hook and the state it owns: the routing units alive (the hook
    goes with the last), its handle, per optimizer what a step reads in each reducer, the
    optimizers an explicit handle serves, how many gradients the last step reset. With it comes
    the module registration hook that sees ``DDP.module`` set and gives that DDP its reducer."""

    def __init__(self) -> None:
        self.units: "weakref.WeakSet[RoutingUnit]" = weakref.WeakSet()
        self.alive = 0  # (their finalizers count down)
        self.handle: Any = None
        # optimizer -> ((its parameter groups' lengths, the reducers' version, the reducers), per
        # reducer what a step reads there), made when its groups or the reducers change
        self.params: "weakref.WeakKeyDictionary[Any, Tuple[tuple, list]]" = weakref.WeakKeyDictionary()
        self.explicit: "weakref.WeakKeyDictionary[Any, UnusedGradsToNone]" = weakref.WeakKeyDictionary()
        self.last_reset = 0
        self.ddp_watch: Any = None

    def install(self) -> None:
        if self.handle is None:
            self.handle = _optimizer.register_optimizer_step_pre_hook(_before_any_step)

    def uninstall(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def watch_ddp_construction(self) -> None:
        if self.ddp_watch is None:
            self.ddp_watch = nn.modules.module.register_module_module_registration_hook(_registered)

    def unwatch_ddp_construction(self) -> None:
        if self.ddp_watch is not None:
            self.ddp_watch.remove()
            self.ddp_watch = None


def _registered(parent: nn.Module, name: str, child: Any) -> None:
    if torch.compiler.is_compiling():
        return  # (a graph module built while a graph is traced: no DDP is made there)
    if name == "module" and isinstance(parent, nn.parallel.DistributedDataParallel) and isinstance(child, nn.Module):
        if _unit.routing_modules(child):
            _reducer.reducer_for(parent, before_forward=True).own(parent, child)


def _created(unit: RoutingUnit) -> None:
    """Each routing unit, when created. In a distributed job a DDP module may be built around it
    next: the watch for that and the step pre-hook are installed now; elsewhere when needed."""
    _hook.units.add(unit)
    _hook.alive += 1
    weakref.finalize(unit, _gone)
    if _unit.distributed():
        _needed()


def _needed() -> None:
    _hook.install()
    _hook.watch_ddp_construction()


# plain functions on the instance, as _reducer.py sets decide
_unit.DATA_PARALLEL.created = _created
_unit.DATA_PARALLEL.needed = _needed


def _gone() -> None:
    _hook.alive -= 1
    if _hook.alive <= 0 and not _reducer.all_reducers():
        uninstall()
        _hook.unwatch_ddp_construction()


def uninstall() -> None:
    """Remove the step pre-hook (it comes back with the next routing module or reducer)."""
    _hook.uninstall()


_hook = _StepHook()


# ----------------------------------------------------------------------------------------------
# The step pre-hook.


def _params_of(optimizer: Any) -> List[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _step_params(optimizer: Any, reducers: Sequence[Any]) -> List[Tuple[Any, Any]]:
    """Per reducer, what a step of this optimizer reads there (cached until its parameter groups
    or the reducers change)."""
    key = (tuple(len(g["params"]) for g in optimizer.param_groups), _reducer.REDUCERS.version,
           tuple(map(id, reducers)))
    found = _hook.params.get(optimizer)
    if found is None or found[0] != key:
        params = _params_of(optimizer)
        held = [(w, sp) for w in reducers for sp in (w.step_params(params),) if sp is not None]
        found = (key, held)
        _hook.params[optimizer] = found
    return found[1]


def _check_fsdp2() -> None:
    """Refuse ``materialize_grads=False`` under FSDP2, which pairs defined gradients by position
    across ranks; its sharded parameters (DTensors) show it only at the step."""
    for u in list(_hook.units):
        if u.materialize is not False:
            continue
        first = next((p for ps in u.groups() for p in ps), None)
        if getattr(first, "device_mesh", None) is not None:
            raise RuntimeError(
                f"{u.where}(materialize_grads=False) under FSDP2 (fully_shard): FSDP2 reduces "
                "only defined gradients, so ranks that skipped different branches averaged different "
                "parameters together in this step's backward. Use materialize_grads=None (the "
                "default, zeros under FSDP2) or True."
            )


def _reset(optimizer: Any, reducers: Optional[Sequence[Any]] = None) -> int:
    """Reset this optimizer's unused gradients: those of the given reducers (default: every
    automatic one, read now: a closure may have made one) and of the local reducer."""
    if reducers is None:
        reducers = [w for w in _reducer.all_reducers() if not w.explicit_kind]
    # compiled "auto" units that no wrapper runs: those whose graphs gave dead branches zeros;
    # the others' graphs inlined an int choice, which leaves nothing to reset
    units = []
    for u in list(_hook.units):
        if u.materialize is None and u.reducer is None:
            if u.zeros:
                units.append(u)
            elif u.inlined:
                u.clear()
    local = _reducer.local_reducer(units)
    if local is not None:
        reducers = [*reducers, local]
    done = 0
    for w, step_params in _step_params(optimizer, reducers):
        done += w.reset(step_params)
    _hook.last_reset = done
    return done


def _before_any_step(optimizer, args, kwargs) -> Optional[Tuple[tuple, dict]]:
    if optimizer in _hook.explicit:
        return None  # its own hook
    if _unit.distributed():
        _check_fsdp2()
    return _after_closure(optimizer, args, kwargs, lambda: _reset(optimizer))


def _after_closure(optimizer, args: tuple, kwargs: dict, reset) -> Optional[Tuple[tuple, dict]]:
    """Run ``reset`` now, or after the closure when ``step`` was given one (LBFGS, Lightning): the
    closure runs the backward inside ``step``, after the pre-hooks. Returns the (args, kwargs)
    the step hook hands back to ``step``."""
    at = 1 if args and args[0] is optimizer else 0  # the hooks see step's args with self first
    closure = kwargs.get("closure", args[at] if len(args) > at else None)
    if not callable(closure):
        reset()
        return None

    def closure_then_reset():
        loss = closure()
        reset()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_reset}
    return (*args[:at], closure_then_reset, *args[at + 1:]), kwargs


# ----------------------------------------------------------------------------------------------
# The explicit form.


class UnusedGradsToNone:
    """The handle :func:`unused_grads_to_none` returns; ``remove()`` detaches it. ``last_reset``:
    how many gradients the last step set to ``None``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, process_group: Any = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module (the model or its DDP wrapper), got {type(model).__name__}")
        root = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        if not _unit.routing_modules(root) and not _functional.units_in(list(root.modules())):
            raise ValueError("model: contains no MaskedBranch or ResidualDropPath, so no parameter can be found unused")
        existing = _reducer.reducer_of(model)
        self._made = existing is None
        explicit_kind = not isinstance(model, nn.parallel.DistributedDataParallel)
        self._reducer = _reducer.reducer_for(model, explicit_kind, process_group, before_forward=True)
        if process_group is not None:
            self._reducer.process_group = process_group
        if not self._reducer.everything:
            self._reducer.everything = True  # modules with explicit settings too
            self._reducer.layout = None
        for unit in _functional.units_in(list(root.modules())):
            self._reducer.decide(unit)
        self._optimizer = weakref.ref(optimizer)
        self._handle = optimizer.register_step_pre_hook(self._before_step)
        _hook.explicit[optimizer] = self
        self.last_reset = 0

    def _before_step(self, optimizer, args, kwargs) -> Optional[Tuple[tuple, dict]]:
        def reset():
            self.last_reset = _reset(optimizer, [self._reducer])

        return _after_closure(optimizer, args, kwargs, reset)

    def remove(self) -> None:
        self._handle.remove()
        optimizer = self._optimizer()
        if optimizer is not None and _hook.explicit.get(optimizer) is self:
            del _hook.explicit[optimizer]
        if self._made:
            self._reducer.remove()


def unused_grads_to_none(
    optimizer: torch.optim.Optimizer, model: nn.Module, process_group: Optional[Any] = None
) -> UnusedGradsToNone:
    """Before every ``optimizer.step()``, set to ``None`` the gradient of each parameter that
    belongs only to routing branches of ``model`` that ran on no rank since its previous step,
    so that the optimizer skips it, exactly as with if/else routing and
    ``find_unused_parameters=True``.

    DDP and FSDP2 models do this by default for modules with ``materialize_grads=None``. Call this
    for a model that averages its gradients by hand (its routing modules then tie with zero
    gradients, and ``model``'s forward, which every rank must run, reduces the usage), for
    modules with an explicit ``materialize_grads``, or with another ``process_group`` (default:
    the DDP wrapper's group, else the group of FSDP2's 1-D mesh, else the default group).
    Parameters shared with a module outside the branches are never reset; a parameter shared by
    branches is reset only when all of them went unused. Calls under ``torch.no_grad()`` do not
    count as use.
    """
    return UnusedGradsToNone(optimizer, model, process_group)
