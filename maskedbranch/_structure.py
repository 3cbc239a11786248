"""A routing module's branch table (:class:`Branches`) and its checks (:class:`Sites`), the branch
list whose changes drop it (:class:`RoutingModuleList`), and the collectives policy
(:func:`check_skippable`): docs/design.md, "Caches dropped by their own module's changes" and "One
collectives policy". The table exists because walking every branch's ``parameters()`` on every
call costs more than a small branch's forward.
"""
from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

_is = operator.is_


class Sites:
    """Where some modules' submodules and parameters are registered: (dict, key, object) for
    every entry in the ``_modules`` and ``_parameters`` of each module of their trees, and each
    dict's length (a new entry shows too). :meth:`valid` costs a C-level pass over the entries."""

    __slots__ = ("dicts", "keys", "objs", "owners", "lens")

    def __init__(self, modules: Sequence[Any]):
        dicts: List[dict] = []
        keys: List[str] = []
        objs: List[Any] = []
        owners: Dict[int, dict] = {}
        seen, stack = set(), [m for m in modules if isinstance(m, nn.Module)]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            for d in (m._modules, m._parameters):
                owners[id(d)] = d
                for k, v in d.items():
                    dicts.append(d)
                    keys.append(k)
                    objs.append(v)
            stack.extend(c for c in m._modules.values() if c is not None)
        self.dicts, self.keys, self.objs = tuple(dicts), tuple(keys), tuple(objs)
        self.owners = tuple(owners.values())
        self.lens = tuple(map(len, self.owners))

    def valid(self) -> bool:
        return (
            tuple(map(len, self.owners)) == self.lens
            and all(map(_is, map(dict.get, self.dicts, self.keys), self.objs))
        )


# At most this many sets of live branches keep their tied parameters (a many-branch layer could
# see any number of them).
MAX_CACHED_SETS = 1024


