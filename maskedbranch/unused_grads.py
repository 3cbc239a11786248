"""Before each optimizer step, the gradients of branch parameters that no rank used are set to
``None``, so that the optimizer skips them exactly as with if/else routing and
``DistributedDataParallel(find_unused_parameters=True)``.

Routing modules give a branch that did not run a gradient anyway (maskedbranch/_dead_grads.py),
so that DDP works with ``find_unused_parameters=False``; DDP then averages and writes zeros for
a branch that no rank used, and an optimizer would step it (momentum, Adam's moments, weight
decay). Every routing module records which of its branches ran; at each optimizer step these
bits are all-reduced (one small collective, no graph walk) and the gradients of the parameters
that belong only to branches no rank ran since the previous step are set back to ``None``.

This happens by default in distributed jobs, for modules with ``materialize_grads=None``, through
one global optimizer step pre-hook (public API: ``torch.optim.optimizer.
register_optimizer_step_pre_hook``). :func:`unused_grads_to_none` asks for it explicitly, for one
optimizer, model and process group, whatever the modules' settings.

A step that GradScaler skips (inf found) does not run the hook: its bits count towards the next
step. Every rank must step the optimizer the same number of times, as data-parallel training does.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch.optim import optimizer as _optimizer

from . import _compat, _structure

__all__ = ["UnusedGradsToNone", "unused_grads_to_none"]

_USED = ord("1")
_registry: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # every routing module alive


def register(module: nn.Module) -> None:
    """Called by each routing module when it is created (or copied): the step hook considers
    every routing module whose parameters the stepping optimizer holds, used or not, so that every
    rank builds the same layout."""
    _registry.add(module)
    _install_global_hook()


class Usage:
    """Bit i: unit i (a branch) of one routing module ran in a call with autograd on since the
    last optimizer step. Also remembers the DDP model around the module (its root and process
    group) when one was seen."""

    __slots__ = ("bits", "root", "group")

    def __init__(self) -> None:
        self.bits = 0
        self.root: Any = None  # weakref to the DDP-wrapped model
        self.group: Any = None

    def record(self, live_mask: int) -> None:
        self.bits |= live_mask
        if self.root is None and dist.is_available() and dist.is_initialized():
            ddp = _compat.active_ddp()
            if ddp is not None:
                self.root = weakref.ref(ddp.module)
                self.group = ddp.process_group


def _outside_params(root: nn.Module, branch_modules: set) -> set:
    """ids of the parameters of ``root``'s modules reached without entering a branch: used
    whatever the routing, never pruned."""
    outside, seen, stack = set(), set(), [root]
    while stack:
        m = stack.pop()
        if id(m) in seen or id(m) in branch_modules:
            continue
        seen.add(id(m))
        outside.update(id(p) for p in m.parameters(recurse=False))
        stack.extend(m.children())
    return outside


class _Layout:
    """The prunable parameters of one optimizer, grouped by the units (branches) they belong to,
    in an order that every rank agrees on (the optimizer's parameter order). The used bits travel
    as one ASCII byte per unit ('1' used), reduced with MAX (an OR that gloo and NCCL both have)."""

    def __init__(self, modules: Sequence[nn.Module], optimizer_params: Sequence[Tensor], root: Optional[nn.Module]):
        position = {id(p): k for k, p in enumerate(optimizer_params)}
        branch_modules = {id(b) for m in modules for b in m._unit_modules()}
        outside = _outside_params(root, branch_modules) if root is not None else set()
        entries: List[Tuple[int, nn.Module, int, Tuple[Tensor, ...]]] = []
        for m in modules:
            for i, ps in enumerate(m._units()):
                ps = tuple(p for p in ps if id(p) in position)
                if ps:
                    entries.append((min(position[id(p)] for p in ps), m, i, ps))
        entries.sort(key=lambda e: e[0])
        self.units = [(m, i) for _, m, i, _ in entries]
        owners: Dict[int, List[int]] = {}
        params: Dict[int, Tensor] = {}
        for u, (_, _, _, ps) in enumerate(entries):
            for p in ps:
                owners.setdefault(id(p), []).append(u)
                params[id(p)] = p
        # A parameter shared by several units is pruned only when all of them went unused.
        self.groups: List[Tuple[Tuple[int, ...], List[Tensor]]] = []
        by_units: Dict[Tuple[int, ...], List[Tensor]] = {}
        for pid, us in owners.items():
            if pid not in outside:
                by_units.setdefault(tuple(sorted(set(us))), []).append(params[pid])
        self.groups = list(by_units.items())
        self.modules = list(dict.fromkeys(m for m, _ in self.units))

    def take_bits(self) -> Tensor:
        text = "".join("1" if m._usage.bits >> i & 1 else "0" for m, i in self.units)
        for m in self.modules:
            m._usage.bits = 0
        return torch.frombuffer(bytearray(text, "ascii"), dtype=torch.uint8)

    def prune(self, used: bytes) -> int:
        pruned = 0
        for units, ps in self.groups:
            if all(used[u] != _USED for u in units):
                for p in ps:
                    if p.grad is not None:
                        p.grad = None
                        pruned += 1
        return pruned


def _bits_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())  # NCCL reduces device tensors only
    return torch.device("cpu")


def _reduce(bits: Tensor, group: Any) -> bytes:
    device = _bits_device(group)
    if device.type == "cuda":
        bits = bits.pin_memory().to(device, non_blocking=True)
    dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group)
    return bytes(bits.cpu().tolist())


class _Pruner:
    """Prunes one optimizer's parameters of the given routing modules (all auto-mode modules, or
    those of one model for :func:`unused_grads_to_none`)."""

    def __init__(self, group: Any = None, root: Optional[nn.Module] = None):
        self.group = group
        self.root = root
        self._layouts: Dict[int, Tuple[int, int, _Layout]] = {}  # id(optimizer) -> (version, modules, layout)
        self.last_pruned = 0

    def layout(self, optimizer: torch.optim.Optimizer, modules: List[nn.Module], root: Optional[nn.Module]) -> _Layout:
        key = (_structure.version(), len(modules))
        found = self._layouts.get(id(optimizer))
        if found is None or found[:2] != key:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            found = (*key, _Layout(modules, params, root))
            self._layouts[id(optimizer)] = found
        return found[2]

    def run(self, optimizer: torch.optim.Optimizer, modules: List[nn.Module]) -> None:
        roots = {id(r): r for m in modules for r in [m._usage.root and m._usage.root()] if r is not None}
        root = self.root if self.root is not None else (next(iter(roots.values())) if len(roots) == 1 else None)
        layout = self.layout(optimizer, modules, root)
        if not layout.units:
            return
        group = self.group
        if group is None:
            group = next((m._usage.group for m in layout.modules if m._usage.group is not None), None)
        used = _reduce(layout.take_bits(), group if group is not None else dist.group.WORLD)
        self.last_pruned = layout.prune(used)


_explicit: "weakref.WeakKeyDictionary[torch.optim.Optimizer, UnusedGradsToNone]" = weakref.WeakKeyDictionary()
_auto = _Pruner()
_hook_handle: List[Any] = []


def _install_global_hook() -> None:
    if not _hook_handle:
        _hook_handle.append(_optimizer.register_optimizer_step_pre_hook(_before_any_step))


def _after_closure(optimizer, args: tuple, kwargs: dict, prune) -> Optional[Tuple[tuple, dict]]:
    """Run ``prune`` now, or after the closure when ``step`` was given one (LBFGS, Lightning's
    automatic optimization): the closure runs the forward and backward inside ``step``, after
    the pre-hooks, so pruning before it would see the previous step's usage and no gradients.
    Returns the (args, kwargs) that the step hook hands back to ``step``."""
    at = 1 if args and args[0] is optimizer else 0  # the hooks see step's args with self first
    closure = kwargs.get("closure", args[at] if len(args) > at else None)
    if not callable(closure):
        prune()
        return None

    def closure_then_prune():
        loss = closure()
        prune()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_prune}
    return (*args[:at], closure_then_prune, *args[at + 1:]), kwargs


def _before_any_step(optimizer, args, kwargs) -> Optional[Tuple[tuple, dict]]:
    if not (dist.is_available() and dist.is_initialized()) or optimizer in _explicit:
        return None
    taken = {id(m) for h in _explicit.values() for m in h.modules}
    modules = [m for m in list(_registry) if m.materialize_grads is None and id(m) not in taken]
    if modules:
        return _after_closure(optimizer, args, kwargs, lambda: _auto.run(optimizer, modules))
    return None


class UnusedGradsToNone:
    """The handle :func:`unused_grads_to_none` returns; ``remove()`` detaches it. ``last_pruned``:
    how many gradients the last step set to ``None``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, process_group: Any = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module (the model or its DDP wrapper), got {type(model).__name__}")
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        root = model.module if ddp else model
        self.modules = [m for m in root.modules() if isinstance(getattr(m, "_usage", None), Usage)]
        if not self.modules:
            raise ValueError("model: contains no MaskedBranch or ResidualDropPath, so no parameter can be found unused")
        if process_group is None and ddp:
            process_group = model.process_group
        self._pruner = _Pruner(process_group, root)
        self._optimizer = weakref.ref(optimizer)
        self._handle = optimizer.register_step_pre_hook(self._before_step)
        _explicit[optimizer] = self

    @property
    def last_pruned(self) -> int:
        return self._pruner.last_pruned

    def _before_step(self, optimizer, args, kwargs) -> Optional[Tuple[tuple, dict]]:
        return _after_closure(optimizer, args, kwargs, lambda: self._prune(optimizer))

    def _prune(self, optimizer) -> None:
        if dist.is_available() and dist.is_initialized():
            self._pruner.run(optimizer, self.modules)
        else:  # one process: the bits alone say what ran
            layout = self._pruner.layout(optimizer, self.modules, self._pruner.root)
            self._pruner.last_pruned = layout.prune(bytes(layout.take_bits().tolist()))

    def remove(self) -> None:
        self._handle.remove()
        optimizer = self._optimizer()
        if optimizer is not None and _explicit.get(optimizer) is self:
            del _explicit[optimizer]


def unused_grads_to_none(
    optimizer: torch.optim.Optimizer, model: nn.Module, process_group: Optional[Any] = None
) -> UnusedGradsToNone:
    """Before every ``optimizer.step()``, set to ``None`` the gradient of each parameter that
    belongs only to ``MaskedBranch`` / ``ResidualDropPath`` branches of ``model`` that ran on no
    rank since the previous step, so that the optimizer skips it, exactly as with if/else routing
    and ``find_unused_parameters=True``.

    Distributed jobs do this by default for modules with ``materialize_grads=None``; call this
    to do it for modules with an explicit setting, for one process, or with another
    ``process_group`` (default: the DDP wrapper's group, else the default group). Parameters
    shared with a module outside the branches are never pruned; a parameter shared by branches is
    pruned only when all of them went unused. Calls under ``torch.no_grad()`` do not count as use.
    """
    return UnusedGradsToNone(optimizer, model, process_group)
