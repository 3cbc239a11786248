"""The bytes a wiring reduces (maskedbranch/_wiring.py): one per parameter of the data-parallel
wrapper, in its ``named_parameters()`` order (the same on every rank), and the process group
they are reduced on.

Codes: 0 a parameter this rank knows no branch of (or outside any branch), 1 a branch's that did
not run, 2 one whose unit ran only conditionally (an encoder whose output only a decoder that
dropped every layer tied in: used only if its gradient turns out nonzero, which the step reads),
3 one that ran, 4 one the model outside the branches uses too (never reset). MAX is an OR that
gloo and NCCL both have, and a rank that has not seen a functional branch yet (0) cannot outvote
one that has.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

import torch.distributed as dist
from torch import Tensor, nn

from ._unit import RoutingUnit

OTHER, UNUSED, COND, USED, KEEP = 0, 1, 2, 3, 4
_MAX_CACHED_SETS = 1024  # sets of groups that ran, per unit, whose dead parameters are kept


class Layout:
    """The wrapper's parameters as bytes: names in ``named_parameters()`` order, each group's
    positions (``groups``: (unit, group index, positions)), and the base bytes (no group ran);
    and, per unit and set of groups that ran, the positions to mark and the parameters to tie
    (both cached per set: a forward costs a few lookups per unit)."""

    def __init__(self, root: nn.Module, units: List[RoutingUnit]):
        named = list(root.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        index = {n: k for k, n in enumerate(self.names)}
        position = {id(p): k for k, (_, p) in enumerate(named)}
        for n, p in root.named_parameters(remove_duplicate=False):
            position.setdefault(id(p), index.get(n, -1))
        self.base = bytearray(len(named))
        self.groups: List[Tuple[RoutingUnit, int, List[int]]] = []
        self.units = list(dict.fromkeys(units))
        self.unit_set = set(self.units)
        self.versions = [u.version for u in self.units]
        self._tensors: Dict[RoutingUnit, List[Tuple[Tensor, ...]]] = {}
        self._positions: Dict[RoutingUnit, List[List[int]]] = {}
        self._marks: Dict[RoutingUnit, Dict[Tuple[int, int], Tuple[Tuple[int, ...], Tuple[int, ...]]]] = {}
        self._dead: Dict[RoutingUnit, Dict[int, Tuple[Tensor, ...]]] = {}
        unit_modules, claimed, owners = set(), set(), {}
        for u in self.units:
            modules = u.group_modules()
            groups = [tuple(ps) for ps in u.groups()]
            self._tensors[u], self._marks[u], self._dead[u] = groups, {}, {}
            self._positions[u] = []
            for i, ps in enumerate(groups):
                ks = [position[id(p)] for p in ps if position.get(id(p), -1) >= 0]
                self.groups.append((u, i, ks))
                self._positions[u].append(ks)
                for k in ks:
                    self.base[k] = UNUSED
                if not modules:  # a group of bare parameters (its owner's other ones are not in it)
                    claimed.update(ks)
                for t in ps:
                    owners.setdefault(id(t), set()).add(u)
            unit_modules.update(id(m) for m in modules)
        for k in _outside(root, unit_modules, position):
            if self.base[k] == UNUSED and k not in claimed:
                self.base[k] = KEEP
        self.shared = any(len(us) > 1 for us in owners.values())  # a parameter in two units' groups
        grouped = sorted({k for _, _, ks in self.groups for k in ks})
        self.grouped = [(k, self.params[k]) for k in grouped]  # what the backward's start reads
        self.others = [k for k, b in enumerate(self.base) if b == OTHER]  # outside every group

    def current(self) -> bool:
        """No unit changed since the layout was made (maskedbranch/_unit.py, ``forget``)."""
        return all(u.version == v for u, v in zip(self.units, self.versions))

    def take(self) -> Tuple[bytearray, Dict[RoutingUnit, Tuple[int, int, bool]]]:
        """This rank's bytes for the forward that just ran, and what each unit ran (the units'
        records are cleared)."""
        out = bytearray(self.base)
        ran = {}
        for u in self.units:
            bits, cond, _ = ran[u] = u.take()
            if not bits and not cond:
                continue
            marks = self._marks[u]
            found = marks.get((bits, cond))
            if found is None:
                found = self._marked(u, bits, cond)
                if len(marks) < _MAX_CACHED_SETS:
                    marks[(bits, cond)] = found
            conds, used = found
            for k in conds:
                if out[k] < COND:
                    out[k] = COND
            for k in used:
                out[k] = USED
        return out, ran

    def _marked(self, u: RoutingUnit, bits: int, cond: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(positions that ran conditionally, positions that ran) of unit ``u``, never a
        position the model uses outside the groups (KEEP stays)."""
        groups = self._positions[u]
        used = tuple(k for i, ks in enumerate(groups) if bits >> i & 1 for k in ks if self.base[k] != KEEP)
        conds = tuple(k for i, ks in enumerate(groups) if cond >> i & 1 for k in ks if self.base[k] != KEEP)
        return conds, used

    def clear(self) -> None:
        """Forget what the units recorded (calls outside the wrapper's forward)."""
        for u in self.units:
            if u.bits or u.cond or u.held is not None or u.traced:
                u.take()

    def dead(self, ran: Dict[RoutingUnit, Tuple[int, int, bool]], wiring: Any, modes: tuple) -> List[Tensor]:
        """The parameters to tie at the wrapper for this forward: those of the groups that did
        not run, of the units called in it and decided for ``wiring`` in one of ``modes`` (less
        any that a group that ran shares; compiled units ran every branch in their graph). A unit
        the forward never called is not tied, as a module never called is not: its branches may
        have been called directly (``layer[k](x)``), which its record cannot see."""
        out: List[Tensor] = []
        for u in self.units:
            if u.wiring is not wiring or u.mode not in modes or u.traced:
                continue
            bits, cond, called = ran.get(u, (0, 0, False))
            if not called:
                continue
            live = bits | cond
            cache = self._dead[u]
            found = cache.get(live)
            if found is None:
                groups = self._tensors[u]
                used = {id(p) for i, ps in enumerate(groups) if live >> i & 1 for p in ps}
                found = tuple({id(p): p for i, ps in enumerate(groups) if not live >> i & 1
                               for p in ps if id(p) not in used and p.requires_grad}.values())
                if len(cache) < _MAX_CACHED_SETS:
                    cache[live] = found
            out.extend(found)
        if self.shared and out:  # a parameter of two units' groups once (nested routing modules)
            out = list({id(p): p for p in out}.values())
        return out


