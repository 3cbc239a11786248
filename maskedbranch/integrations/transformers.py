"""LayerDrop for Hugging Face transformers models that trains under DDP with
``find_unused_parameters=False``, and that skips a dropped layer's compute.

HF's LayerDrop (``if torch.rand([]) < layerdrop: skip the layer``) leaves a dropped layer's
parameters without a gradient on the ranks that dropped it, so DDP needs
``find_unused_parameters=True`` (a graph walk and a host synchronization every step).
:func:`patch` keeps HF's semantics and lets DDP run without it::

    from transformers import Wav2Vec2ForCTC
    from maskedbranch.integrations import transformers as mb_hf

    model = Wav2Vec2ForCTC.from_pretrained(..., layerdrop=0.1)
    mb_hf.patch(model)          # after loading, before DDP / FSDP2 / Trainer
    ddp = DistributedDataParallel(model, find_unused_parameters=False)

How: each module that applies LayerDrop (an *owner*: ``Wav2Vec2Encoder``, ``BartDecoder``, ...)
keeps its forward. Its ``layers`` list becomes a :class:`LayerDropList`, an ``nn.ModuleList``
subclass holding the same layer objects (same ``state_dict`` keys). While the owner runs in
training mode, HF's own probability reads 0 (restored afterwards, so ``config`` and
``save_pretrained`` are unchanged) and iterating the list draws for each layer exactly what HF
would have drawn, in the same place (maskedbranch/integrations/_transformers_rules.py). A kept
layer is the layer itself, called by HF's loop as before; a dropped one is a stand-in that returns
what the loop needs for a skipped layer (the hidden states it was given) and never runs the
layer. Like a MaskedBranch with an int gate, it ties the dropped layer's parameters into the
output in distributed jobs, so that each gets a gradient on every rank (undefined under DDP,
zeros under FSDP2; maskedbranch/_dead_grads.py), and before each optimizer step the gradients of
layers that no rank ran are set back to ``None`` (maskedbranch/unused_grads.py): training equals
the unpatched model under ``find_unused_parameters=True``, step for step.

FSDP2 (HF's "run every layer when sharded" check does not see ``fully_shard``): dropped layers'
parameters get zero gradients, so every rank reduces the same ones, with the unit around the
layers or on each layer (a dropped unit is entered for its collectives and computes nothing).
DeepSpeed ZeRO-3, where HF runs every layer, is refused while training.
"""
from __future__ import annotations

import inspect
import random
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

try:
    import transformers
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "maskedbranch.integrations.transformers needs transformers; install it with "
        f"`pip install transformers` (importing it failed: {e})"
    ) from e

if int(transformers.__version__.split(".")[0]) < 5:
    # Before 5.0 the layers return tuples that the loops index: the stand-ins would not fit.
    raise ImportError(
        "maskedbranch.integrations.transformers needs transformers >= 5 (its rules are read from "
        f"transformers 5's forwards), found {transformers.__version__}"
    )

from .. import _autograd, _dead_grads, _structure, unused_grads
from ._transformers_rules import FAMILIES, REFUSED, RULES, Rule

__all__ = ["LayerDropList", "PatchReport", "SUPPORTED", "is_patched", "patch", "unpatch"]

SUPPORTED: Tuple[str, ...] = tuple(sorted(k.rsplit(".", 1)[1] for k in RULES))

# ----------------------------------------------------------------------------------------------
# HF's own probability reads a neutral value while an owner runs. Owners that share a config
# (or threads running replicas of one model, as nn.DataParallel does) count their holds, so the
# value is restored once, by the last one out.

_lock = threading.Lock()
_held: Dict[Tuple[int, str], List[Any]] = {}  # (id(holder), name) -> [holds, real value]


def _holder(owner: nn.Module, source: str) -> Tuple[Any, str]:
    if source.startswith("config."):
        return owner.config, source[len("config."):]
    return owner, source


def _real(obj: Any, name: str) -> Any:
    with _lock:
        entry = _held.get((id(obj), name))
        return entry[1] if entry is not None else getattr(obj, name)


def _hold(obj: Any, name: str, neutral: float) -> None:
    with _lock:
        entry = _held.get((id(obj), name))
        if entry is None:
            entry = _held[(id(obj), name)] = [0, getattr(obj, name)]
            setattr(obj, name, neutral)
        entry[0] += 1


def _release(obj: Any, name: str) -> None:
    with _lock:
        entry = _held[(id(obj), name)]
        entry[0] -= 1
        if entry[0] == 0:
            del _held[(id(obj), name)]
            setattr(obj, name, entry[1])


# ----------------------------------------------------------------------------------------------
# The draws, as HF makes them.


