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

OTHER, UNUSED, COND, USED, KEEP = 0, 1, 2, 3, 4


class Layout:
    """The wrapper's parameters as bytes: names in ``named_parameters()`` order, each unit's
    positions, and the base bytes (no unit ran)."""

    def __init__(self, root: nn.Module, units_of: List[Any]):
        named = list(root.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        index = {n: k for k, n in enumerate(self.names)}
        position = {id(p): k for k, (_, p) in enumerate(named)}
        for n, p in root.named_parameters(remove_duplicate=False):
            position.setdefault(id(p), index.get(n, -1))
        self.base = bytearray(len(named))
        self.units: List[Tuple[Any, int, List[int]]] = []
        unit_modules, claimed = set(), set()
        for m in units_of:
            modules = m._unit_modules()
            for i, ps in enumerate(m._units()):
                ks = [position[id(p)] for p in ps if position.get(id(p), -1) >= 0]
                self.units.append((m, i, ks))
                for k in ks:
                    self.base[k] = UNUSED
                if not modules:  # a unit of bare parameters (its owner's other ones are not in it)
                    claimed.update(ks)
            unit_modules.update(id(u) for u in modules)
        for k in _outside(root, unit_modules, position):
            if self.base[k] == UNUSED and k not in claimed:
                self.base[k] = KEEP
        self.modules = list(dict.fromkeys(m for m, _, _ in self.units))

    def take(self) -> bytearray:
        """This rank's bytes for the forward that just ran (and the modules' records cleared)."""
        out = bytearray(self.base)
        ran = {id(m): m._usage.take() for m in self.modules}
        for m, i, ks in self.units:
            bits, cond = ran[id(m)]
            mark = USED if bits >> i & 1 else COND if cond >> i & 1 else 0
            if mark:
                for k in ks:
                    if UNUSED <= out[k] < mark:
                        out[k] = mark
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
