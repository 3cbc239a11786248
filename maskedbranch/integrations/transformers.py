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
layer. Like a MaskedBranch with an int gate, it ties the dropped layer's parameters (and its
other inputs that need a gradient: a decoder layer's encoder output) into the output in
distributed jobs, so that each gets a gradient on every rank (undefined under DDP, zeros under
FSDP2; maskedbranch/_decide.py), and before each optimizer step the gradients of parameters
that no rank used are set back to ``None`` (maskedbranch/unused_grads.py; what counts as used:
maskedbranch/integrations/_layerdrop.py): training equals the unpatched model under
``find_unused_parameters=True``, step for step.

Experts: the sparse MLPs whose experts are modules of their own (SwitchTransformers, NLLB-MoE)
get a :class:`maskedbranch.MaskedBranch` over the same experts and keys in place of their
``experts``, routing as HF's loop does (maskedbranch/integrations/_experts.py); an expert that no
token of a rank reached is a branch that did not run. Fused experts (one parameter for all, most
families) need nothing: the report says so.

FSDP2 (HF's "run every layer when sharded" check does not see ``fully_shard``): dropped layers'
parameters get zero gradients, so every rank reduces the same ones, with the unit around the
layers or on each layer (a dropped unit is entered for its collectives and computes nothing).
DeepSpeed ZeRO-3, where HF runs every layer, is refused while training.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from torch import nn

try:
    import transformers
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

from .. import _unit
from . import _experts, _spec_embed
from ._experts import RoutedExperts
from ._layerdrop import _HOOKED, LayerDropList, _enter, _holder, _leave
from ._transformers_rules import DENSE_EXPERTS, EXPERTS, FAMILIES, KINDS, REFUSED, RULES, ExpertsRule, Rule

__all__ = ["LayerDropList", "PatchReport", "ROUTED_EXPERTS", "SUPPORTED", "is_patched", "patch", "unpatch"]

SUPPORTED: Tuple[str, ...] = tuple(sorted(k.rsplit(".", 1)[1] for k in RULES))
ROUTED_EXPERTS: Tuple[str, ...] = tuple(sorted(k.rsplit(".", 1)[1] for k in EXPERTS))
"""The sparse-MLP classes whose experts :func:`patch` routes (their experts are modules of their own)."""


# ----------------------------------------------------------------------------------------------
# The closest supported families, for the errors.


def _model_type(model: nn.Module) -> str:
    """HF's model type ("gpt2", "flaubert", ...), else the class name in lower case."""
    found = getattr(getattr(model, "config", None), "model_type", None)
    return (found if isinstance(found, str) and found else type(model).__name__).lower().replace("-", "_")


def _kind_of(model: nn.Module, model_type: str) -> Optional[str]:
    """The key of KINDS the model is closest to, read from its main input and config."""
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if main in ("input_values", "input_features"):
        return "speech"
    if main == "past_values":
        return "time_series"
    if main == "pixel_values":
        return "vision"
    if main != "input_ids" or config is None:
        return None
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    try:  # a text encoder (BERT-like: has a masked-LM head) is closer to the seq2seq encoders
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked_lm
    except ImportError:  # pragma: no cover - a transformers without the mapping
        masked_lm = {}
    return "seq2seq" if model_type.replace("_", "-") in masked_lm or model_type in masked_lm else "decoder"


def _closest(model: nn.Module, n: int = 4) -> str:
    """A sentence naming at most ``n`` supported families close to ``model`` (those of its kind,
    a name like its model type first; then families of other kinds with a name like it), each
    with its owner classes, and where the full list is."""
    model_type = _model_type(model)
    kind = _kind_of(model, model_type)
    same = KINDS[kind][1] if kind is not None else ()
    order = [f for _, (_, families) in KINDS.items() for f in families]

    def similar(family: str) -> float:
        ratio = difflib.SequenceMatcher(None, model_type, family).ratio()
        return ratio if ratio >= 0.6 else 0.0  # below that, names share letters, not a lineage

    ranked = sorted(FAMILIES, key=lambda f: (-(similar(f) + (1.0 if f in same else 0.0)), order.index(f)))
    picked = [f for f in ranked if f in same or similar(f) > 0.0][:n] or ranked[:n]
    owners = {f: [k.rsplit(".", 1)[1] for k in RULES if k.split(".")[2] == f] for f in picked}
    names = ", ".join(f"{f} ({', '.join(owners[f])})" for f in picked)
    head = f"Supported families closest to {model_type}"
    head += f" ({KINDS[kind][0]}): " if kind is not None else ": "
    return (f"{head}{names}. All {len(SUPPORTED)} supported classes ({len(FAMILIES)} families) are listed "
            "in maskedbranch.integrations.transformers.SUPPORTED.")


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


def _experts_rule_of(module: nn.Module) -> Tuple[Optional[ExpertsRule], Optional[str]]:
    """(rule, None) for a sparse MLP whose experts this patch routes, (None, why) for one it
    cannot, (None, None) for any other module."""
    for base in type(module).__mro__:
        rule = EXPERTS.get(_key(base))
        if rule is None:
            continue
        container = getattr(module, "experts", None)
        why = None
        if type(module).forward is not base.forward:
            why = f"{_key(type(module))} subclasses {base.__qualname__} and overrides forward"
        elif container is None or _key(type(container)) != rule.container:
            why = f"{base.__qualname__} without its {rule.container.rsplit('.', 1)[1]} (an unsupported transformers version?)"
        else:
            why = _experts.check_forwards(module, container, rule.read_from)
        return (None, why + _ROUTE_THEM) if why else (rule, None)
    return None, None


_ROUTE_THEM = ("; route its experts with maskedbranch.MaskedBranch(self.experts) and an int64 gate per token "
               "(-1: no expert; an nn.ModuleDict keeps its keys), or a float [tokens, experts] gate for top-k")


def _needs_nothing(module: nn.Module) -> Optional[str]:
    """Why an expert layer trains under DDP without a change, or None."""
    for base in type(module).__mro__:
        why = DENSE_EXPERTS.get(_key(base))
        if why is not None:
            return why
    if _experts.fused(module):
        return "every expert's weights are in the same parameters, which every step uses whatever the routing"
    return None


def _sort_experts(name: str, module: nn.Module, report: "PatchReport", todo: list) -> None:
    """An expert layer goes to ``todo`` (its experts are routed), ``report.skipped`` (they cannot
    be) or ``report.needs_nothing``; a list of experts under a module that is none of these is
    skipped too."""
    rule, why = _experts_rule_of(module)
    if rule is not None:
        todo.append((name, module, rule))
    elif why is not None:
        report.skipped[name] = why
    elif _needs_nothing(module) is not None:
        report.needs_nothing[name] = f"{type(module).__qualname__}: {_needs_nothing(module)}"
    else:
        for child_name, child in module.named_children():
            if _experts.expert_list(child_name, child) and _needs_nothing(child) is None:
                report.skipped[f"{name}.{child_name}" if name else child_name] = (
                    f"{type(child).__name__} holds experts that {type(module).__name__}'s forward routes in a way "
                    "this patch does not know" + _ROUTE_THEM)


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
    """What :func:`patch` did: ``converted`` (module name -> LayerDrop owner class), ``experts``
    (module name -> sparse-MLP class whose experts it routes), ``already`` (names patched before),
    ``skipped`` (name -> why it applies LayerDrop or routes experts unpatched), ``tied`` (module
    name -> a parameter its forward leaves out of some steps, tied in when unread:
    maskedbranch/integrations/_spec_embed.py) and ``needs_nothing`` (module name -> why an expert
    layer trains under DDP as it is: fused or dense experts)."""

    converted: Dict[str, str] = field(default_factory=dict)
    already: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)
    tied: Dict[str, str] = field(default_factory=dict)
    experts: Dict[str, str] = field(default_factory=dict)
    needs_nothing: Dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"maskedbranch: LayerDrop converted in {len(self.converted)} module(s)"]
        lines += [f"  {name or '<root>'}: {cls}" for name, cls in self.converted.items()]
        if self.experts:
            lines.append(f"maskedbranch: experts routed in {len(self.experts)} module(s)")
            lines += [f"  {name}: {cls}" for name, cls in self.experts.items()]
        kinds: Dict[str, List[str]] = {}
        for name, why in self.needs_nothing.items():
            kinds.setdefault(why, []).append(name)
        lines += [f"  needs nothing ({len(names)} module(s), {names[0]}, ...): {why}" if len(names) > 1
                  else f"  needs nothing ({names[0]}): {why}" for why, names in kinds.items()]
        if self.already:
            lines.append(f"  {len(self.already)} module(s) were converted already")
        lines += [f"  skipped {name or '<root>'}: {why}" for name, why in self.skipped.items()]
        lines += [f"  tied when unread: {name or '<root>'}.{what}" for name, what in self.tied.items()]
        return "\n".join(lines)


