"""The library entry points: simulate DDP ranks in this process, sort the parameters into
findings (report.py) and group them by module.

The routing (the modules MaskedBranch and ResidualDropPath, the functional masked_branch and
drop_add_residual, the patched timm and transformers models) ties the parameters of skipped
branches into the graph in a DDP job, not in one process: the ranks run under
``as_if_under_ddp`` so that the graph is the one DDP would see. Forward pre-hooks count each
routing module's calls; the branches that ran are the bits each routing unit records for the
step-time reset (maskedbranch/unused_grads.py). Together they tell a branch that no rank
sampled from a parameter that nothing uses. Routing in plain Python (if/else, a loop over the
experts a router hit) is named as such where the model shows it: siblings that diverge, experts,
a Hugging Face LayerDrop stack.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import _functional, _reducer, _structure, _unit
from ..integrations._transformers_rules import RULES as _HF_LAYERDROP
from ..nn import MaskedBranch
from ..residual import ResidualDropPath
from . import report as R
from . import simulate
from .rank import Inputs, RankError, restore_buffers, run_rank, snapshot_buffers

_ROUTERS = (MaskedBranch, ResidualDropPath)


def find_unused_parameters(
    model: nn.Module, *args: Any, loss_fn: Optional[Callable[[Any], Tensor]] = None, **kwargs: Any
) -> R.Report:
    """Run ``model(*args, **kwargs)`` once in training mode and the backward of the loss
    (``loss_fn(output)``, else the sum of the floating tensors in the output); report the trainable
    parameters out of the autograd graph (``report.unused``). For routing that differs between
    ranks, use :func:`find_divergent_parameters`."""
    return find_divergent_parameters(model, [Inputs(*args, **kwargs)], loss_fn=loss_fn, seed=None)


def find_divergent_parameters(
    model: nn.Module,
    inputs_per_rank: Sequence[Any],
    *,
    loss_fn: Optional[Callable[[Any], Tensor]] = None,
    seed: Optional[int] = 0,
    train: bool = True,
) -> R.Report:
    """Simulate one DDP iteration on ``len(inputs_per_rank)`` ranks in this process; report the
    parameters in the graph on some ranks only (``divergent``) or on none (``unused``), which break
    DDP with ``find_unused_parameters=False``, and the routing modules' branches that no rank
    sampled (``not_sampled``, fine for DDP), grouped by module (``groups``).

    One rank's inputs: a tuple of positional arguments, an :class:`Inputs`, a callable returning
    either (given the rank if it takes an argument), or one positional argument. torch is seeded
    with ``seed + rank`` before each rank (``None``: not seeded). ``train``: training or eval
    mode. ``.grad``, buffers, ``training`` flags and the caller's random state are left as found.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if isinstance(inputs_per_rank, (Tensor, Inputs, Mapping, str, bytes)) or not isinstance(inputs_per_rank, Sequence):
        raise TypeError(f"inputs_per_rank: expected a list with one element per simulated rank, got "
                        f"{type(inputs_per_rank).__name__} (for one input use find_unused_parameters, or pass [inputs])")
    if not inputs_per_rank:
        raise ValueError("inputs_per_rank: expected at least one rank's inputs, got an empty list")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable(output) -> tensor, got {type(loss_fn).__name__}")

    by_id: Dict[int, Tuple[List[str], nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), ([], p))[0].append(name)
    trainable = [(names, p) for names, p in by_id.values() if p.requires_grad]
    params = [p for _, p in trainable]
    states: List[List[str]] = []
    failures: List[R.RankFailure] = []
    notes: Dict[str, List[int]] = {}
    modes = [(m, m.training) for m in model.modules()]
    buffers = snapshot_buffers(model)
    watch = _Watch(model)
    try:
        model.train(train)
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda), simulate.as_if_under_ddp(model) as ddp:
            for rank, spec in enumerate(inputs_per_rank):
                if seed is not None:
                    torch.manual_seed(seed + rank)
                watch.start()
                try:
                    note = lambda msg, r=rank: notes.setdefault(msg, []).append(r)  # noqa: E731
                    states.append(run_rank(model, params, spec, rank, loss_fn, note, ddp.tie))
                except RankError as e:
                    failures.append(e.failure)
                    states.append([R.FAILED] * len(params))
                finally:
                    watch.stop()
                    restore_buffers(buffers)
    finally:
        watch.close()
        for m, mode in modes:
            m.training = mode
    owned, kept = _reducer.ownable(model)  # what a DDP built around it leaves to maskedbranch, and
    if kept is not None:
        owned.add(kept)  # the one it keeps then, tied into every forward (in the graph on every rank)
    uses = [R.ParameterUse(names[0], tuple(p.shape), tuple(s[i] for s in states), tuple(names[1:]), owned=id(p) in owned)
            for i, (names, p) in enumerate(trainable)]
    ran = [r for r in range(len(inputs_per_rank)) if r not in {f.rank for f in failures}]
    not_called = _classify(model, params, uses, watch, ran)
    routing = watch.routing
    flagged = {u.detail for u in uses if u.finding in (R.NOT_CALLED, R.LEFT)}
    # Not called, yet no row says so: its branches ran directly, or it has no trainable parameters.
    notes.update((_never_called(r) + ".", []) for r in routing if r.name in not_called and _never_called(r) not in flagged)
    one = len(inputs_per_rank) == 1
    return R.Report(
        model=type(model).__name__, num_ranks=len(inputs_per_rank), training=train, parameters=uses,
        groups=_group(uses), routing=routing, not_called=not_called,
        frozen=[names[0] for names, p in by_id.values() if not p.requires_grad], failures=failures,
        notes=[m if one or not r else f"on rank{R.plural(len(r))} {R.ranks_text(r)}, {m}" for m, r in notes.items()],
    )