def _peek(get, set_, draw):
    """The number ``draw()`` gives next, leaving the generator as it was: HF draws it itself."""
    state = get()
    value = draw()
    set_(state)
    return value


def _dropped(rule: Rule, p: float) -> bool:
    kind = rule.draw
    if kind == "torch":
        u = torch.rand([])
    elif kind == "torch-always":
        u = _peek(torch.get_rng_state, torch.set_rng_state, lambda: torch.rand([]))
    elif kind == "numpy-random":
        u = _peek(np.random.get_state, np.random.set_state, np.random.random)
    elif kind == "numpy-uniform":
        u = _peek(np.random.get_state, np.random.set_state, lambda: np.random.uniform(0, 1))
    else:  # python-uniform
        u = _peek(random.getstate, random.setstate, lambda: random.uniform(0, 1))
    return bool(u <= p) if rule.inclusive else bool(u < p)


def _fsdp_module_type() -> Optional[type]:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # only if the user imported FSDP
    t = getattr(fsdp, "FSDPModule", None)
    return t if isinstance(t, type) else None


# ----------------------------------------------------------------------------------------------
# The layer list.


class LayerDropList(_structure.InvalidatesOnApply, nn.ModuleList):
    """The ``layers`` of a patched owner: the same layer objects (``state_dict`` keys
    ``layers.0.weight``, indexing and ``len`` as before). Outside the owner's training forward,
    iterating yields the layers; inside, it draws LayerDrop as HF does and yields, for each
    dropped layer, a stand-in that does not run it."""

    def __init__(self, layers: Sequence[nn.Module] = (), rule: Rule = Rule(), where: str = "layers",
                 materialize_grads: Optional[bool] = None):
        super().__init__(layers)
        self.rule = rule
        self.where = where
        self.materialize_grads = materialize_grads
        self._p: Optional[float] = None  # the probability while the owner's training forward runs
        self._tables: Optional[List[_structure.Branches]] = None
        self._usage = unused_grads.Usage()
        unused_grads.register(self)

    # nn.ModuleList edits that register nothing must still refresh the cached structure.
    def __delitem__(self, idx) -> None:
        super().__delitem__(idx)
        _structure.invalidate()

    def insert(self, index: int, module: nn.Module) -> None:
        super().insert(index, module)
        _structure.invalidate()

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # a plain list of the layers, as nn.ModuleList gives
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)

    def _unit_modules(self) -> List[nn.Module]:
        return list(self._modules.values())

    def _units(self) -> List[Sequence[Tensor]]:
        return [tuple(m.parameters()) for m in self._modules.values()]

    def _table(self, i: int) -> _structure.Branches:
        tables = self._tables
        if tables is None or not _structure.current(tables[0]):
            layers = list(self._modules.values())
            fsdp = _fsdp_module_type()
            # A layer that is an FSDP2 unit is entered even when dropped (see _Dropped); its
            # inner modules are checked there, once its parameters are gathered.
            _structure.check_skippable([m for m in layers if fsdp is None or not isinstance(m, fsdp)], self.where)
            tables = self._tables = [_structure.Branches([m], _structure.version()) for m in layers]
        return tables[i]

    def __iter__(self):
        if self._p is None:
            return iter(self._modules.values())
        return self._draw(self._p)

    def _draw(self, p: float):
        rule = self.rule
        zeros = _dead_grads.tie_policy(self.materialize_grads, self.where)
        for i, layer in enumerate(list(self._modules.values())):
            if i >= rule.first and _dropped(rule, p):
                yield _Dropped(self, i, layer, zeros)
            else:
                if torch.is_grad_enabled():
                    self._usage.record(1 << i)
                yield layer

    def extra_repr(self) -> str:
        return f"LayerDrop of {self.where}" + ("" if self.materialize_grads is None else f", materialize_grads={self.materialize_grads}")

    def __setstate__(self, state) -> None:
        # copy.deepcopy and pickle: caches and usage start fresh, and the copy is registered
        super().__setstate__(state)
        self._p, self._tables = None, None
        self._usage = unused_grads.Usage()
        unused_grads.register(self)


def _dropped_output(rule: Rule, x: Tensor, kwargs: Dict[str, Any]) -> Any:
    """What HF's loop has after a dropped layer: the hidden states it had before."""
    if rule.out == "position_bias":
        return x, kwargs.get("position_bias")
    if rule.out == "trend":
        return x, 0  # the loop adds it to its trend
    return (x,) + (None,) * (rule.out - 1) if rule.out else x


