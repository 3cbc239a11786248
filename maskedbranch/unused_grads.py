"""Before each optimizer step, the gradients of branch parameters that no rank used are set to
``None``, so that the optimizer skips them exactly as with if/else routing and
``DistributedDataParallel(find_unused_parameters=True)``.

Routing modules give a branch that did not run a gradient anyway (maskedbranch/_dead_grads.py),
so that DDP works with ``find_unused_parameters=False``; DDP then averages and writes zeros for
a branch that no rank used, and an optimizer would step it (momentum, Adam's moments, weight
decay). Every routing module records which of its branches ran (``masked_branch`` records on
the branch modules themselves); at each optimizer step one byte per parameter of the optimizer
is all-reduced (one small collective, no graph walk) and the gradients of the parameters that
belong only to branches no rank ran since the previous step are set back to ``None``.

This happens by default in distributed jobs, for modules with ``materialize_grads=None``, through
one global optimizer step pre-hook (public API: ``torch.optim.optimizer.
register_optimizer_step_pre_hook``). :func:`unused_grads_to_none` asks for it explicitly, for one
optimizer, model and process group, whatever the modules' settings.

What counts as used: a call with autograd enabled, since the previous step of that optimizer
(gradient accumulation, with or without ``no_sync``, keeps everything its micro-batches used).
A step that GradScaler skips (inf/NaN found) runs no hook, so its calls count towards the next
step: a branch used only in the skipped iteration keeps its zero gradient in the next one
(if/else would give it None). Parity with if/else assumes ``zero_grad(set_to_none=True)``
(torch's default). Every rank must step the optimizer the same number of times, as
data-parallel training does.

Parameters that a branch shares with the rest of the model are never pruned when the model is
known: the DDP module around the routing modules, or ``model`` given to
:func:`unused_grads_to_none` (FSDP2 and hand-written averaging need the latter for such sharing).
A distributed job whose ranks do not average these parameters (each rank trains its own model)
should say so with ``materialize_grads=False``: undefined gradients as with if/else, no pruning.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import optimizer as _optimizer

from . import _compat, _structure

__all__ = ["UnusedGradsToNone", "unused_grads_to_none"]

# One byte per optimizer parameter, reduced with MAX (an OR that gloo and NCCL both have), so
# that every rank takes the same decision even if its view of the routing modules differs:
_OTHER, _UNUSED, _USED, _KEEP = 0, 1, 2, 3  # not a branch's; a branch's, not run; run; shared with the model
_registry: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # every routing module alive
_functional: "weakref.WeakKeyDictionary[nn.Module, _Functional]" = weakref.WeakKeyDictionary()


def register(module: nn.Module) -> None:
    """Called by each routing module when it is created (or copied)."""
    _registry.add(module)
    _install_global_hook()


_now = [0]  # a clock that every take (one optimizer's step) advances


class Usage:
    """What one routing module's calls with autograd on recorded: ``bits``, bit i when unit i (a
    branch) ran since the last step (the forward touches nothing else, so that torch.compile
    sees the same value, 0, at the start of every step); ``stamps[i]``, the clock of the step
    that last found unit i in ``bits``, which each optimizer compares with the clock of its own
    previous step (several optimizers may hold parts of one branch, Muon and AdamW say). Also
    the DDP model around the module (its root and process group) once one was seen, and
    ``held``: the last forward's bits when they count only if that forward's output is used
    (see :class:`Held`)."""

    __slots__ = ("bits", "stamps", "root", "group", "held")

    def __init__(self) -> None:
        self.bits = 0
        self.stamps: List[int] = []
        self.root: Any = None  # weakref to the DDP-wrapped model
        self.group: Any = None
        self.held: Optional[Held] = None

    def record(self, live_mask: int) -> None:
        """Called by every call with autograd on, whether or not a branch ran (so that every
        rank notes the same DDP group)."""
        self.bits |= live_mask
        if self.root is None and dist.is_available() and dist.is_initialized():
            ddp = _compat.active_ddp()
            if ddp is not None:
                self.root = weakref.ref(ddp.module)
                self.group = ddp.process_group

    def hold(self, bits: int) -> "Held":
        """Keep one forward's ``bits`` back (the previous forward's count now, unless made
        conditional)."""
        self.settle()
        self.held = Held(self, bits)
        return self.held

    def settle(self) -> None:
        held, self.held = self.held, None
        if held is not None and not held.conditional:
            self.bits |= held.bits

    def harvest(self, now: int) -> None:
        """At a step: stamp the units in ``bits`` with the clock, and clear ``bits``."""
        self.settle()
        bits, stamps, i = self.bits, self.stamps, 0
        self.bits = 0
        while bits:
            if bits & 1:
                if i >= len(stamps):
                    stamps.extend([-1] * (i + 1 - len(stamps)))
                stamps[i] = now
            bits >>= 1
            i += 1

    def ran_since(self, i: int, since: int) -> bool:
        return i < len(self.stamps) and self.stamps[i] >= since


class Held:
    """The units one forward of a module ran, which count as used only if that forward's output
    is. They count at the module's next forward or at the step, unless a consumer that did not
    use the output (a decoder whose layers were all dropped, which only tied the encoder's
    output in) made them ``conditional``: then they count when a gradient reaches the output
    from elsewhere (:meth:`on_grad`, a tensor hook)."""

    __slots__ = ("usage", "bits", "conditional")

    def __init__(self, usage: Usage, bits: int) -> None:
        self.usage, self.bits, self.conditional = usage, bits, False

    def on_grad(self, grad: Optional[Tensor], tie_gave_zeros: bool) -> None:
        """The tie's own share is undefined (DDP), or zeros (FSDP2, static_graph): then only a
        nonzero gradient shows another consumer (a host sync, in this rare case only)."""
        if grad is not None and (not tie_gave_zeros or bool(grad.any())):
            self.usage.bits |= self.bits


class _Functional:
    """A branch module called through ``masked_branch``: a routing unit of its own."""

    __slots__ = ("module", "_usage", "__weakref__")
    materialize_grads = None

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)
        self._usage = Usage()

    def _unit_modules(self) -> List[nn.Module]:
        m = self.module()
        return [] if m is None else [m]

    def _units(self) -> List[Sequence[Tensor]]:
        return [tuple(m.parameters()) for m in self._unit_modules()]


def record_functional(branches: Sequence[Any], live_mask: int) -> None:
    """``masked_branch`` in a distributed job: note every module branch, and those that ran."""
    for i, b in enumerate(branches):
        if isinstance(b, nn.Module):
            unit = _functional.get(b)
            if unit is None:
                unit = _functional[b] = _Functional(b)
                _install_global_hook()
            unit._usage.record(live_mask >> i & 1)  # also when dead: it notes the DDP model around


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
    """One optimizer's parameters (in its order, which every rank shares) as bytes: ``base``
    marks each branch parameter _UNUSED (or _KEEP when the model outside the branches uses it
    too); ``units`` lists, per routing unit, the positions of its parameters."""

    def __init__(self, modules: Sequence[Any], params: Sequence[Tensor], root: Optional[nn.Module]):
        self.params = list(params)
        position = {id(p): k for k, p in enumerate(self.params)}
        self.base = bytearray(len(self.params))
        self.units: List[Tuple[Any, int, List[int]]] = []
        for m in modules:
            for i, ps in enumerate(m._units()):
                ks = [position[id(p)] for p in ps if id(p) in position]
                if ks:
                    self.units.append((m, i, ks))
                    for k in ks:
                        self.base[k] = _UNUSED
        if root is not None and self.units:
            branch_modules = {id(b) for m in modules for b in m._unit_modules()}
            for pid in _outside_params(root, branch_modules):
                if pid in position and self.base[position[pid]] == _UNUSED:
                    self.base[position[pid]] = _KEEP
        self.modules = list(dict.fromkeys(m for m, _, _ in self.units))
        self.first = next((self.params[ks[0]] for _, _, ks in self.units), None)

    def take(self, since: int) -> bytearray:
        """This rank's bytes: the units that ran since the clock read ``since``."""
        out = bytearray(self.base)
        for m, i, ks in self.units:
            if m._usage.ran_since(i, since):
                for k in ks:
                    if out[k] == _UNUSED:
                        out[k] = _USED
        return out

    def prune(self, reduced: bytes) -> int:
        """Set to None the gradients that every rank's bytes call unused (rank-independent)."""
        pruned, k = 0, reduced.find(_UNUSED)
        while k >= 0:
            p = self.params[k]
            if p.grad is not None:
                p.grad = None
                pruned += 1
            k = reduced.find(_UNUSED, k + 1)
        return pruned