def patch(model: nn.Module, *, strict: bool = True, materialize_grads: Optional[bool] = None) -> PatchReport:
    """Make the LayerDrop and the per-module experts of a transformers ``model`` skip what does
    not run and train under DDP with ``find_unused_parameters=False``, in place. Returns a
    :class:`PatchReport`.

    Call it after building or loading the model and before wrapping it (DDP, FSDP2, Trainer,
    Accelerate, Lightning). Parameters, ``state_dict`` keys, ``config``, ``save_pretrained``,
    eval outputs and ``generate`` are unchanged; in training, with the same seed, the outputs,
    gradients and random draws equal the unpatched model's.

    LayerDrop: each owner's ``layers`` becomes a :class:`LayerDropList`. Experts: the ``experts``
    of the sparse MLPs in :data:`ROUTED_EXPERTS` (SwitchTransformers, NLLB-MoE) become a
    :class:`maskedbranch.MaskedBranch` over the same expert modules and keys, routing as HF's
    loop does (maskedbranch/integrations/_experts.py). Expert layers with fused or dense experts
    (Mixtral, Qwen-MoE, ..., VitPose) need nothing and are listed in ``report.needs_nothing``.

    ``strict=True`` (default) refuses, before changing anything, a model with LayerDrop or a list
    of experts in a module this patch does not know (the error lists them, with the closest
    supported LayerDrop families or the routing module to use), and a model with nothing to
    convert and no expert layer. ``strict=False`` converts what it can and lists the rest in
    ``report.skipped`` (they keep HF's code).

    ``materialize_grads``: what a dropped layer's or an idle expert's parameters receive, as for
    :class:`maskedbranch.MaskedBranch`: ``None`` (default) is HF's if/else semantics in one
    process, undefined gradients under DDP, zeros under FSDP2; ``True`` / ``False`` force zeros /
    undefined gradients.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    materialize_grads = _unit.materialize(materialize_grads)
    report = PatchReport()
    todo: List[Tuple[str, nn.Module, Rule]] = []
    todo_experts: List[Tuple[str, nn.Module, ExpertsRule]] = []
    layerdrop_skipped = False
    for name, module in model.named_modules():
        layers_done = isinstance(getattr(module, "layers", None), LayerDropList)
        experts_done = isinstance(getattr(module, "experts", None), RoutedExperts)
        if layers_done or experts_done:
            report.already.append(name)
        if not layers_done:
            rule, why = _rule_of(module)
            if rule is not None:
                todo.append((name, module, rule))
            elif why is not None or _uses_layerdrop(type(module)):
                report.skipped[name] = why or f"{_key(type(module))} applies LayerDrop in a forward this patch does not know"
                layerdrop_skipped = True
        if not experts_done:
            _sort_experts(name, module, report, todo_experts)
    if strict and report.skipped:
        listing = "\n".join(f"  {n or '<root>'}: {w}" for n, w in report.skipped.items())
        closest = f"{_closest(model)}\n" if layerdrop_skipped else ""
        raise ValueError(
            f"maskedbranch.integrations.transformers.patch: these modules apply LayerDrop or route experts in a way "
            f"this patch does not know:\n{listing}\n{closest}Pass strict=False to convert the supported modules "
            "and leave these as they are."
        )
    if strict and not (todo or todo_experts or report.already or report.needs_nothing):
        raise ValueError(
            f"maskedbranch.integrations.transformers.patch: {type(model).__name__} has no module with "
            "LayerDrop that this patch knows (no module of it reads a LayerDrop probability: there is "
            f"nothing to convert), and no expert layer. {_closest(model)}"
        )
    for name, owner, rule in todo:
        where = f"{type(owner).__name__}.layers"
        owner.layers = LayerDropList(list(owner.layers), rule, where, materialize_grads)
        if not getattr(owner, _HOOKED, False):
            owner.register_forward_pre_hook(_enter)
            owner.register_forward_hook(_leave, always_call=True)
            setattr(owner, _HOOKED, True)
        report.converted[name] = type(owner).__qualname__
    for name, owner, experts_rule in todo_experts:
        owner.experts = _experts.ROUTED[experts_rule.routed](owner.experts, materialize_grads)
        report.experts[name] = type(owner).__qualname__
    for name, m in model.named_modules():
        if isinstance(m, (LayerDropList, RoutedExperts)):
            m.materialize_grads = materialize_grads
        if _spec_embed.patch_module(m, materialize_grads):
            report.tied[name] = _spec_embed.NAME
    return report


def unpatch(model: nn.Module) -> int:
    """Undo :func:`patch`: each LayerDrop owner gets a plain ``nn.ModuleList`` of the same layers
    back (its hooks stay, and do nothing), each sparse MLP HF's expert container holding the same
    experts. Returns how many owners."""
    n = 0
    for module in list(model.modules()):
        layers = getattr(module, "layers", None)
        if isinstance(layers, LayerDropList):
            module.layers = nn.ModuleList(list(layers._modules.values()))
            n += 1
        experts = getattr(module, "experts", None)
        if isinstance(experts, RoutedExperts):
            module.experts = experts.restore()
            n += 1
    return n


def is_patched(module: nn.Module) -> bool:
    """True for an owner converted by :func:`patch`."""
    return isinstance(module, nn.Module) and isinstance(getattr(module, "layers", None), LayerDropList)