class _Dropped:
    """Stands in for a dropped layer in HF's loop: called like the layer, it returns the hidden
    states it is given (with the layer's parameters tied in, when the job needs them to get a
    gradient) without running the layer."""

    __slots__ = ("owner", "index", "layer", "zeros")

    def __init__(self, owner: LayerDropList, index: int, layer: nn.Module, zeros: Optional[bool]):
        self.owner, self.index, self.layer, self.zeros = owner, index, layer, zeros

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        rule = owner.rule
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, Tensor):
            raise TypeError(f"{owner.where}[{self.index}]: expected the hidden states as the first argument, got {type(x).__name__}")
        if rule.attentions and kwargs.get("output_attentions"):
            raise ValueError(
                f"{owner.where}: output_attentions=True in training. HF's loop leaves a dropped layer out "
                "of the attention outputs, which the patched loop cannot do; ask for attentions in eval "
                "mode, or unpatch the model"
            )
        fsdp = _fsdp_module_type()
        if fsdp is not None and isinstance(self.layer, fsdp):
            return self._through_unit(args, kwargs)
        table = owner._table(self.index)
        if self.zeros is not None and torch.is_grad_enabled():
            tied = [p for p in table.tied(0) if p.requires_grad]
            if tied:
                x = _autograd.tie(x, tied, self.zeros)
        return _dropped_output(rule, x, kwargs)

    def _through_unit(self, args, kwargs) -> Any:
        """A dropped layer that is its own FSDP2 unit: every rank must gather and reduce its
        parameters, so the unit's hooks run around a forward that only ties them in (with zero
        gradients, which FSDP2 reduces). It takes the hidden states from its own arguments: the
        unit's hooks hand it tensors that lead its backward to the reduction."""
        layer, owner = self.layer, self.owner

        def forward(*args, **kwargs):
            _structure.check_skippable(list(layer.children()), f"{owner.where}[{self.index}]")
            x = args[0] if args else kwargs["hidden_states"]
            tied = [p for p in layer.parameters() if p.requires_grad]
            y = _autograd.tie(x, tied, True) if tied and torch.is_grad_enabled() else x
            return _dropped_output(owner.rule, y, kwargs)

        layer.forward = forward  # an instance attribute: nn.Module.__call__ runs it inside the hooks
        try:
            return nn.Module.__call__(layer, *args, **kwargs)
        finally:
            del layer.forward


# ----------------------------------------------------------------------------------------------
# The owner's hooks: module-level functions (copies and pickles of the model keep them), bound to
# the name of the owner's layer list.


def _enter(owner: nn.Module, args: Any) -> None:
    layers = getattr(owner, "layers", None)
    if not isinstance(layers, LayerDropList) or not owner.training or layers._p is not None:
        return
    obj, name = _holder(owner, layers.rule.source)
    p = float(_real(obj, name))
    if p <= 0.0:
        return
    if is_deepspeed_zero3_enabled():
        raise RuntimeError(
            f"{layers.where}: LayerDrop under DeepSpeed ZeRO-3, which gathers each layer's parameters in "
            "the layer's own forward: a layer dropped on one rank would leave the others waiting. HF runs "
            "every layer there; unpatch the model (maskedbranch.integrations.transformers.unpatch) to do so"
        )
    _hold(obj, name, layers.rule.neutral)
    layers._p = p


def _leave(owner: nn.Module, args: Any, output: Any) -> None:
    layers = getattr(owner, "layers", None)
    if isinstance(layers, LayerDropList) and layers._p is not None:
        layers._p = None
        _release(*_holder(owner, layers.rule.source))


_HOOKED = "_maskedbranch_layerdrop_hooks"  # set on an owner once its hooks are registered


# ----------------------------------------------------------------------------------------------
# patch / unpatch.


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _rule_of(module: nn.Module) -> Tuple[Optional[Rule], Optional[str]]:
    """(rule, None) for a supported owner, (None, why) for one that is refused, (None, None) for
    a module without LayerDrop. A subclass counts as its HF class when it keeps its forward."""
    for base in type(module).__mro__:
        key = _key(base)
        if key in RULES or key in REFUSED:
            if type(module).forward is not base.forward:
                return None, f"{_key(type(module))} subclasses {base.__qualname__} and overrides forward"
            if key in REFUSED:
                return None, REFUSED[key]
            rule = RULES[key]
            obj, name = _holder(module, rule.source) if hasattr(module, "config") else (module, rule.source)
            if not isinstance(getattr(module, "layers", None), nn.ModuleList) or not hasattr(obj, name):
                return None, f"{base.__qualname__} without `layers` or `{rule.source}` (an unsupported transformers version?)"
            return rule, None
    return None, None


_SOURCE_CACHE: Dict[type, bool] = {}