def bits_device(backend: str, accelerator: Optional[torch.device] = None) -> torch.device:
    """Where the bytes must live to be reduced by ``backend`` (as ``dist.get_backend`` names it,
    e.g. ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``): the CPU when a CPU backend serves
    the group, else the current accelerator device (NCCL reduces device tensors only)."""
    entries = [e.split(":")[-1].strip().lower() for e in str(backend).split(",")]
    if any(e in ("gloo", "mpi", "ucc") for e in entries) or "cpu:" in str(backend).lower():
        return torch.device("cpu")
    if accelerator is not None:
        return accelerator
    if "nccl" in entries and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(
        f"unused_grads_to_none: cannot tell where the process group's backend {backend!r} reduces "
        "tensors; pass a process_group served by gloo or NCCL"
    )


def _reduce(bits: bytearray, group: Any) -> bytearray:
    """MAX-all-reduces ``bits`` in place."""
    host = torch.frombuffer(bits, dtype=torch.uint8)
    device = bits_device(dist.get_backend(group))
    t = host if device.type == "cpu" else host.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t is not host:
        host.copy_(t)
    return bits


def _mesh_group(p: Optional[Tensor]) -> Any:
    """The process group of a parameter sharded on a 1-D device mesh (FSDP2), else None."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and getattr(mesh, "ndim", 0) == 1:
        return mesh.get_group()
    return None


class _Pruner:
    """Prunes one optimizer's parameters of the given routing modules (all auto-mode modules, or
    those of one model for :func:`unused_grads_to_none`)."""

    def __init__(self, group: Any = None, root: Optional[nn.Module] = None):
        self.group = group
        self.root = root
        self._layouts: "weakref.WeakKeyDictionary[Any, Tuple[tuple, _Layout]]" = weakref.WeakKeyDictionary()
        self._since: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # per optimizer
        self.last_pruned = 0

    def layout(self, optimizer: torch.optim.Optimizer, modules: List[Any], root: Optional[nn.Module]) -> _Layout:
        n = sum(len(g["params"]) for g in optimizer.param_groups)
        key = (_structure.version(), len(modules), n, id(root))
        found = self._layouts.get(optimizer)
        if found is None or found[0] != key:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            found = (key, _Layout(modules, params, root))
            self._layouts[optimizer] = found
        return found[1]

    def run(self, optimizer: torch.optim.Optimizer, modules: List[Any], distributed: bool) -> None:
        root = self.root
        if root is None:
            roots = {id(r): r for m in modules for r in [m._usage.root and m._usage.root()] if r is not None}
            root = next(iter(roots.values())) if len(roots) == 1 else None
        layout = self.layout(optimizer, modules, root)
        now = _now[0]
        _now[0] = now + 1  # calls from here on count towards this optimizer's next step
        since, self._since[optimizer] = self._since.get(optimizer, 0), now + 1
        if not layout.units:
            return
        for m in layout.modules:
            m._usage.harvest(now)
        bits = layout.take(since)
        if distributed:
            group = self.group
            if group is None:
                group = next((m._usage.group for m in layout.modules if m._usage.group is not None), None)
            if group is None:
                group = _mesh_group(layout.first) or dist.group.WORLD
            bits = _reduce(bits, group)
        self.last_pruned = layout.prune(bytes(bits))


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


def _check_fsdp2(modules: List[Any]) -> None:
    """FSDP2 reduces only the gradients that are defined, pairing them by position across
    ranks: undefined gradients of skipped branches (``materialize_grads=False``) make it average
    different parameters together. Its sharded parameters (DTensors) show it at the step."""
    for m in modules:
        if m.materialize_grads is False and getattr(next(m.parameters(), None), "device_mesh", None) is not None:
            raise RuntimeError(
                f"{type(m).__name__}(materialize_grads=False) under FSDP2 (fully_shard): FSDP2 reduces "
                "only defined gradients, so ranks that skipped different branches averaged different "
                "parameters together in this step's backward. Use materialize_grads=None (the "
                "default, zeros under FSDP2) or True."
            )


def _before_any_step(optimizer, args, kwargs) -> Optional[Tuple[tuple, dict]]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    routing = list(_registry)
    _check_fsdp2(routing)
    if optimizer in _explicit:
        return None
    taken = {id(m) for h in _explicit.values() for m in h.modules}
    modules = [m for m in routing if m.materialize_grads is None and id(m) not in taken]
    modules += [u for u in list(_functional.values()) if u.module() is not None]
    if modules:
        return _after_closure(optimizer, args, kwargs, lambda: _auto.run(optimizer, modules, True))
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
        self._root = root
        if not self.modules and not any(m in _functional for m in root.modules()):
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

    def _units(self) -> List[Any]:
        if not _functional:
            return self.modules
        inside = {id(m) for m in self._root.modules()}
        return self.modules + [u for m, u in list(_functional.items()) if id(m) in inside]

    def _before_step(self, optimizer, args, kwargs) -> Optional[Tuple[tuple, dict]]:
        return _after_closure(optimizer, args, kwargs, lambda: self._prune(optimizer))

    def _prune(self, optimizer) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self._pruner.run(optimizer, self._units(), distributed)

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
    to do it for modules with an explicit setting, for one process, to name the model (FSDP2 or
    hand-written averaging with parameters shared between a branch and the rest of the model),
    or with another ``process_group`` (default: the DDP wrapper's group, else the group of
    FSDP2's 1-D mesh, else the default group). Parameters shared with a module outside the
    branches are never pruned; a parameter shared by branches is pruned only when all of them
    went unused. Calls under ``torch.no_grad()`` do not count as use.
    """
    return UnusedGradsToNone(optimizer, model, process_group)
