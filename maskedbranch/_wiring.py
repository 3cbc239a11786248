"""The wiring of one data-parallel wrapper: which branch parameters no rank used, decided where
every rank provably takes part, and their gradients reset to ``None`` before the step.

A routing module under DDP, FSDP2 or a model given to ``unused_grads_to_none`` gives the
parameters of branches that did not run a gradient anyway (maskedbranch/_dead_grads.py), so
that the wrapper's own reduction works; the wrapper then writes zeros where if/else with
``find_unused_parameters=True`` leaves ``None``. The wiring undoes exactly that:

1. **After each forward of the wrapper** (a forward hook on it: every rank runs the wrapper's
   forward, whatever its branches did), the units that ran on this rank become one byte per
   parameter of the wrapper (maskedbranch/_layout.py), and one MAX all-reduce of those bytes
   starts on a CPU process group (``async_op=True``: nothing waits, no device synchronization
   under NCCL).
2. **When that forward's backward starts** (a hook on the wrapper's outputs), a gradient that is
   ``None`` was cleared since the previous backward (``zero_grad()``, before or after the
   forward): what earlier forwards used no longer counts for it, as for if/else, whose cleared
   gradient only the later backwards fill. This is read only after a backward that synchronized
   gradients (so that every rank sees the same: inside ``no_sync`` the ranks' local gradients
   differ), which the first backward after an optimizer step always follows.
3. **Before an optimizer step** (maskedbranch/unused_grads.py), that optimizer's parameters read
   the reduced bytes (waiting only if an all-reduce still runs): a parameter that no rank used
   since its gradient was cleared gets ``None`` back. One that was never cleared keeps its tensor
   (``zero_grad(set_to_none=False)``: zero tensors stay). No collective runs in the step.

A wrapper is wired before its first forward by a module forward pre-hook that only looks for
wrappers and lives until the first optimizer step (a hook registered during a forward would not
run for it); one wired during its first forward reduces that forward from its backward instead.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _compat, _usage
from ._layout import COND, OTHER, UNUSED, Layout, cpu_group, mesh_group, tensors

_MAX_PENDING = 8  # forwards whose reduction stays unmerged before a backward or step merges them

_wirings: "weakref.WeakKeyDictionary[nn.Module, Wiring]" = weakref.WeakKeyDictionary()
_version = [0]  # bumped when a wiring or a layout changes: the step hook's per-optimizer lists


def explicit(m: Any) -> bool:
    w = _wirings.get(m) if isinstance(m, nn.Module) else None
    return w is not None and w.explicit_kind


def wiring_for(wrapper: nn.Module, explicit_kind: bool = False, process_group: Any = None, *, before_forward: bool = False) -> "Wiring":
    """The wiring of ``wrapper`` (made on first use). ``before_forward``: made before the
    wrapper's forward started, so its forward hook runs for this forward too."""
    found = _wirings.get(wrapper)
    if found is None:
        found = _wirings[wrapper] = Wiring(wrapper, explicit_kind, process_group)
        found.needs_first = not before_forward and not torch.compiler.is_compiling()
        _version[0] += 1
        from . import unused_grads

        unused_grads.install()
    return found


def forget_layouts() -> None:
    """A module's units changed (a branch added, a LayerDrop owner's parameters became one):
    every wiring makes its layout again at its next forward."""
    for w in list(_wirings.values()):
        w.layout = None


def all_wirings() -> List["Wiring"]:
    return list(_wirings.values())


def _root_of(wrapper: nn.Module) -> nn.Module:
    return wrapper.module if isinstance(wrapper, nn.parallel.DistributedDataParallel) else wrapper


# ----------------------------------------------------------------------------------------------
# Spotting wrappers before their first forward (see the module's docstring).

_spotter: List[Any] = []
_spotted: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def arm() -> None:
    """Called when a routing module is made: only in a distributed job (a wrapper can run)."""
    if not _spotter and dist.is_available() and dist.is_initialized():
        _spotter.append(nn.modules.module.register_module_forward_pre_hook(_spot))


def disarm() -> None:
    while _spotter:
        _spotter.pop().remove()


def _wrapper_types() -> Tuple[type, ...]:
    import sys

    types: List[type] = [nn.parallel.DistributedDataParallel]
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if isinstance(fsdp, type):
        types.append(fsdp)
    return tuple(types)