class _Watch:
    """What every routing unit in the model did per rank: the calls and rows of each routing module
    (forward pre-hooks) and the groups that ran (the unit's record, which the step-time reset
    reads: put back as it was afterwards). The units are the module forms' (MaskedBranch,
    ResidualDropPath, the transformers patch's LayerDrop lists), found by module, and the
    functional forms' (``masked_branch``, ``drop_add_residual``: one unit per module branch),
    found by their branch modules, also when a rank's first call makes them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): name for name, m in model.named_modules()}
        self.units: List[_unit.RoutingUnit] = []
        self.routing: List[R.RoutingUse] = []
        self.hooked: List[bool] = []  # a routing module whose calls the forward should make itself
        self.saved: List[Tuple[int, int, bool, Any]] = []  # each unit's record: bits, cond, called, held
        self.handles: List[Any] = []
        self.ranks = self.done = 0  # ranks started, ranks finished
        for m in _unit.routing_modules(model):
            self._add(m._unit, m)
        self._add_functional()

    def _add(self, unit: _unit.RoutingUnit, module: Optional[nn.Module], fresh: bool = False) -> None:
        modules = unit.group_modules()
        if unit in self.units or not unit.groups():
            return  # (a patched timm block ties per call and has no groups to report)
        if module is None:  # a functional form's module branch: its unit is named after the branch
            name, kind = self.names.get(id(modules[0]), "?"), unit.where
        else:
            name, kind = self.names[id(module)], _kind(module)
        r = R.RoutingUse(name, kind, [self.names.get(id(u), "?") for u in modules],
                         calls=[0] * self.ranks, ran=[0] * self.done, functional=module is None,
                         drop_prob=getattr(module, "drop_prob", None), mode=getattr(module, "mode", ""))
        self.units.append(unit)
        self.routing.append(r)
        self.hooked.append(isinstance(module, _ROUTERS))
        self.saved.append((0, 0, False, None) if fresh else (unit.bits, unit.cond, unit.called, unit.held))
        if module is not None:
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._pre, r), with_kwargs=True))

    def _add_functional(self, fresh: bool = False) -> None:
        for unit in _functional.units_in(list(self.model.modules())):
            self._add(unit, None, fresh)

    @staticmethod
    def _pre(r: R.RoutingUse, module: nn.Module, args: tuple, kwargs: dict) -> None:
        r.calls[-1] += 1
        x = args[0] if args else kwargs.get("x")
        r.rows += x.shape[0] if isinstance(x, Tensor) and x.dim() > 0 else 0

    def start(self) -> None:
        self.ranks += 1
        for u, r in zip(self.units, self.routing):
            r.calls.append(0)
            u.bits, u.cond, u.called, u.held = 0, 0, False, None

    def stop(self) -> None:
        self._add_functional(fresh=True)  # units made by this rank's calls (their records are this rank's)
        self.done += 1
        for u, r in zip(self.units, self.routing):
            u.settle_held()
            if not r.calls[-1] and (u.called or u.bits or u.cond):
                r.calls[-1] = 1  # a call no hook sees: a functional form's, a LayerDrop list's
            r.ran.append(u.bits)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for u, (bits, cond, called, held) in zip(self.units, self.saved):
            u.bits, u.cond, u.called, u.held = bits, cond, called, held


def _kind(module: nn.Module) -> str:
    if isinstance(module, _ROUTERS):
        return type(module).__name__
    return "LayerDrop" if isinstance(module, _structure.RoutingModuleList) else f"routing module {type(module).__name__}"


def _classify(model: nn.Module, params: List[Tensor], uses: List[R.ParameterUse], watch: _Watch,
              ran: List[int]) -> List[str]:
    """Set each parameter's finding and detail; return the routing modules never called."""
    routing = watch.routing
    owners: Dict[int, List[Tuple[int, int]]] = {}  # id(param) -> [(routing unit, group)], outer first
    for k, u in enumerate(watch.units):
        for i, ps in enumerate(u.groups()):
            for p in ps:
                owners.setdefault(id(p), []).append((k, i))
    idle = [bool(ran) and not any(r.calls[i] for i in ran) for r in routing]
    # A module inside a branch that never ran was not called because of that: not a finding.
    unsampled = [u + "." for r in routing for i, u in enumerate(r.units) if not r.branch_ran(i)]
    not_called = [r.name for k, r in enumerate(routing)
                  if idle[k] and watch.hooked[k] and not any(r.name.startswith(u) for u in unsampled)]
    divergent = [u.name for u in uses if u.kind == "divergent"]
    used = [u.name for u in uses if u.used_on]
    modules = dict(model.named_modules())
    for p, u in zip(params, uses):
        own = owners.get(id(p), [])
        if u.kind == "ok":
            units: Dict[int, List[int]] = {}
            for k, i in own:
                units.setdefault(k, []).append(i)
            unpicked = [k for k, us in units.items() if not any(routing[k].branch_ran(i) for i in us)]
            uncalled = [routing[k] for k in unpicked if routing[k].name in not_called]
            if uncalled and u.owned and not u.used_on:
                u.finding, u.detail = R.LEFT, _never_called(uncalled[0])
            elif unpicked and R.GRAD not in u.ranks and not uncalled:
                u.finding, u.detail = R.NOT_SAMPLED, _sampling(routing[unpicked[0]], len(ran))
        elif u.kind == "divergent":
            u.finding = R.DIVERGENT
            plain = _plain_routing(_container(u.name, modules), modules)
            u.detail = (plain[1] or f"{plain[0]} routed in plain Python") if plain else ""
            for k, _ in own:
                r = routing[k]
                if idle[k] and watch.hooked[k]:
                    u.detail = f"{r.type} {r.name} is never called: its branches are called directly"
                elif any(r.calls) and not all(r.calls[i] for i in ran):
                    u.detail = f"{_called(r)} on rank{R.plural(sum(1 for i in ran if r.calls[i]))} " \
                               f"{R.ranks_text([i for i in ran if r.calls[i]])} only"
        elif u.kind == "unused":
            uncalled = [routing[k] for k, _ in own if routing[k].name in not_called]
            # A plain-Python routing choice: the nearest ModuleList / ModuleDict above it holds
            # parameters that diverge between ranks, or it holds experts of which others are used.
            container = _container(u.name, modules)
            plain = _plain_routing(container, modules)
            if uncalled:
                u.finding, u.detail = R.NOT_CALLED, _never_called(uncalled[0])
            elif own:  # a routed branch out of the graph on every rank: its routing ran on none
                u.finding, u.detail = R.NOT_CALLED, f"{_called(routing[own[0][0]])} on no rank"
            elif container and any(d.startswith(container + ".") for d in divergent):
                what, how = plain or ("choices", "")
                u.finding = R.CHOICE
                u.detail = f"other {what} in {container} are used on some ranks only" + (how and "; " + how)
            elif plain and any(d.startswith(container + ".") for d in used):
                what, how = plain
                u.finding, u.detail = R.CHOICE, f"other {what} in {container} are used" + (how and "; " + how)
            else:
                u.finding = R.UNUSED_
    return not_called