def _outside(root: nn.Module, unit_modules: set, position: Dict[int, int]) -> List[int]:
    """Positions of the parameters reached from ``root`` without entering a unit."""
    out, seen, stack = [], set(), [root]
    while stack:
        m = stack.pop()
        if id(m) in seen or id(m) in unit_modules:
            continue
        seen.add(id(m))
        out.extend(position.get(id(p), -1) for p in m.parameters(recurse=False))
        stack.extend(c for c in m.children())
    return [k for k in out if k >= 0]


cpu_groups: Dict[Any, Any] = {}


def cpu_group(group: Any) -> Any:
    """A gloo group over ``group``'s ranks for the usage bytes, made once per group (only its
    ranks take part: ``use_local_synchronization``), so that they never wait on a device, never
    interleave with the wrapper's own collectives, and a missing one fails loudly."""
    group = dist.group.WORLD if group is None else group
    found = cpu_groups.get(group)
    if found is None:
        backend = str(dist.get_backend(group)).lower()
        if backend == "gloo":
            found = group
        else:
            found = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        cpu_groups[group] = found
    return found


def mesh_group(wrapper: Any) -> Any:
    """The process group of a model sharded on a 1-D device mesh (FSDP2), else None."""
    p = next(wrapper.parameters(), None) if isinstance(wrapper, nn.Module) else None
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and getattr(mesh, "ndim", 0) == 1:
        return mesh.get_group()
    return None


def tensors(output: Any) -> List[Tensor]:
    """The tensors of a module's output (tensors, tuples, lists, dicts, HF ModelOutputs)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in tensors(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in tensors(v)]
    return []
