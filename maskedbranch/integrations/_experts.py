"""Mixture-of-experts layers of transformers whose experts are modules of their own
(SwitchTransformers, NLLB-MoE): the owner's ``experts`` (an ``nn.ModuleDict`` of ``expert_<i>``)
becomes a :class:`maskedbranch.MaskedBranch` over the same expert modules, under the same keys,
whose forward takes HF's arguments and routes as HF's loop does. The owner keeps its forward
(its router, the router's recorded logits for the z-loss and the auxiliary loss); only the
experts change, so ``state_dict`` keys and checkpoints do too.

An expert that no token of a rank reaches is then a branch that did not run: under DDP its
parameters are tied in by the wrapper and their gradients reset to ``None`` where no rank used
them (docs/design.md, section 2), as HF's model gets them with ``find_unused_parameters=True``.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import re
import textwrap
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ..nn import MaskedBranch

_EXPERT_KEY = re.compile(r"expert_\d+")


def fingerprint(fn: Callable) -> str:
    """A hash of ``fn``'s code without its docstring, comments and whitespace: the same for the
    same code on every Python version, another when a transformers release changes the code."""
    src = textwrap.dedent(inspect.getsource(fn))
    lines = src.splitlines()
    body = ast.parse(src).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        del lines[body[0].lineno - 1 : body[0].end_lineno]
    code = "".join(re.sub(r"\s+", "", line.split("#", 1)[0]) for line in lines)
    return hashlib.sha256(code.encode()).hexdigest()[:16]


class RoutedExperts(MaskedBranch):
    """HF's expert container as a MaskedBranch: its ``expert_<i>`` modules under their keys
    (branch i = ``expert_<i>``), HF's other settings as plain attributes. :meth:`restore` gives
    the container back (``unpatch``)."""

    def __init__(self, container: nn.Module, materialize_grads: Optional[bool] = None):
        experts = [(k, m) for k, m in container.named_children() if _EXPERT_KEY.fullmatch(k)]
        if [k for k, _ in experts] != [f"expert_{i}" for i in range(len(experts))]:
            raise ValueError(
                f"experts: expected {type(container).__name__} to hold expert_0 .. expert_<n-1> in order, "
                f"got {[k for k, _ in experts]}"
            )
        super().__init__(nn.ModuleDict(experts), materialize_grads=materialize_grads)
        self.num_experts = len(experts)
        self.__dict__["_container"] = container  # not a child: its other children (a dropout) hold no state

    def restore(self) -> nn.Module:
        """HF's container, holding this module's experts (replaced ones included)."""
        container = self.__dict__["_container"]
        for k, m in self._modules.items():
            container._modules[k] = m
        return container.train(self.training)


class RoutedSwitchExperts(RoutedExperts):
    """``SwitchTransformersExperts``: top-1 routing with HF's per-sequence capacity (decided by the
    router). A routed token gets ``expert(x) * p`` (``p``: its router probability), a token over
    capacity zeros, as HF's loop gives them. The experts run in the order HF's loop runs them, on
    the same rows, so their dropout draws HF's numbers."""

    def forward(self, hidden_states: Tensor, selected_experts: Tensor, routing_weights: Tensor) -> Tensor:
        chosen = selected_experts.reshape(hidden_states.shape[0], -1)  # [T, E]: one-hot, zeros over capacity
        ids = torch.where(chosen.any(-1), chosen.argmax(-1), -1)
        out = MaskedBranch.forward(self, hidden_states, ids)
        return (out * routing_weights).to(hidden_states.dtype)


class RoutedNllbMoeExperts(RoutedExperts):
    """``NllbMoeExperts`` as transformers 5 computes it (see the rule in
    maskedbranch/integrations/_transformers_rules.py): for each value c the top-1 mask takes, the
    (expert j, token t) pairs where ``router_mask[t, j] == c`` run ``expert_c``, weighted by
    ``router_probs[t, j]``, with the token dropout (training) or its scale (eval) per pair. Each
    expert is called through the routing with an int gate, on HF's rows, in HF's order: the same
    numbers and draws, and the experts that did not run are branches that did not run."""

    def __init__(self, container: nn.Module, materialize_grads: Optional[bool] = None):
        super().__init__(container, materialize_grads)
        self.moe_token_dropout = float(container.moe_token_dropout)

    def forward(self, hidden_states: Tensor, router_mask: Tensor, router_probs: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        p = self.moe_token_dropout
        for c in torch.unique(router_mask).tolist():  # ascending, as HF's loop over the hit values
            if not 0 <= c < len(self):
                raise ValueError(f"router_mask: values index the experts (0 .. {len(self) - 1}), got {c}")
            j, t = (router_mask == c).T.nonzero(as_tuple=True)  # expert-major, as HF's torch.where
            rows = hidden_states[None, t].reshape(-1, hidden_states.shape[-1])
            y = MaskedBranch.forward(self, rows, c) * router_probs[t, j, None]
            if p > 0:
                y = nn.functional.dropout(y, p, True) if self.training else y * (1 - p)
            out.index_add_(0, t, y.to(hidden_states.dtype))
        return out


ROUTED: Dict[str, type] = {cls.__name__: cls for cls in (RoutedSwitchExperts, RoutedNllbMoeExperts)}


# ----------------------------------------------------------------------------------------------
# What other expert layers need.


def fused(module: nn.Module) -> bool:
    """An expert layer that keeps every expert in the same parameters (HF's ``<Family>Experts``
    with 3-D weights, Mixtral's and most others'): each step uses them whatever the routing."""
    return (type(module).__name__.endswith("Experts") and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and next(module.parameters(), None) is not None)


def expert_list(name: str, module: nn.Module) -> bool:
    """A list or dict of expert modules that this patch does not route (by its attribute name)."""
    return ("expert" in name.rsplit(".", 1)[-1].lower() and isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and not isinstance(module, MaskedBranch) and len(module) > 1)


def check_forwards(owner: nn.Module, container: nn.Module, read_from: Tuple[str, str]) -> Optional[str]:
    """None when the owner's and the container's forwards are those the routed class was written
    from, else why not."""
    for cls, want in ((type(owner), read_from[0]), (type(container), read_from[1])):
        try:
            got = fingerprint(cls.forward)
        except (OSError, TypeError):
            got = None
        if got != want:
            return (f"{cls.__qualname__}.forward is not the one this patch reproduces (transformers 5.25's): "
                    "its routing could differ from HF's")
    return None