def _container(name: str, modules: Dict[str, nn.Module]) -> str:
    """The nearest ModuleList / ModuleDict above parameter ``name`` ("" if none)."""
    parts = name.split(".")[:-1]
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                 if isinstance(modules.get(".".join(parts[:n])), (nn.ModuleList, nn.ModuleDict))), "")


def _plain_routing(container: str, modules: Dict[str, nn.Module]) -> Optional[Tuple[str, str]]:
    """(what its members are, what routes them) when the model says that plain Python routes
    between the members of ``container``: the layers of a Hugging Face LayerDrop stack the
    transformers patch has not replaced, or experts (a container or container class named so, as
    Hugging Face's MoE layers name theirs: ``experts``, ``NllbMoeExperts``)."""
    if not container:
        return None
    module, last = modules[container], container.rsplit(".", 1)[-1]
    parent = modules.get(container.rpartition(".")[0] if "." in container else "")
    if last == "layers" and parent is not None and any(
            f"{c.__module__}.{c.__qualname__}" in _HF_LAYERDROP for c in type(parent).__mro__):
        return "layers", "Hugging Face LayerDrop: maskedbranch.integrations.transformers.patch(model) routes it"
    if "expert" in last.lower() or "expert" in type(module).__name__.lower():
        return "experts", ""
    return None