def _uses_layerdrop(cls: type) -> bool:
    """Whether the class's forward reads a LayerDrop probability (read from its source once)."""
    found = _SOURCE_CACHE.get(cls)
    if found is None:
        try:
            found = "layerdrop" in inspect.getsource(cls.forward)
        except (OSError, TypeError):
            found = False
        _SOURCE_CACHE[cls] = found
    return found


@dataclass
class PatchReport:
    """What :func:`patch` did: ``converted`` (module name -> owner class), ``already`` (names
    patched before) and ``skipped`` (name -> why it applies LayerDrop unpatched)."""

    converted: Dict[str, str] = field(default_factory=dict)
    already: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"maskedbranch: LayerDrop converted in {len(self.converted)} module(s)"]
        lines += [f"  {name or '<root>'}: {cls}" for name, cls in self.converted.items()]
        if self.already:
            lines.append(f"  {len(self.already)} module(s) were converted already")
        lines += [f"  skipped {name or '<root>'}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def patch(model: nn.Module, *, strict: bool = True, materialize_grads: Optional[bool] = None) -> PatchReport:
    """Make the LayerDrop of a transformers ``model`` skip dropped layers' compute and train under
    DDP with ``find_unused_parameters=False``, in place. Returns a :class:`PatchReport`.

    Call it after building or loading the model and before wrapping it (DDP, FSDP2, Trainer,
    Accelerate, Lightning). Parameters, ``state_dict`` keys, ``config``, ``save_pretrained``,
    eval outputs and ``generate`` are unchanged; in training, with the same seed, the outputs,
    gradients and random draws equal the unpatched model's.

    ``strict=True`` (default) refuses, before changing anything, a model with LayerDrop in a
    module this patch does not know (the error lists them and :data:`SUPPORTED`), and a model
    with no supported module. ``strict=False`` converts what it can and lists the rest in
    ``report.skipped`` (they keep HF's LayerDrop).

    ``materialize_grads``: what a dropped layer's parameters receive, as for
    :class:`maskedbranch.MaskedBranch`: ``None`` (default) is HF's if/else semantics in one
    process, undefined gradients under DDP, zeros under FSDP2; ``True`` / ``False`` force zeros /
    undefined gradients.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if materialize_grads is not None and not isinstance(materialize_grads, bool):
        raise TypeError(f"materialize_grads: expected None (automatic), True or False, got {type(materialize_grads).__name__}")
    report = PatchReport()
    todo: List[Tuple[str, nn.Module, Rule]] = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "layers", None), LayerDropList):
            report.already.append(name)
            continue
        rule, why = _rule_of(module)
        if rule is not None:
            todo.append((name, module, rule))
        elif why is not None or _uses_layerdrop(type(module)):
            report.skipped[name] = why or f"{_key(type(module))} applies LayerDrop in a forward this patch does not know"
    supported = f"Supported: {', '.join(SUPPORTED)} (the {', '.join(FAMILIES)} models)."
    if strict and report.skipped:
        listing = "\n".join(f"  {n or '<root>'}: {w}" for n, w in report.skipped.items())
        raise ValueError(
            f"maskedbranch.integrations.transformers.patch: these modules apply LayerDrop in a way this "
            f"patch does not know:\n{listing}\n{supported}\nPass strict=False to convert the supported "
            "modules and leave these as they are."
        )
    if strict and not todo and not report.already:
        raise ValueError(
            f"maskedbranch.integrations.transformers.patch: {type(model).__name__} has no module with "
            f"LayerDrop that this patch knows. {supported}"
        )
    for name, owner, rule in todo:
        where = f"{type(owner).__name__}.layers"
        owner.layers = LayerDropList(list(owner.layers), rule, where, materialize_grads)
        if not getattr(owner, _HOOKED, False):
            owner.register_forward_pre_hook(_enter)
            owner.register_forward_hook(_leave, always_call=True)
            setattr(owner, _HOOKED, True)
        report.converted[name] = type(owner).__qualname__
    for m in model.modules():
        if isinstance(m, LayerDropList):
            m.materialize_grads = materialize_grads
    return report


def unpatch(model: nn.Module) -> int:
    """Undo :func:`patch`: each owner gets a plain ``nn.ModuleList`` of the same layers back (its
    hooks stay, and do nothing). Returns how many owners."""
    n = 0
    for module in list(model.modules()):
        layers = getattr(module, "layers", None)
        if isinstance(layers, LayerDropList):
            module.layers = nn.ModuleList(list(layers._modules.values()))
            n += 1
    return n


def is_patched(module: nn.Module) -> bool:
    """True for an owner converted by :func:`patch`."""
    return isinstance(module, nn.Module) and isinstance(getattr(module, "layers", None), LayerDropList)
