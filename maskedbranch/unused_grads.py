"""``unused_grads_to_none``: the optimizer skips the parameters that no rank used, as it does with
if/else routing and ``DistributedDataParallel(find_unused_parameters=True)``.

A branch that did not run still gets a gradient from maskedbranch, so that DDP works with
``find_unused_parameters=False``: DDP averages the ranks' gradients and writes zeros for a branch
that no rank used. An optimizer then steps those parameters (momentum, Adam's moments and weight
decay move them) and pays for it. With ``find_unused_parameters=True``, DDP learns which
parameters no rank used (a walk of the autograd graph after every forward, plus an all-reduce of
a used-map) and leaves their gradient ``None``, so the optimizer skips them.

maskedbranch already knows which branches ran: every ``MaskedBranch`` / ``ResidualDropPath``
records it as it routes. Before each optimizer step this hook all-reduces those bits (one small
all-reduce, no graph walk) and sets the gradient of every parameter that belongs only to branches
that no rank ran since the previous step to ``None``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import _C, _structure

__all__ = ["UnusedGradsToNone", "unused_grads_to_none"]

_USED = ord("1")
_MAX_PENDING = 16  # reductions launched after forwards and not yet waited for by a step


def _routing_modules(model: nn.Module) -> List[nn.Module]:
    """The modules that record which of their units (branches) ran."""
    return [m for m in model.modules() if hasattr(m, "_usage") and hasattr(m, "_units")]


class _Layout:
    """Which parameters can be pruned, grouped by the units (branches) they belong to.

    The used bits travel as one ASCII byte per unit ('1' used, '0' not), reduced with MAX (an OR
    that gloo and NCCL both have). Module m's units are ``format(bits, "0{n}b")``: its last
    branch comes first, so unit numbers follow that order."""

    def __init__(self, model: nn.Module):
        self.formats: List[Tuple[Any, int, str]] = []  # (the module's Usage, its units' mask, their format)
        units_of: Dict[int, List[int]] = {}
        params: Dict[int, Tensor] = {}
        branch_modules = set()
        start = 0
        for m in _routing_modules(model):
            pairs = m._units()
            n = len(pairs)
            self.formats.append((m._usage, (1 << n) - 1, f"0{n}b"))
            for i, (branch, ps) in enumerate(pairs):
                branch_modules.add(id(branch))
                for p in ps:
                    params[id(p)] = p
                    units_of.setdefault(id(p), []).append(start + n - 1 - i)
            start += n
        # Parameters owned by a module reached without entering a branch (the trunk, or the
        # routing module itself) may be used whatever the routing: never pruned.
        outside = set()
        seen = set()
        stack = [model]
        while stack:
            m = stack.pop()
            if id(m) in seen or id(m) in branch_modules:
                continue
            seen.add(id(m))
            outside.update(id(p) for p in m.parameters(recurse=False))
            stack.extend(m.children())
        # The prunable parameters, grouped by the set of units they belong to.
        by_units: Dict[Tuple[int, ...], List[Tensor]] = {}
        for pid, us in units_of.items():
            if pid not in outside:
                by_units.setdefault(tuple(sorted(set(us))), []).append(params[pid])
        # Prunable parameters per unit when a parameter belongs to that unit alone (the common
        # case), per set of units otherwise.
        self.single: List[Tuple[int, List[Tensor]]] = []
        self.shared: List[Tuple[Tuple[int, ...], List[Tensor]]] = []
        for units, ps in by_units.items():
            if len(units) == 1:
                self.single.append((units[0], ps))
            else:
                self.shared.append((units, ps))

    def take_bits(self) -> Tensor:
        """The bits recorded since the last call, as the bytes reduced across ranks; resets them."""
        parts = []
        for usage, mask, fmt in self.formats:
            parts.append(format(usage.bits & mask, fmt))  # one character per unit, whatever the bits
            usage.bits = 0
        return torch.frombuffer(bytearray("".join(parts), "ascii"), dtype=torch.uint8)

    def unused_params(self, used: bytes) -> List[Tensor]:
        """The prunable parameters of the units whose byte in ``used`` is not '1'."""
        out: List[Tensor] = []
        for u, ps in self.single:
            if used[u] != _USED:
                out += ps
        for units, ps in self.shared:
            if all(used[u] != _USED for u in units):
                out += ps
        return out


class UnusedGradsToNone:
    """The handle :func:`unused_grads_to_none` returns; ``remove()`` detaches its hooks.

    With a DDP model, the used bits are all-reduced asynchronously right after every forward
    that will synchronize gradients (not under ``no_sync()``), so the collective overlaps the
    backward; the step hook only waits for it. Otherwise the step hook reduces them itself."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, process_group: Any = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module (the model or its DDP wrapper), got {type(model).__name__}")
        import torch.distributed as dist

        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.model = model.module if ddp else model
        if not _routing_modules(self.model):
            raise ValueError(
                "model: contains no MaskedBranch or ResidualDropPath, so no parameter can be found unused"
            )
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = model.process_group if ddp else dist.group.WORLD
        self.process_group = process_group
        self._bits_device = None if process_group is None else self._device_for(process_group)
        self._layout: _structure.StructureCache[_Layout] = _structure.StructureCache()
        self._pending: List[Tuple[Optional[_Layout], Any, Optional[Tensor]]] = []  # (layout, work, flags) per launch
        self._handles = [optimizer.register_step_pre_hook(self._before_step)]
        if ddp and process_group is not None:
            self._handles.append(model.register_forward_hook(self._after_ddp_forward))
        self.last_pruned = 0  # parameters set to None before the last step (for logging)

    def _current_layout(self) -> _Layout:
        return self._layout.get(lambda: _Layout(self.model))

    @staticmethod
    def _device_for(process_group: Any) -> torch.device:
        """Where the used bits live for ``process_group``'s backend."""
        import torch.distributed as dist

        backend = str(dist.get_backend(process_group)).lower()
        if "gloo" in backend or "mpi" in backend or "nccl" not in backend:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())  # NCCL reduces device tensors only

    def _launch(self, async_op: bool) -> None:
        """Take (and reset) the bits recorded so far and start reducing them across ranks."""
        layout = self._current_layout()
        flags = layout.take_bits()
        work = None
        if self.process_group is not None:
            import torch.distributed as dist

            device = self._bits_device
            if device.type == "cuda":
                # pinned and non-blocking: no host wait at the end of the forward (the copy
                # queues behind the forward's kernels); `flags` is read back at the step
                flags = flags.pin_memory().to(device, non_blocking=True)
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group, async_op=async_op)
        self._pending.append((layout, work, flags))
        if len(self._pending) > _MAX_PENDING:
            # Many forwards without a step (evaluation with autograd on, say): keep one entry.
            used = self._wait_pending(layout)
            if used is None:  # stale: keep it so, nothing is pruned at the next step
                self._pending.append((None, None, None))
            else:
                self._pending.append((layout, None, torch.frombuffer(bytearray(used), dtype=torch.uint8)))

    def _wait_pending(self, layout: _Layout) -> Optional[bytes]:
        """Wait for the pending reductions and OR them (None when one came from another layout);
        clears them."""
        used: Optional[bytes] = None
        stale = False
        for launched, work, flags in self._pending:
            if work is not None:
                work.wait()
            if launched is not layout:
                stale = True
            elif not stale:
                got = bytes(flags.tolist())
                used = got if used is None else bytes(map(max, used, got))
        self._pending.clear()
        return None if stale else used

    def _after_ddp_forward(self, ddp, args, output) -> None:
        # Only forwards whose backward synchronizes: every rank runs them, in the same order.
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            self._launch(async_op=True)

    def _used_bytes(self) -> Optional[bytes]:
        """One byte per unit of the current layout, '1' where the unit ran on some rank since the
        last step (waits for the reductions launched after forwards, or runs one now). None when
        the module structure changed in between (nothing is pruned then)."""
        if not self._pending:
            self._launch(async_op=False)
        return self._wait_pending(self._current_layout())

    def _before_step(self, optimizer, args, kwargs) -> None:
        used = self._used_bytes()
        # one C++ call clears the gradients (and counts those that were set)
        self.last_pruned = _C.grads_to_none(self._current_layout().unused_params(used)) if used is not None else 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def unused_grads_to_none(
    optimizer: torch.optim.Optimizer, model: nn.Module, process_group: Optional[Any] = None
) -> UnusedGradsToNone:
    """Before every ``optimizer.step()``, set to ``None`` the gradient of each parameter that
    belongs only to ``MaskedBranch`` / ``ResidualDropPath`` branches that ran on no rank since the
    previous step, so that the optimizer skips it (no momentum, moment or weight-decay update, no
    time spent), exactly as with if/else routing and ``find_unused_parameters=True``.

    Args:
        optimizer: the optimizer to hook (``register_step_pre_hook``).
        model: the model, or its ``DistributedDataParallel`` wrapper.
        process_group: where the used bits are all-reduced; default: the DDP wrapper's group,
            else the default group when ``torch.distributed`` is initialized, else none (one
            process). A gloo group reduces a host tensor (no device sync); NCCL reduces a device
            tensor and the hook reads it back (one small sync before the step).

    With a DDP wrapper, the used bits are all-reduced asynchronously after each forward that
    synchronizes gradients (overlapping the backward). Otherwise every rank must step the
    optimizer the same number of times (the step hook runs the collective), as data-parallel
    training does. A step GradScaler skips (inf found) does not run the hook, so its bits count
    towards the next step.
    Calls under ``torch.no_grad()`` do not count as use. Parameters shared with a module outside
    the branches are never pruned; a parameter shared by branches is pruned only when all of
    them went unused. The result equals ``find_unused_parameters=True`` when gradients are
    zeroed with ``set_to_none=True`` (the default of ``zero_grad``).

    Returns a handle whose ``remove()`` detaches the hook.
    """
    return UnusedGradsToNone(optimizer, model, process_group)