def _called(r: R.RoutingUse) -> str:
    if r.functional:
        return f"{r.type} ran with {r.name} as a branch"
    return f"{r.type} {r.name} is called"


def _never_called(r: R.RoutingUse) -> str:
    return f"{r.type} {r.name} is in the model, but the forward never calls it"


def _sampling(r: R.RoutingUse, ranks: int) -> str:
    calls = sum(r.calls)
    if r.functional:
        # (a call that ties zeros itself records nothing: no calls seen, yet in the graph on every rank)
        some = f"on the {calls} rank{R.plural(calls)} that called it" if 0 < calls < ranks else ""
        if r.type == "drop_add_residual":
            return f"drop_add_residual dropped it {some or 'on every rank'}"
        return f"{r.type} routed no row to it {some or 'on any rank'}"
    if r.drop_prob is not None:
        p = float(r.drop_prob)
        skipped = p ** (r.rows if r.mode == "row" else calls)  # the chance of these draws
        return f"{r.name} (drop_prob={p:g}, mode={r.mode}) dropped it in all {calls} calls (probability {skipped:.2g})"
    ran = [i for i in range(len(r.units)) if r.branch_ran(i)]
    which = f"branch{'' if len(ran) == 1 else 'es'} {R.ranks_text(ran) or 'none'}"
    return f"{r.type} {r.name} ran {which} of {len(r.units)} in {calls} calls"


def _group(uses: List[R.ParameterUse]) -> List[R.Group]:
    """Each parameter goes to the outermost module (a prefix of its name) whose parameters all share
    its finding and per-rank states; groups come in the model's parameter order."""
    key = lambda u: (u.finding, u.ranks, u.detail)  # noqa: E731
    keys: Dict[str, set] = {}
    for u in uses:
        parts = u.name.split(".")
        for n in range(len(parts)):
            keys.setdefault(".".join(parts[:n]), set()).add(key(u))
    groups: Dict[str, List[R.ParameterUse]] = {}
    for u in uses:
        parts = u.name.split(".")
        prefixes = (".".join(parts[:n]) for n in range(len(parts)))
        groups.setdefault(next((p for p in prefixes if len(keys[p]) == 1), u.name), []).append(u)
    return [R.Group(name or "(model)", [u.name for u in us], "".join(us[0].ranks), us[0].finding, us[0].detail)
            for name, us in groups.items()]