class CheckedBranch:
    """A residual branch as the residual forms put it in their table (maskedbranch/residual.py):
    the branch, with the check of its output (shaped like its input rows). ``is_module``:
    whether the branch is a module, given by the caller (Dynamo before 2.7 cannot take
    isinstance of the timm patch's closures)."""

    __slots__ = ("branch", "is_module")

    def __init__(self, branch: Any, is_module: bool = True):
        self.branch = branch
        self.is_module = is_module

    def __call__(self, h: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self.check(self.branch(h, *args, **kwargs), h)

    def check(self, y: Any, h: Tensor) -> Tensor:
        if not isinstance(y, Tensor) or y.dim() != h.dim() or y.shape[0] != h.shape[0] or y.shape[1:] != h.shape[1:]:
            got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(
                f"branch: a residual branch must return a tensor shaped like its input rows "
                f"({h.shape[0]}, {', '.join(map(str, h.shape[1:]))}), got {got}"
            )
        return y


def module_of(branch: Any) -> Tuple[Any, bool]:
    """What a table's branch runs, and whether that is a module: a residual wrapper's branch,
    else the branch itself (told apart by class, not by attribute: a user's branch may have any)."""
    if isinstance(branch, CheckedBranch):
        return branch.branch, branch.is_module
    return branch, isinstance(branch, nn.Module)


class Branches:
    """The branches of one routing module, each branch's parameters, and per set of live branches
    (a bit mask) the parameters to tie: those of the branches that did not run, less any that a
    live branch shares (it gives them their gradient already).

    ``params`` given explicitly (a function branch with ``params=``, a timm residual) are the
    caller's to keep current, unless ``modules`` names the module of each branch; otherwise they
    are the modules' own. :meth:`tied` answers None once any watched parameter, or a module
    above it in a branch, was replaced."""

    __slots__ = ("branches", "params", "skippable", "_tied", "_watch")

    def __init__(self, branches: Sequence, params: "Sequence[Sequence[Tensor]] | None" = None,
                 modules: "Sequence[Any] | None" = None):
        self.branches = list(branches)
        self._watch = list(modules) if modules is not None else (self.branches if params is None else None)
        if params is None:
            params = [tuple(b.parameters()) if isinstance(b, nn.Module) else () for b in self.branches]
        self.params: List[Tuple[Tensor, ...]] = [tuple(ps) for ps in params]
        self.skippable: "bool | None" = None  # set once the collectives check passed
        self._tied: Dict[int, Tuple[Tuple[Tensor, ...], Optional[Sites]]] = {}

    def refresh(self) -> None:
        """Read the branches' parameters again (after :meth:`tied` found one replaced)."""
        if self._watch is not None:
            self.params = [tuple(m.parameters()) if isinstance(m, nn.Module) else () for m in self._watch]
        self._tied.clear()

    def tied(self, live_mask: int) -> Optional[Tuple[Tensor, ...]]:
        """The parameters to tie when the branches of ``live_mask`` ran; None when the cache is
        stale (rebuild it)."""
        found = self._tied.get(live_mask)
        if found is None:
            if self._watch is not None:  # read now, with the Sites made from the same registrations
                self.params = [tuple(m.parameters()) if isinstance(m, nn.Module) else () for m in self._watch]
            live_ids = {id(p) for i, ps in enumerate(self.params) if live_mask >> i & 1 for p in ps}
            out: Dict[int, Tensor] = {}
            dead = []
            for i, ps in enumerate(self.params):
                if not live_mask >> i & 1:
                    out.update((id(p), p) for p in ps if id(p) not in live_ids)
                    if self._watch is not None:
                        dead.append(self._watch[i])
            found = (tuple(out.values()), Sites(dead) if dead and out else None)
            if len(self._tied) < MAX_CACHED_SETS:
                self._tied[live_mask] = found
        tensors, sites = found
        if sites is not None and not sites.valid():
            return None
        return tensors


class CacheOwner:
    """Mixin for modules that cache facts about their parameters: ``_apply`` (``.to()``,
    ``.half()``) and ``load_state_dict`` may replace parameter objects, so both drop the caches
    outright (``_drop_caches``), on this module and on any ancestor's call."""

    def _drop_caches(self) -> None:
        """What the module derived from its parameters is forgotten (subclasses override)."""

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self._drop_caches()
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[misc]
        self._drop_caches()


def is_named(modules: Any) -> bool:
    """Whether ``modules`` names its modules (an ``nn.ModuleDict`` or a mapping), rather than
    listing them."""
    return isinstance(modules, (nn.ModuleDict, Mapping))


class RoutingModuleList(CacheOwner, nn.ModuleList):
    """An ``nn.ModuleList`` of routed modules (MaskedBranch's branches, a LayerDrop owner's
    layers) whose changes (``append``, ``insert``, item assignment, ``del``) drop the caches. A
    slice is a plain ``nn.ModuleList``, as ``nn.ModuleList`` gives it (an empty routing list could
    not be constructed).

    Built from an ``nn.ModuleDict`` (or a mapping of names to modules), it keeps the names as
    its children's names, so that the ``state_dict`` keys stay the dict's (``experts.expert_0.*``):
    position i is the i-th name in insertion order, and ``[name]``, ``keys()``, ``items()`` and
    ``in`` work as on the dict. Positions are the routing's branch ids, so a named list is not
    renumbered: ``del`` keeps the other names, ``[name] = module`` adds or replaces a branch, and
    ``insert`` / ``append`` / ``extend`` (which would make up numeric names) are refused."""

    _named = False  # built from a ModuleDict: the children keep its names

    def __init__(self, modules: Any = None):
        if not is_named(modules):
            super().__init__(modules)
            return
        super().__init__()
        self._named = True
        for name, module in modules.items():
            try:
                self.add_module(name, module)
            except KeyError as e:  # not a module name ("a.b", ""), or one of this class's attributes
                raise ValueError(f"branches[{name!r}]: cannot name a child module: {e.args[0]}") from None

    def _position(self, idx: int) -> str:
        """The name of the child at position ``idx`` (negative from the end), as ModuleList's
        index check words it."""
        n = len(self._modules)
        i = operator.index(idx)
        if not -n <= i < n:
            raise IndexError(f"index {idx} is out of range")
        return next(itertools.islice(self._modules.keys(), i % n, None))

    def _branch_at(self, k: int) -> nn.Module:
        """Branch ``k`` (0 <= k < len), for the routing's int gate."""
        return self._modules[self._position(k)] if self._named else self._modules[str(k)]

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        if self._named:
            return self._modules[idx] if isinstance(idx, str) else self._modules[self._position(idx)]
        return super().__getitem__(idx)

    def __setitem__(self, idx, module) -> None:
        if self._named:
            setattr(self, idx if isinstance(idx, str) else self._position(idx), module)
        else:
            super().__setitem__(idx, module)

    def __contains__(self, item) -> bool:
        if self._named and isinstance(item, str):
            return item in self._modules
        return any(m is item for m in self._modules.values())

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, nn.Module) and "_unit" in self.__dict__:
            self._drop_caches()

    def add_module(self, name: str, module) -> None:
        super().add_module(name, module)
        if "_unit" in self.__dict__:
            self._drop_caches()

    def __delitem__(self, idx) -> None:
        if self._named:
            names = list(self._modules)
            for name in (names[idx] if isinstance(idx, slice) else [idx if isinstance(idx, str) else self._position(idx)]):
                delattr(self, name)
        else:
            super().__delitem__(idx)
        self._drop_caches()

    def _refuse_numbering(self, what: str) -> None:
        if self._named:
            raise TypeError(
                f"{type(self).__name__}.{what}: the branches are named (built from an nn.ModuleDict), and a "
                "position is a branch id; add or replace a branch by name: module['name'] = branch"
            )

    def insert(self, index: int, module) -> None:
        self._refuse_numbering("insert")
        super().insert(index, module)
        self._drop_caches()

    def append(self, module):
        self._refuse_numbering("append")
        return super().append(module)

    def extend(self, modules):
        self._refuse_numbering("extend")
        return super().extend(modules)

    def __repr__(self) -> str:
        if not self._named:
            return super().__repr__()
        lines = [f"({name}): {_indent(repr(m))}" for name, m in self._modules.items()]
        return f"{self._get_name()}(" + "".join(f"\n  {line}" for line in lines) + ("\n)" if lines else ")")


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")


# ----------------------------------------------------------------------------------------------
# Collectives (docs/design.md, "One collectives policy").


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
    """Raise ValueError for a branch that runs collectives: SyncBatchNorm, a DDP- or FSDP-wrapped
    module (an FSDP2 unit inside a branch gathers its parameters in its own forward), or DTensor
    parameters (tensor parallelism communicates in the forward). ``where`` names the branches in
    the message ("branches" or "branch")."""
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
