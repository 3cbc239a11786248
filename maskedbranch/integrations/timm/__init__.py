"""Stochastic depth that skips the dropped samples' compute, for timm models.

timm's ``DropPath`` multiplies a residual branch's output by a per-sample 0/1 mask: every sample
pays for the branch, dropped or not. :func:`patch` converts a model's residual blocks so that
each branch runs on the kept samples only (through :func:`maskedbranch.drop_add_residual`)::

    import timm
    from maskedbranch.integrations import timm as mb_timm

    model = timm.create_model("convnext_tiny", drop_path_rate=0.4)
    print(mb_timm.patch(model))   # before DDP / FSDP / torch.compile

How it works, and why this way. Every block that calls a drop-path module is traced with
torch.fx (its own ``forward`` only, every submodule a leaf). In the graph, a residual is
``add(base, tail(drop_path(y)))``: its branch is ``y`` with every node computed only for ``y``,
and ``tail`` a chain that commutes with a per-sample scale (layer scale, a product with a
parameter, permutes and reshapes keeping the batch first). Each such add becomes one
:func:`maskedbranch.drop_add_residual` call whose branch runs on the kept samples; any other use
of ``drop_path(y)`` (a block without a shortcut, an activation after it) becomes the branch's
output on the kept samples with zeros elsewhere. The rest of the forward is timm's code,
regenerated from the graph. A generic rewrite rather than a table of block shapes, because
timm's blocks agree on that pattern and on little else (pre/post norms, layer scale before or
after the drop path, projecting shortcuts, ``B, H, W, C = x.shape`` with window padding,
activations after the add, tuple outputs, several residuals nested): in timm 1.0.31, 78 block
classes own a ``DropPath`` in 76 models surveyed; plain symbolic tracing traced 77 of them (not
TinyViT's, whose forward branches on the input's height), and ``patch(model, strict=False)``
converts every one of the 76 models but ResNeSt, which drops the block *input*. Blocks whose
Python reads input shapes are traced at the first training call with concrete per-sample sizes
(maskedbranch/integrations/timm/_trace.py: meta-tensor twins whose batch size stays a graph
value). A table would need an entry per class and would go stale with every timm release; the
families the tests compare with timm are :data:`TESTED_FAMILIES`.

What changes and what does not:

* A converted block is the same object with a subclass of its class (``isinstance`` holds, the
  ``state_dict`` keys and parameters are untouched, timm's ``forward`` is inherited unchanged);
  only ``__call__`` differs. :func:`unpatch` restores the class.
* Eval mode, ``drop_prob == 0``, symbolic tracing (``torch.fx``, torchvision's and timm's fx
  feature extraction), ``torch.jit.script`` / ``torch.jit.trace`` and ``torch.export``: timm's own
  forward runs, so the results, graphs and scripted code are timm's (the dense formula).
* Training: each mask is drawn as timm draws it (per sample, Bernoulli(1 - drop_prob) from
  torch's default CPU generator, scaled by ``1 / keep_prob`` when ``scale_by_keep``), in the same
  order, so with the same seed outputs and gradients equal timm's up to rounding. Exceptions: on
  a GPU timm draws from the CUDA generator (maskedbranch always from the CPU one: no device
  synchronization); a branch that draws random numbers itself (dropout inside it) interleaves
  its draws with the masks differently and draws only for the kept samples.
* A branch no sample keeps does not run; its parameters get zero gradients, as timm's dense
  formula gives them (``materialize_grads=False``: undefined gradients instead).
* The drop probability, ``training`` flag and ``scale_by_keep`` are read from the block's
  drop-path module on every call (schedules work); a ``maskedbranch.DropPath`` there is honoured
  too (its ``mode`` and ``generator``).
* Branches must treat samples independently. A branch holding a BatchNorm that uses batch
  statistics (training mode) cannot: its statistics would come from the kept samples only. By
  default (``batch_norm="dense"``) such a branch runs on every sample as in timm (exact, no
  saving) while its BatchNorm trains, and is routed once the BatchNorm is frozen (eval mode or
  ``FrozenBatchNorm2d``). ``batch_norm="kept"`` routes it anyway: the BatchNorm normalizes over
  the kept samples (and updates its running statistics from them), a different computation.
* The rewrite of a block is traced per input signature (shapes past the batch, dtypes, the values of
  non-tensor arguments, the block's plain attributes): the first training call with a new one
  costs a trace (milliseconds). Attributes of submodules that the block's forward reads in Python
  are fixed at that trace: :func:`unpatch` and patch again after changing them.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Tuple

import torch
from torch import fx, nn

try:
    import timm  # noqa: F401
    from timm.layers import DropPath as _TimmDropPath  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without timm
    raise ImportError(
        "maskedbranch.integrations.timm needs timm; install it with `pip install \"maskedbranch[timm]\"` "
        f"(importing timm failed: {e})"
    ) from e

from ... import _unit
from .._report import BlockPatchReport, display
from . import _blocks, _graph, _trace

__all__ = ["PatchReport", "TESTED_FAMILIES", "patch", "unpatch", "is_patched"]

#: timm model files whose blocks the tests compare with timm (keys, eval, training with the same
#: masks, gradients, fx tracing). Blocks of other files are converted when they match the pattern.
TESTED_FAMILIES: Tuple[str, ...] = (
    "vision_transformer", "deit", "convnext", "swin_transformer", "swin_transformer_v2", "resnet",
    "efficientnet", "mobilenetv3", "eva", "cait", "maxxvit", "metaformer", "efficientformer", "hiera",
    "byobnet", "edgenext", "tiny_vit", "pvt_v2", "beit", "mvitv2", "focalnet", "fastvit",
)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class PatchReport(BlockPatchReport):
    """What :func:`patch` did (the fields: :class:`~maskedbranch.integrations._report.BlockPatchReport`;
    ``notes``: a BatchNorm in a branch, a rewrite traced at the first call)."""

    library = "timm"



def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _owners(model: nn.Module) -> Dict[str, List[str]]:
    """Module name -> paths (relative to it) of the drop-path modules it owns: those whose
    nearest ancestor that is not a container is this module."""
    modules = dict(model.named_modules(remove_duplicate=False))
    found: Dict[str, List[str]] = {}
    for name, m in modules.items():
        if not _blocks.is_drop_path(m) and not isinstance(m, _TimmDropPath):
            continue
        parts = name.split(".") if name else []
        owner = ""
        for k in range(len(parts) - 1, -1, -1):
            candidate = ".".join(parts[:k])
            if not isinstance(modules[candidate], _CONTAINERS):
                owner = candidate
                break
        found.setdefault(owner, []).append(name[len(owner) + 1:] if owner else name)
    return found


def _structural_inputs(block: nn.Module) -> List[Tuple[str, object]]:
    names, defaults, _ = _blocks.signature(type(block))
    empty = inspect.Parameter.empty
    return [(n, _trace.TENSOR if d is empty or isinstance(d, torch.Tensor) else d) for n, d in zip(names, defaults)]


def _examine(block: nn.Module, owned: List[str]) -> Tuple[List[str], Dict[str, str], str]:
    """(drop-path paths it converts, {path: why not}, note) for one block, from a structural
    trace in training mode."""
    if _blocks.signature(type(block)) is None:
        return [], {p: "the block's forward takes *args / **kwargs" for p in owned}, ""
    if not all(_blocks.is_drop_path(block.get_submodule(p)) for p in owned):
        odd = [p for p in owned if not _blocks.is_drop_path(block.get_submodule(p))]
        return [], {p: f"{type(block.get_submodule(p)).__name__} overrides DropPath.forward" for p in odd}, ""
    was = block.training
    block.training = True
    try:
        graph, _ = _trace.trace(block, _structural_inputs(block), None)
    except Exception as e:  # noqa: BLE001 - reported to the user
        if isinstance(e, fx.proxy.TraceError) or "symbolic tracing" in str(e):
            # Python control flow on a shape (or len()): traceable once shapes are known
            return list(owned), {}, "its forward reads input shapes: checked and traced at the first training call"
        reason = f"its forward cannot be traced by torch.fx ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
        return [], {p: reason for p in owned}, ""
    finally:
        block.training = was
    slots, problems, dense = _graph.analyze(block, graph, _blocks.is_drop_path)
    called = {s.dp for s in slots} | set(problems) | set(dense)
    leaves = [n.target for n in graph.nodes if n.op == "call_module"]
    for p in owned:
        if p in called:
            continue
        inside = next((m for m in leaves if p.startswith(m + ".")), None)
        if inside is not None:  # applied inside a child the block calls (e.g. an nn.Sequential)
            problems[p] = f"it is applied inside {inside}, not by a residual add in this block's forward"
    notes = [f"{p} {why}" for p, why in dense.items()]
    bns = [m for s in slots for m in s.modules if any(_blocks.batch_stats_type(x) for x in block.get_submodule(m).modules())]
    if bns:
        notes.append(f"BatchNorm in a branch ({', '.join(sorted(set(bns)))}): see patch(batch_norm=...)")
    return [s.dp for s in slots], problems, "; ".join(notes)


def patch(model: nn.Module, *, strict: bool = True, materialize_grads: Any = True, batch_norm: str = "dense") -> PatchReport:
    """Convert the residual blocks of a timm ``model``, in place, so that drop path (stochastic
    depth) runs each residual branch on the kept samples only. Returns a :class:`PatchReport`.

    Call it after building (and loading) the model and before wrapping it in DDP / FSDP or
    ``torch.compile``. The ``state_dict`` keys and the parameters are unchanged.

    ``strict=True`` (default) refuses, before changing anything, a model with a drop path this
    patch cannot convert (the error lists each with the reason, and :data:`TESTED_FAMILIES`) and a
    model without any drop path. ``strict=False`` converts what it can, leaves the rest to timm
    (correct, paying the full compute of dropped samples) and lists it in ``report.skipped``.

    ``materialize_grads``: the parameters of a branch that no sample keeps get zero gradients
    (``"zeros"`` / ``True``, timm's values) or none from the routing (``"none"`` / ``False``).
    ``batch_norm``: ``"dense"`` (default) or ``"kept"``: how a branch holding a BatchNorm that
    uses batch statistics runs (module docstring). Calling ``patch`` again updates both options
    on blocks converted before.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if batch_norm not in ("dense", "kept"):
        raise ValueError(f"batch_norm: expected 'dense' (timm's statistics) or 'kept', got {batch_norm!r}")
    materialize_grads = _unit.materialize(materialize_grads, allow_auto=False)
    report = PatchReport()
    todo: List[Tuple[str, nn.Module, List[str]]] = []
    for name, owned in _owners(model).items():
        block = model.get_submodule(name)
        if _blocks.is_patched_class(type(block)):
            report.already.append(display(name))
            continue
        convertible, problems, note = _examine(block, owned)
        if problems:
            why = "; ".join(f"{p}: {w}" for p, w in problems.items())
            report.skipped[display(name)] = f"{_qualname(type(block))}: {why}"
        if convertible:
            todo.append((name, block, convertible))
            if note:
                report.notes[display(name)] = note
    if strict and report.skipped:
        listing = "\n".join(f"  {n}: {w}" for n, w in report.skipped.items())
        raise ValueError(
            "maskedbranch.integrations.timm.patch: these drop paths cannot be converted:\n"
            f"{listing}\nConverted: residuals add(x, tail(drop_path(branch(x)))) in a block's own forward "
            f"(tested with timm's {', '.join(TESTED_FAMILIES)}). Pass strict=False to convert the others "
            "and leave these to timm."
        )
    if strict and not todo and not report.already:
        if type(model).__module__.startswith("torchvision."):
            raise ValueError(
                f"maskedbranch.integrations.timm.patch: {type(model).__name__} is a torchvision model (its "
                "StochasticDepth is not timm's DropPath): use maskedbranch.integrations.torchvision.patch"
            )
        raise ValueError(
            f"maskedbranch.integrations.timm.patch: {type(model).__name__} has no drop-path residual to "
            f"convert (build it with drop_path_rate > 0; tested families: {', '.join(TESTED_FAMILIES)})"
        )
    for name, block, slots in todo:
        original = type(block)
        block.__class__ = _blocks.patched_class(original)
        block.__dict__[_blocks.STATE] = _blocks.BlockState(name, slots, materialize_grads, batch_norm)
        _unit.note_module(block)
        report.converted[display(name)] = original.__qualname__
    for m in model.modules():
        state = m.__dict__.get(_blocks.STATE)
        if state is not None:
            state.materialize, state.batch_norm = materialize_grads, batch_norm
            if state.unit is not None:
                state.unit.materialize = materialize_grads
                state.unit.forget()
    return report


def unpatch(model: nn.Module) -> int:
    """Undo :func:`patch`: give every converted block its timm class back. Returns how many."""
    n = 0
    for module in model.modules():
        if _blocks.is_patched_class(type(module)):
            module.__class__ = _blocks.original_class(type(module))
            module.__dict__.pop(_blocks.STATE, None)
            n += 1
    return n


def is_patched(module: nn.Module) -> bool:
    """True for a block converted by :func:`patch`, and for a model holding one."""
    return isinstance(module, nn.Module) and any(_blocks.is_patched_class(type(m)) for m in module.modules())