def _spot(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling() or not isinstance(module, _wrapper_types()) or module in _wirings:
        return
    if module in _spotted or not (dist.is_available() and dist.is_initialized()):
        return
    _spotted[module] = True
    inside = [w for w in _wirings.values() if w.root() is not None and any(m is module for m in w.root().modules())]
    if not inside and _usage.routing_modules(_root_of(module)):
        wiring_for(module, before_forward=True)  # an FSDP2 unit inside a wired root is not a root


# ----------------------------------------------------------------------------------------------
# The wiring.


class Wiring:
    """See the module's docstring. ``explicit_kind``: made by ``unused_grads_to_none`` for a
    model that is not DDP or FSDP2 (its routing modules then tie with zeros); ``everything``:
    also the modules with an explicit ``materialize_grads`` (an explicit handle asked for them)."""

    def __init__(self, wrapper: nn.Module, explicit_kind: bool = False, process_group: Any = None):
        self.ref = weakref.ref(wrapper)
        self.explicit_kind = explicit_kind
        self.everything = explicit_kind
        self.process_group = process_group
        self._contexts: Dict[str, Any] = {}
        self.functional: List[Any] = []
        self.layout: Optional[Layout] = None
        self.needs_first = False  # made during a forward: that forward is reduced from its backward
        self._forwards = itertools.count(1)
        self.pending: List[list] = []  # [work, bytes tensor, forward number, its backward started]
        self.acc = bytearray()  # per position: the MAX of the merged forwards since its window began
        self.cleared = bytearray()  # per position: its gradient was seen None since its last step
        self.stepped: Dict[int, Tensor] = {}  # position -> the parameter object its optimizer holds
        self._synced = True  # the last backward synchronized gradients (or none ran yet)
        self._backwards = 0  # backwards started since the last step
        self.last_reset = 0
        self._hook = wrapper.register_forward_hook(_after_forward)

    def context(self, kind: str, epoch: int):
        from ._dead_grads import Context

        ctx = self._contexts.get(kind)
        if ctx is None:
            ctx = self._contexts[kind] = Context(kind, self.ref(), self)
        ctx.epoch = epoch
        return ctx

    def add_functional(self, unit: Any) -> None:
        if unit not in self.functional:
            self.functional.append(unit)
            self.layout = None

    def root(self) -> Optional[nn.Module]:
        w = self.ref()
        return None if w is None else _root_of(w)

    def _layout(self) -> Optional[Layout]:
        if self.layout is None:
            root = self.root()
            if root is None:
                return None
            units = [m for m in _usage.routing_modules(root) if self.everything or m.materialize_grads is None]
            units += [u for u in self.functional if u.module() is not None]
            self.layout = Layout(root, units)
            n = len(self.layout.base)
            self.acc, self.cleared, self.stepped = bytearray(n), bytearray(n), {}
            self.pending = [p for p in self.pending if p[1].numel() == n]
            _version[0] += 1  # positions changed: the step hook's per-optimizer lists too
        return self.layout

    def _group(self) -> Any:
        group = self.process_group
        w = self.ref()
        if group is None and isinstance(w, nn.parallel.DistributedDataParallel):
            group = w.process_group
        if group is None:
            group = mesh_group(w)
        return cpu_group(group)

    # -- forward end -------------------------------------------------------------------------

    def after_forward(self, output: Any = None) -> None:
        # The forward that made this wiring ran this hook after all (torch < 2.7 compiles the
        # global pre-hook that would have made it earlier), or a later forward came before any
        # backward: usage accumulates until taken, so one launch covers both. Two would let the
        # second's backward, finding gradients None, discard the first's usage.
        self.needs_first = False
        number = self._launch()
        if number is not None:
            w = self.ref()
            sync = not isinstance(w, nn.parallel.DistributedDataParallel) or bool(w.require_backward_grad_sync)
            hook = functools.partial(self._backward_starts, number, sync)
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)

    def first_forward_hook(self, out: Any) -> None:
        """A forward that made this wiring ran no forward hook: every routed output of it gets
        a one-shot gradient hook; the first to fire (in the backward, when the whole forward's
        usage is known) launches the forward's reduction, on every rank (under DDP with
        ``find_unused_parameters=False`` a gradient reaches some routed output on each)."""
        if isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(self._first_grad)

    def _first_grad(self, grad: Tensor) -> None:
        if self.needs_first:
            number = self.launch_first()
            if number is not None:
                self._backward_starts(number, True)

    def launch_first(self) -> Optional[int]:
        self.needs_first = False
        return self._launch()

    def _launch(self) -> Optional[int]:
        w = self.ref()
        if _compat.ddp_join_active(w):
            raise RuntimeError(
                "maskedbranch: this DDP model runs inside torch.distributed.algorithms.Join (uneven "
                "inputs), whose joined ranks do not take part in the all-reduce that tells which "
                "branches no rank used. Pass materialize_grads=True to the routing modules (dead "
                "branches get zero gradients, nothing is reset and nothing communicates), or give "
                "every rank the same number of batches."
            )
        layout = self._layout()
        if layout is None or not layout.units:
            return None
        mine = layout.take()
        t = torch.frombuffer(mine, dtype=torch.uint8)
        if dist.is_available() and dist.is_initialized():
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group(), async_op=True)
        else:
            work = None  # one process (an explicit wiring): these bytes are the answer
        number = next(self._forwards)
        self.pending.append([work, t, number, False])
        if len(self.pending) > _MAX_PENDING:
            self._merge(lambda entry: entry[3])
        return number

    # -- backward start ----------------------------------------------------------------------

    def _backward_starts(self, number: int, sync: bool, grad: Any = None) -> None:
        entry = next((e for e in self.pending if e[2] == number), None)
        if entry is None or entry[3]:
            return  # not this wiring's any more, or another output's hook came first
        self._merge(lambda e: e[2] < number)
        if self._synced and self.layout is not None:
            acc, cleared = self.acc, self.cleared
            for _, _, ks in self.layout.units:
                for k in ks:
                    if self._param(k).grad is None:
                        acc[k] = OTHER  # cleared: what earlier forwards used no longer counts
                        cleared[k] = 1
        self._synced = sync
        self._backwards += 1
        entry[3] = True

    def _param(self, k: int) -> Tensor:
        p = self.stepped.get(k)
        return self.layout.params[k] if p is None else p

    def _merge(self, which) -> None:
        """Wait for the reductions of the pending forwards ``which`` selects and MAX them in."""
        n = len(self.acc)
        keep = []
        acc = torch.frombuffer(self.acc, dtype=torch.uint8) if n else None
        for entry in self.pending:
            if not which(entry):
                keep.append(entry)
                continue
            work, t = entry[0], entry[1]
            if work is not None:
                work.wait()
            if acc is not None and t.numel() == n:
                torch.maximum(acc, t, out=acc)
        self.pending = keep

    # -- the step ----------------------------------------------------------------------------

    def reset(self, params: Sequence[Tensor], positions: Sequence[int]) -> int:
        """Before a step of an optimizer holding ``params`` (at ``positions``): set to None the
        gradients that no rank used and if/else would have left None. Returns how many."""
        if self.needs_first:  # the first forward's routed outputs got no gradient on this rank
            number = self.launch_first()
            if number is not None:
                self._backward_starts(number, True)
        if self.layout is None:
            return 0
        for m in self.layout.modules:  # calls after the last forward (checkpoint recomputation)
            m._usage.take()
        self._merge(lambda entry: True)
        if self._backwards:
            self._check_reduction_finished(params, positions)
        self._backwards = 0
        acc, cleared = self.acc, self.cleared
        done = 0
        for p, k in zip(params, positions):
            if k < 0 or k >= len(acc):
                continue
            self.stepped[k] = p
            grad = p.grad
            code = acc[k]
            if code == COND and grad is not None and not bool(getattr(grad, "to_local", lambda: grad)().any()):
                code = UNUSED  # no gradient reached it from elsewhere on any rank (a rare read)
            if code == UNUSED and cleared[k] and grad is not None:
                p.grad = None
                done += 1
            acc[k] = OTHER
            cleared[k] = 0
        self.last_reset = done
        return done

    def _check_reduction_finished(self, params: Sequence[Tensor], positions: Sequence[int]) -> None:
        """Under DDP with ``find_unused_parameters=False`` every parameter has a gradient after a
        backward (DDP writes them all once its reduction finishes). One that has none took no
        part in the backward on this rank: DDP could not average this step's gradients and will
        raise at the next forward; say which, and what to do, now."""
        w = self.ref()
        if not isinstance(w, nn.parallel.DistributedDataParallel) or w.find_unused_parameters or w.static_graph:
            return
        ignored = getattr(w, "parameters_to_ignore", ()) or ()
        names, base = self.layout.names, self.layout.base
        # (the branches' own parameters have none either then: DDP wrote nothing)
        missing = [names[k] for p, k in zip(params, positions)
                   if 0 <= k < len(names) and base[k] == OTHER and p.requires_grad and p.grad is None and names[k] not in ignored]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise RuntimeError(
                f"maskedbranch: {shown} took no part in this backward on this rank, outside any routing "
                "module, so DistributedDataParallel(find_unused_parameters=False) could not average this "
                "step's gradients (it raises 'Expected to have finished reduction in the prior iteration' "
                "at the next forward). Route the code that skips them through a maskedbranch module (or "
                "the transformers patch), set requires_grad=False on parameters the model never uses, or "
                "use find_unused_parameters=True."
            )

    def positions(self, params: Sequence[Tensor]) -> List[int]:
        """Where the wrapper's bytes hold each of ``params`` (-1: not the wrapper's), by name, so
        that parameters swapped since the layout was made (FSDP2 shards) are still found."""
        layout = self._layout()
        root = self.root()
        if layout is None or root is None:
            return [-1] * len(params)
        index = {n: k for k, n in enumerate(layout.names)}
        now = {id(p): index.get(n, -1) for n, p in root.named_parameters()}
        return [now.get(id(p), -1) for p in params]

    def remove(self) -> None:
        self._hook.remove()
        w = self.ref()
        if w is not None and _wirings.get(w) is self:
            del _wirings[w]
            _version[0] += 1


@torch.compiler.disable
def _after_forward(module: nn.Module, args: Any, output: Any) -> None:
    if not torch.is_grad_enabled():
        return
    wiring = _wirings.get(module)
    if wiring is not None:
        wiring.after_forward(output)
