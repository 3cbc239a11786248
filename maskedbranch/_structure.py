"""What a routing module knows about its branches (their parameters, the parameters to tie for
each set of live branches), computed once per module structure.

Walking ``parameters()`` of every branch on every call costs more than a small branch's forward,
so these facts are cached, with one invalidation rule: any registration of a module, parameter
or buffer anywhere in the process (``add_module``, attribute assignment,
``convert_sync_batchnorm``: PyTorch's global registration hooks), any ``_apply`` on a routing
module or an ancestor (``.to()``, ``.half()``, which may replace parameter objects), and the
``nn.ModuleList`` edits that register nothing (``del``, ``insert``) bump one global version; a
cache computed under an older version is recomputed on its next use.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

_version = [0]


def invalidate(*_args) -> None:
    """Mark every cache stale. Also the registration hooks' signature (they must return None)."""
    _version[0] += 1


_module.register_module_module_registration_hook(invalidate)
_module.register_module_parameter_registration_hook(invalidate)
_module.register_module_buffer_registration_hook(invalidate)


class InvalidatesOnApply:
    """Mixin for routing modules: ``_apply`` may replace parameter objects without registering them."""

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        invalidate()
        return out


class RoutingModuleList(InvalidatesOnApply, nn.ModuleList):
    """An ``nn.ModuleList`` of routed modules (MaskedBranch's branches, a LayerDrop owner's
    layers): its edits that register nothing still refresh the caches, and a slice is a plain
    ``nn.ModuleList`` of the modules, as ``nn.ModuleList`` gives it (not a second routing list,
    which an empty slice could not even construct)."""

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)

    def __delitem__(self, idx) -> None:
        super().__delitem__(idx)
        invalidate()

    def insert(self, index: int, module: nn.Module) -> None:
        super().insert(index, module)
        invalidate()


# At most this many sets of live branches keep their tied parameters (a many-branch layer could
# see any number of them).
MAX_CACHED_SETS = 1024


class Branches:
    """The branches of one routing module, each branch's parameters, and per set of live branches
    (a bit mask) the parameters to tie: those of the branches that did not run, less any that a
    live branch shares (it gives them their gradient already)."""

    __slots__ = ("version", "branches", "params", "skippable", "_tied")

    def __init__(self, branches: Sequence, version: int = -1, params: "Sequence[Sequence[Tensor]] | None" = None):
        self.version = version
        self.branches = list(branches)
        if params is None:
            params = [tuple(b.parameters()) if isinstance(b, nn.Module) else () for b in self.branches]
        self.params: List[Tuple[Tensor, ...]] = [tuple(ps) for ps in params]
        self.skippable: "bool | None" = None  # set once the collectives check passed
        self._tied: Dict[int, Tuple[Tensor, ...]] = {}

    def tied(self, live_mask: int) -> Tuple[Tensor, ...]:
        found = self._tied.get(live_mask)
        if found is None:
            live_ids = {id(p) for i, ps in enumerate(self.params) if live_mask >> i & 1 for p in ps}
            out: Dict[int, Tensor] = {}
            for i, ps in enumerate(self.params):
                if not live_mask >> i & 1:
                    out.update((id(p), p) for p in ps if id(p) not in live_ids)
            found = tuple(out.values())
            if len(self._tied) < MAX_CACHED_SETS:
                self._tied[live_mask] = found
        return found


def current(cache: "Branches | None") -> bool:
    return cache is not None and cache.version == _version[0]


def version() -> int:
    return _version[0]


# ----------------------------------------------------------------------------------------------
# Collectives. A branch that runs on one rank and is skipped on another must not communicate:
# its collective would never be matched and the job would hang. One policy for every routing
# module: such branches are refused whenever a branch may be skipped.


def _collective_types() -> Tuple[type, ...]:
    types: List[type] = [nn.SyncBatchNorm, nn.parallel.DistributedDataParallel]
    # Only look at what the user imported: importing FSDP here would cost a second at startup.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for name in ("FullyShardedDataParallel", "FSDPModule"):
        t = getattr(fsdp, name, None)
        if isinstance(t, type):
            types.append(t)
    return tuple(types)


def check_skippable(branches: Sequence, where: str) -> None:
    """Refuse branches that run collectives: SyncBatchNorm, DDP- or FSDP-wrapped modules (an FSDP2
    unit inside a branch gathers its parameters in its own forward), and DTensor parameters
    (tensor parallelism communicates in the forward). An FSDP2 unit *around* the routing module
    is fine: it gathers the parameters of all branches before the routing module runs.

    ``where`` names the branches in the message ("branches" or "branch")."""
    types = _collective_types()
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for i, branch in enumerate(branches):
        if not isinstance(branch, nn.Module):
            continue
        label = f"{where}[{i}]" if len(branches) > 1 or where == "branches" else where
        for name, m in branch.named_modules():
            if isinstance(m, types):
                hint = (
                    " Use nn.BatchNorm* instead: a routed branch normalizes the rows it serves, as the "
                    "if/else model does."
                    if isinstance(m, nn.SyncBatchNorm)
                    else ""
                )
                raise ValueError(
                    f"{label}{'.' + name if name else ''} is a {type(m).__name__}, which runs collectives "
                    "across ranks. A branch that gets no rows on one rank is skipped there, so its "
                    f"collective would never be matched and the job would hang.{hint}"
                )
        if isinstance(dtensor, type):
            for name, p in branch.named_parameters():
                if isinstance(p, dtensor) and not torch.compiler.is_compiling():
                    raise ValueError(
                        f"{label}.{name} is a DTensor while the forward runs: sharded parameters "
                        "communicate in the forward, which a skipped branch would not match. Shard the "
                        "routing module (or a module around it) with fully_shard instead of a branch."
                    )
