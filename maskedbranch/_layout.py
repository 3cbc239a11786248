"""What a reducer (maskedbranch/_reducer.py) reduces and over which process group: bit sets over
the wrapper's parameter *positions* (Python ints, bit k: parameter k), a forward's *used* and
*conditional* sets travelling as ``2 * ceil(n / 8)`` bytes, OR-reduced on a CPU group. The loops
over parameters run in C++ on the layout's ``table`` (csrc/parameters.cpp). Words:
docs/design.md, "Words"."""
from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _ops
from ._structure import Branches
from ._unit import RoutingUnit

_MAX_CACHED_SETS = 1024  # sets of groups that ran, per unit, whose bits are kept


_BYTE_BITS = [tuple(j for j in range(8) if b >> j & 1) for b in range(256)]


def positions(bits: int) -> List[int]:
    """The set positions of a bit set, ascending (a byte at a time)."""
    out: List[int] = []
    if bits:
        for i, b in enumerate(bits.to_bytes((bits.bit_length() + 7) // 8, "little")):
            if b:
                base = 8 * i
                out.extend(base + j for j in _BYTE_BITS[b])
    return out


def as_bytes(bits: int, nbytes: int) -> Tensor:
    """A bit set as the little-endian bytes the C++ table reads (a uint8 CPU tensor)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(bits.to_bytes(nbytes, "little")), dtype=torch.uint8)


def from_bytes(t: Tensor) -> int:
    # (not t.numpy(): torch runs without NumPy installed, and so must the reducer)
    return int.from_bytes(bytes(t.tolist()), "little")


class Layout:
    """The wrapper's parameters in ``named_parameters()`` order (``root`` None: those of the units'
    groups, for units that no wrapper runs), each group's positions, the grouped, shared, owned
    and other positions; per unit and set of groups that ran, the used / conditional bits and
    (in the unit's branch table, maskedbranch/_structure.py) the parameters to tie, cached."""

    def __init__(self, root: Optional[nn.Module], units: List[RoutingUnit], owned_names: frozenset = frozenset(),
                 kept_name: Optional[str] = None):
        if root is None:  # units that no wrapper runs: their groups' parameters, each once
            named = list({id(p): (f"{u.where}.{i}.{j}", p) for u in units
                          for i, ps in enumerate(u.groups()) for j, p in enumerate(ps)}.values())
        else:
            named = list(root.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.size = len(named)
        self.nbytes = (self.size + 7) // 8
        # by position, the tensor whose gradient a step reads (an optimizer may hold another
        # object than the wrapper's: FSDP2's sharded parameter; the reducer sets it)
        self.table = _ops.parameter_table(self.params)
        index = {n: k for k, n in enumerate(self.names)}
        position = {id(p): k for k, (_, p) in enumerate(named)}
        for n, p in () if root is None else root.named_parameters(remove_duplicate=False):
            position.setdefault(id(p), index.get(n, -1))
        self.groups: List[Tuple[RoutingUnit, int, List[int]]] = []
        self.units = list(dict.fromkeys(units))
        self.unit_set = set(self.units)
        self.versions = [u.version for u in self.units]
        # Without Sites: the tables live as long as the layout, which is made again when a
        # unit changes (its version, current()), as the wrapper's own parameter list is.
        self._tables: Dict[RoutingUnit, Branches] = {}
        self._positions: Dict[RoutingUnit, List[int]] = {}  # per group, its bits
        self._entries: Dict[RoutingUnit, Dict[Tuple[int, int], Tuple[int, int]]] = {}
        grouped, claimed, unit_modules = 0, 0, set()
        for u in self.units:
            modules = u.group_modules()
            groups = [tuple(ps) for ps in u.groups()]
            self._tables[u], self._entries[u] = Branches(groups, params=groups), {}
            self._positions[u] = []
            for i, ps in enumerate(groups):
                ks = [position[id(p)] for p in ps if position.get(id(p), -1) >= 0]
                self.groups.append((u, i, ks))
                bits = sum(1 << k for k in set(ks))
                self._positions[u].append(bits)
                grouped |= bits
                if not modules:  # a group of bare parameters (its owner's other ones are not in it)
                    claimed |= bits
            unit_modules.update(id(m) for m in modules)
        outside = 0 if root is None else sum(1 << k for k in set(_outside(root, unit_modules, position)))
        self.grouped = grouped
        self.shared = grouped & outside & ~claimed  # also used outside every group: never reset
        self.resettable = grouped & ~self.shared
        self.grouped_bytes = as_bytes(grouped, self.nbytes)  # what the backward's start reads
        self.others = [k for k in range(self.size) if not grouped >> k & 1]  # outside every group
        # Owned: left out of the DDP module's buckets (owned_names, fixed when it was built); one
        # bit set per dtype and device, as they are averaged; units whose groups hold only owned
        # and frozen parameters are never tied.
        self.owned = sum(1 << k for k, n in enumerate(self.names) if n in owned_names) & self.resettable
        by_kind: Dict[Tuple[Any, Any], int] = {}
        for k in positions(self.owned):
            kind = (self.params[k].device, self.params[k].dtype)
            by_kind[kind] = by_kind.get(kind, 0) | 1 << k
        self.owned_sets = list(by_kind.values())
        self.owned_bytes = as_bytes(self.owned, self.nbytes)
        self.unit_bits = {u: functools.reduce(operator.or_, self._positions[u], 0) for u in self.units}
        # (a DDP module holding routed parameters only keeps one of them: tied into every forward)
        kept = [k for k, n in enumerate(self.names) if n == kept_name]
        self.always_tied = [self.params[k] for k in kept]
        tieless = self.owned | sum(1 << k for k in kept) | sum(1 << k for k, p in enumerate(self.params) if not p.requires_grad)
        self.untied = {u for u in self.units if not self.unit_bits[u] & ~tieless}
        # Per unit, the units inside one of its groups (a MaskedBranch in a LayerDrop layer) with
        # their positions: when such a unit is called, it decides for its parameters.
        self.nested: Dict[RoutingUnit, List[Tuple[RoutingUnit, int]]] = {}
        for u in self.units:
            inside = {id(m) for gm in u.group_modules() for m in gm.modules()}
            self.nested[u] = [(v, self.unit_bits[v]) for v in self.units if v is not u and id(v.owner()) in inside]

    def current(self) -> bool:
        """No unit changed since the layout was made (``RoutingUnit.forget``)."""
        return all(u.version == v for u, v in zip(self.units, self.versions))

    def take(self, reducer: Any, tyings: tuple, keep_records: bool = False) -> Tuple[int, int, List[Tensor], int]:
        """What the forward that just ran on this rank used: (used bits, conditional bits, the
        parameters to tie into the wrapper's outputs, *held*: positions of units whose compiled
        graph held every branch or that were tied, whose dead groups may get zero gradients).
        Clears the units' records unless ``keep_records`` (the doctor reads them afterwards).

        Tied: per unit called in the forward and decided for ``reducer`` in one of ``tyings``, the
        parameters of its groups that did not run, less those a group that ran shares; none where
        a compiled graph held every branch. A unit never called is not tied, as a module never
        called is not: its branches may have been called directly (``layer[k](x)``)."""
        records = {}
        for u in self.units:
            inlined = u.inlined  # (taking clears it)
            if keep_records:
                u.settle_held()
                records[u] = (u.bits, u.cond & ~u.bits, u.called or bool(u.bits or u.cond), inlined)
            else:
                records[u] = (*u.take(), inlined)
        used = cond = held = 0
        dead: List[Tensor] = []
        for u in self.units:
            bits, c, called, inlined = records[u]
            if u.zeros and not inlined:  # (a compiled call that ran no group does not count as called)
                held |= self.unit_bits[u]
            if not called:
                continue
            entries = self._entries[u]
            entry = entries.get((bits, c))
            if entry is None:
                entry = self._entry(u, bits, c)
                if len(entries) < _MAX_CACHED_SETS:
                    entries[(bits, c)] = entry
            inner = 0  # positions that a unit inside this one's groups, called too, decides
            for v, at in self.nested[u]:
                if records[v][2]:
                    inner |= at
            used |= entry[0] & ~inner
            cond |= entry[1] & ~inner
            if u.reducer is reducer and u.tying in tyings and (inlined or not u.zeros) and u not in self.untied:
                # (a frozen parameter among them gets no edge: the tie's node skips it; an owned
                # one gets zeros under static_graph, so its positions count as held)
                # (a parameter in two nested units' dead groups is listed twice: still one hook call)
                dead.extend(self._tables[u].tied(bits | c))  # type: ignore[arg-type]
                held |= self.unit_bits[u]
        return used & self.resettable, cond & self.resettable & ~used, dead, held

    def _entry(self, u: RoutingUnit, bits: int, cond: int) -> Tuple[int, int]:
        positions = self._positions[u]
        return (sum(b for i, b in enumerate(positions) if bits >> i & 1),
                sum(b for i, b in enumerate(positions) if cond >> i & 1))

    def clear(self) -> None:
        """Forget what the units recorded (calls outside the wrapper's forward)."""
        for u in self.units:
            if u.bits or u.cond or u.called or u.held is not None or u.zeros or u.inlined:
                u.clear()


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


# Weak keys: a group's own gloo group lives exactly as long as the group, so that neither it
# nor gloo's threads outlive destroy_process_group into the interpreter's teardown, where they
# can hang or abort a job that has finished.
cpu_groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def cpu_group(group: Any) -> Any:
    """A gloo group of its own over ``group``'s ranks for the usage bits (made once, by those ranks
    only), which never waits on a device nor queues behind the wrapper's collectives (on the
    wrapper's own gloo group the launch would wait for them). None for a group of one rank: its
    bits are the answer, and a launch would cost a wake-up of gloo's thread (50-120 us)."""
    group = dist.group.WORLD if group is None else group
    found = cpu_groups.get(group, False)
    if found is False:
        ranks = dist.get_process_group_ranks(group)
        found = None if len(ranks) == 1 else dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
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
