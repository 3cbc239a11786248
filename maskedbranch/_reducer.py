"""The data-parallel layer: one :class:`Reducer` per wrapper (a DDP module, an FSDP2 root, a model
given to ``unused_grads_to_none``), which does for routed parameters what DDP's Reducer does with
``find_unused_parameters=True``. It acts only through hooks on its own wrapper, in the phases that
docs/design.md, "The data-parallel layer beside DDP's Reducer", sets beside DDP's, and plugs
:func:`decide` into the routing (maskedbranch/_unit.py), which never imports it."""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _autograd, _compat, _decide, _unit, _warn
from ._layout import Layout, as_bytes, cpu_group, from_bytes, mesh_group, positions, tensors
from ._unit import Tying, RoutingUnit

_MAX_PENDING = 8  # forwards whose reduction stays unmerged before a backward or step merges them


class _Reducers:
    """Every wrapper's reducer (weakly: it goes with its wrapper), the units-without-wrapper
    reducer (``local``), and a version bumped when a reducer or a layout changes."""

    def __init__(self) -> None:
        self.by_wrapper: "weakref.WeakKeyDictionary[nn.Module, Reducer]" = weakref.WeakKeyDictionary()
        self.version = 0
        self.local: Optional[LocalReducer] = None  # made when a unit that no wrapper runs is compiled


REDUCERS = _Reducers()

TIED_AT_WRAPPER = (Tying.AT_WRAPPER, Tying.AT_WRAPPER_ZEROS)
_PER_CALL = {Tying.AT_WRAPPER: Tying.NONE, Tying.AT_WRAPPER_ZEROS: Tying.ZEROS}


def reducer_for(wrapper: nn.Module, explicit_kind: bool = False, process_group: Any = None, *,
                before_forward: bool = False) -> "Reducer":
    """The reducer of ``wrapper`` (made on first use). ``before_forward``: made before the
    wrapper's forward started, so its hooks run for this forward too."""
    found = REDUCERS.by_wrapper.get(wrapper)
    if found is None:
        found = REDUCERS.by_wrapper[wrapper] = Reducer(wrapper, explicit_kind, process_group)
        found.needs_first = found.tied_per_call = not before_forward and not torch.compiler.is_compiling()
        REDUCERS.version += 1
        _unit.DATA_PARALLEL.needed()  # its reset runs in the optimizer step pre-hook
        if found.needs_first and isinstance(wrapper, nn.parallel.DistributedDataParallel):
            _warn_unowned(wrapper)
    return found


def _warn_unowned(ddp: nn.Module) -> None:
    """A DDP module built around routing modules without the reducer seeing its construction
    (no registration hook was installed yet) keeps in its buckets the parameters it could have
    left to the reducer: the same training, at a cost per dead parameter and step. Said once."""
    if not _ddp_ownable(ddp, ddp.module)[1]:
        return
    _warn.warn_once("unowned", (
        "maskedbranch: a DistributedDataParallel module was built around routing modules made before "
        "torch.distributed.init_process_group (or added after DDP was built), so DDP keeps their parameters in "
        "its buckets. Training is the same, but every step ties the dead branches into the graph and reduces "
        "their zero gradients, which maskedbranch avoids when it sees DDP being built. Make the model after "
        "init_process_group: in PyTorch Lightning in LightningModule.configure_model, with the Hugging Face "
        "Trainer after creating its TrainingArguments."
    ))


def reducer_of(wrapper: Any) -> Optional["Reducer"]:
    return REDUCERS.by_wrapper.get(wrapper) if isinstance(wrapper, nn.Module) else None


def all_reducers() -> List["Reducer"]:
    return list(REDUCERS.by_wrapper.values())


def local_reducer(units: List[RoutingUnit]) -> Optional["LocalReducer"]:
    """The reducer of ``units``, which no wrapper runs; None when there are none."""
    if REDUCERS.local is None:
        if not units:
            return None
        REDUCERS.local = LocalReducer()
    local = REDUCERS.local
    if not local.holds(units):
        return None
    local._layout()  # made again now if a unit changed, before the step reads its positions
    return local


def _root_of(wrapper: nn.Module) -> nn.Module:
    return wrapper.module if isinstance(wrapper, nn.parallel.DistributedDataParallel) else wrapper


# ----------------------------------------------------------------------------------------------
# The decision, plugged into the routing (maskedbranch/_unit.py).


def decide(unit: RoutingUnit, wrapper: Any) -> Tying:
    """Decide ``unit``'s tying under ``wrapper`` (None: no forward of a wrapper with a reducer
    runs), store it in the unit, and give the wrapper its reducer if it has none yet."""
    if wrapper is None:
        wrapper = _unit.current_wrapper(look_on_stack=True)
    if isinstance(wrapper, Reducer):  # a reducer standing for a wrapper (the doctor's simulated DDP)
        return wrapper.decide(unit)
    if wrapper is None:
        unit.check_skippable()
        unit.settle(None, 0, _decide.TABLE[_decide.LOCAL])
        return unit.tying
    return reducer_for(wrapper).decide(unit)


# A plain function on the instance (not a staticmethod object: not callable before Python 3.10, and
# a call Dynamo cannot trace, a graph break in every compiled call that decides).
_unit.DATA_PARALLEL.decide = decide


# ----------------------------------------------------------------------------------------------
# The reducer.


class Reducer:
    """See the module's docstring. ``explicit_kind``: made by ``unused_grads_to_none`` for a
    model that is not DDP or FSDP2; ``everything``: the units with an explicit
    ``materialize_grads`` are reduced and reset too (an explicit handle asked for them)."""

    def __init__(self, wrapper: Optional[nn.Module], explicit_kind: bool = False, process_group: Any = None):
        self.ref = weakref.ref(wrapper) if wrapper is not None else _no_wrapper
        self.wrapper_id = id(wrapper) if wrapper is not None else id(self)  # what units compare
        self.explicit_kind = explicit_kind
        self.everything = explicit_kind
        self.process_group = process_group
        self.context: Optional[str] = None  # decided at the first forward or unit (_decide.context_of)
        self.units: "weakref.WeakSet[RoutingUnit]" = weakref.WeakSet()  # decided for this wrapper
        self.extra: List[RoutingUnit] = []  # units of no module inside (functional forms, a parameter)
        self.layout: Optional[Layout] = None
        # names of the parameters left out of a DDP module's buckets, averaged here (own())
        self.owned_names: frozenset = frozenset()
        self.kept_name: Optional[str] = None  # ... and the routed one DDP keeps (ownable())
        self.needs_first = False  # made during a forward: that forward is reduced from its backward
        self.tied_per_call = False  # ... and its units tie per call until the next forward decides again
        self._forwards = itertools.count(1)
        self.pending: List[list] = []  # [work, bytes, forward number, its backward started]
        # Bit sets over the layout's positions, since each position's window began (its last
        # step, or its gradient seen cleared): covered by a merged forward, used or used
        # conditionally on some rank; and whether its gradient was seen None since its last step.
        self.seen = self.used = self.cond = self.cleared = 0
        self.unaveraged = 0  # positions used or used conditionally since the last averaging
        # This rank's own since the last averaging: positions used, used conditionally or held by a
        # compiled graph; owned positions without a gradient at the first backward's start; owned
        # positions that got a gradient with no record (names: for the error every rank raises
        # once the flag byte that the next forward's reduction carries comes back set).
        self.local_used, self.start_undefined, self.unrecorded = 0, None, []
        self._synced = True  # the last backward synchronized gradients (or none ran yet)
        self._backwards = 0  # backwards started since the last step
        self.last_reset = 0
        if wrapper is None:
            self._hooks = []
            return
        self._hooks = [
            wrapper.register_forward_pre_hook(_before_forward),
            wrapper.register_forward_hook(_after_forward, always_call=True),
        ]
        weakref.finalize(wrapper, _unit.forget_all, self.units)

    def alive(self) -> bool:
        """The wrapper is alive (a reducer without one, the local or the doctor's, always is)."""
        return self.ref is _no_wrapper or self.ref() is not None

    def root(self) -> Optional[nn.Module]:
        w = self.ref()
        return None if w is None else _root_of(w)

    # -- decisions -------------------------------------------------------------------------------

    def context_now(self) -> str:
        if self.context is None:
            self.context = _decide.context_of(self.ref(), self.explicit_kind)
        return self.context

    def decide(self, unit: RoutingUnit) -> Tying:
        context = self.context_now()
        row = _decide.TABLE[context]
        if self.tied_per_call:
            # made during this forward, whose forward hook will not run: the calls tie themselves
            row = tuple(_PER_CALL.get(m, m) for m in row)
        unit.check_skippable()
        unit.settle(self, self.wrapper_id, row)
        self.units.add(unit)
        if context in _decide.REDUCED and (unit.materialize is None or self.everything):
            if not isinstance(unit.owner(), nn.Module):  # a functional or parameter unit
                if unit not in self.extra:
                    self.extra.append(unit)
                    self.layout = None
            elif self.layout is not None and unit not in self.layout.unit_set:
                self.layout = None
        return unit.tying

    def reduces(self) -> bool:
        return self.context_now() in _decide.REDUCED or bool(self.owned_names)

    def _layout(self) -> Optional[Layout]:
        if self.layout is not None and not self.layout.current():
            self.layout = None
        if self.layout is None:
            self.layout = self._new_layout()
            if self.layout is None:
                return None
            self.seen = self.used = self.cond = self.cleared = self.unaveraged = self.local_used = 0
            self.start_undefined = None
            self.pending = [p for p in self.pending if len(p[1]) == 2 * self.layout.nbytes + 1]
            REDUCERS.version += 1  # positions changed: the step hook's per-optimizer lists too
        return self.layout

    def _new_layout(self) -> Optional[Layout]:
        """The wrapper's parameters and the units it reduces for (None: it reduces nothing)."""
        root = self.root()
        if root is None or not self.reduces():
            return None
        units = [m._unit for m in _unit.routing_modules(root) if self.everything or m._unit.materialize is None]
        units += [u for u in self.extra if u.owner() is not None]
        return Layout(root, units, self.owned_names, self.kept_name)

    def own(self, ddp: nn.Module, root: nn.Module) -> None:
        """At the construction of ``ddp`` (its module just set, its buckets not built yet): add
        the parameters :func:`ownable` gives to DDP's ``parameters_to_ignore`` and broadcast them
        from rank 0, as DDP does its own; :meth:`_average_owned` averages them from then on."""
        ignored, owned, kept = _ddp_ownable(ddp, root)
        if not owned:
            return
        self.kept_name = next((n for n, p in root.named_parameters() if id(p) == kept), None)
        names = set()
        for prefix, m in root.named_modules():
            for n, p in m.named_parameters(recurse=False):
                if id(p) in owned:
                    names.update((f"{prefix}.{n}", f"{prefix}.{n}".lstrip(".")))  # DDP's and named_parameters()'
        ignored |= names
        self.owned_names = frozenset(names)
        self.layout = None
        _broadcast([p for p in root.parameters() if id(p) in owned], ddp.process_group)

    def _group(self) -> Any:
        group = self.process_group
        w = self.ref()
        if group is None and isinstance(w, nn.parallel.DistributedDataParallel):
            group = w.process_group
        if group is None:
            group = mesh_group(w)
        return cpu_group(group)

    # -- forward start ---------------------------------------------------------------------------

    def before_forward(self) -> None:
        if self.needs_first:  # a forward this reducer missed the start of ran before: done with it
            self.launch_first()
        if self.tied_per_call:  # its units decide again, now that this reducer's hooks run
            self.tied_per_call = False
            _unit.forget_all(self.units)
        layout = self._layout()
        if layout is not None:
            layout.clear()

    # -- forward end -----------------------------------------------------------------------------

    def after_forward(self, output: Any = None) -> Any:
        # The forward that made this reducer ran this hook after all (torch < 2.7 compiles the
        # registration that would have made it earlier), or a later forward came before any
        # backward: usage accumulates until taken, so one launch covers both. Two would let the
        # second's backward, finding gradients None, discard the first's usage.
        self.needs_first = False
        layout = self._layout()
        if layout is None or not layout.units:
            return None
        number, dead = self._launch()
        if dead:
            if not tensors(output):
                raise RuntimeError(
                    f"maskedbranch: the model returned a {type(output).__name__}, which holds no tensor "
                    "maskedbranch can reach, so the parameters of branches that did not run cannot be tied "
                    "into the output for DistributedDataParallel. Return tensors, tuples, lists or dicts of "
                    "them, or pass materialize_grads='none' to the routing modules (each call then ties its own)."
                )
            output = _autograd.tie_outputs(output, dead, self.context == _decide.DDP_STATIC)
        w = self.ref()
        sync = not isinstance(w, nn.parallel.DistributedDataParallel) or bool(w.require_backward_grad_sync)
        hook = functools.partial(self._backward_starts, number, sync)
        for t in tensors(output):
            if t.requires_grad:
                t.register_hook(hook)
        return output if dead else None

    def first_forward_hook(self, out: Any) -> None:
        """For a forward that made this reducer (its forward hook will not run): the first
        gradient to reach a routed output launches that forward's reduction, on every rank."""
        if isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(self._first_grad)

    def _first_grad(self, grad: Tensor) -> None:
        if self.needs_first:
            number = self.launch_first()
            if number is not None:
                self._backward_starts(number, True)

    def launch_first(self) -> Optional[int]:
        self.needs_first = False
        if self._layout() is None or not self.layout.units:
            return None
        return self._launch()[0]

    def _launch(self):
        w = self.ref()
        if self.owned_names and _compat.ddp_comm_hooks(w):
            raise RuntimeError(
                "maskedbranch: this DDP model has a communication hook (register_comm_hook, or DDP's "
                "mixed_precision), which would not see the routed parameters: maskedbranch averages those "
                "itself, leaving DDP's buckets only the rest. Pass materialize_grads=True to the routing "
                "modules before building DDP (DDP then reduces every parameter, dead branches as zeros, "
                "through the hook), or register no hook."
            )
        if _compat.ddp_join_active(w):
            raise RuntimeError(
                "maskedbranch: this DDP model runs inside torch.distributed.algorithms.Join (uneven "
                "inputs), whose joined ranks do not take part in the all-reduce that tells which "
                "branches no rank used. Pass materialize_grads=True to the routing modules (dead "
                "branches get zero gradients, nothing is reset and nothing communicates), or give "
                "every rank the same number of batches."
            )
        layout = self.layout
        used, cond, dead, held = layout.take(self, TIED_AT_WRAPPER)
        if layout.always_tied and self.context in (_decide.DDP, _decide.DDP_STATIC):
            dead = dead + layout.always_tied
        self.local_used |= used | cond | held
        nb = layout.nbytes
        buf = bytearray(used.to_bytes(nb, "little") + cond.to_bytes(nb, "little") + bytes([bool(self.unrecorded)]))
        group = self._group() if nb and dist.is_available() and dist.is_initialized() else None
        if group is not None:
            t = torch.frombuffer(buf, dtype=torch.uint8)  # reduced in place: buf holds every rank's OR
            work = dist.all_reduce(t, op=dist.ReduceOp.BOR, group=group, async_op=True)
        else:
            work = None  # one process or one rank: these bytes are the answer
        number = next(self._forwards)
        self.pending.append([work, buf, number, False])
        if len(self.pending) > _MAX_PENDING:
            self._merge(lambda entry: entry[3])
        return number, dead

    # -- backward start --------------------------------------------------------------------------

    def _backward_starts(self, number: int, sync: bool, grad: Any = None) -> None:
        entry = next((e for e in self.pending if e[2] == number), None)
        if entry is None or entry[3]:
            return  # not this reducer's any more, or another output's hook came first
        self._merge(lambda e: e[2] < number)
        if self.start_undefined is None and self.layout is not None and self.layout.owned:
            self.start_undefined = from_bytes(self.layout.table.undefined(self.layout.owned_bytes))
        if self._synced and self.layout is not None:
            bits = from_bytes(self.layout.table.undefined(self.layout.grouped_bytes))
            # cleared: what earlier forwards used no longer counts
            self.seen &= ~bits
            self.used &= ~bits
            self.cond &= ~bits
            self.cleared |= bits
        self._synced = sync
        self._backwards += 1
        entry[3] = True
        if sync and self.layout is not None and self.layout.owned:
            _compat.queue_backward_callback(self._average_owned)

    def _average_owned(self) -> None:
        """At the end of a synchronizing backward: average the owned parameters that some rank
        used since the last averaging (the reduced usage: the same set on every rank), one
        all-reduce per dtype and device, scaled as DDP fills its buckets; a rank without a
        gradient adds zeros. The others keep what they hold (``None``, as for if/else)."""
        self._merge(lambda entry: entry[3])
        layout, w = self.layout, self.ref()
        bits, self.unaveraged = (0 if layout is None else self.unaveraged & layout.owned), 0
        if layout is not None and self.start_undefined is not None:
            # a gradient produced in these backwards with no record of its group running: a branch
            # called directly (``layer[k](x)``), which no rank averages; every rank raises once
            # the next forward's reduction brings the flag
            produced = self.start_undefined & ~from_bytes(layout.table.undefined(layout.owned_bytes))
            self.unrecorded += [layout.names[k] for k in positions(produced & ~self.local_used)]
        self.start_undefined, self.local_used = None, 0
        if not bits or w is None:
            return
        group = w.process_group
        scale = 1.0 / dist.get_world_size(group)
        for kind in layout.owned_sets:
            if bits & kind:
                these = as_bytes(bits & kind, layout.nbytes)
                flat = layout.table.gather(these, scale)
                dist.all_reduce(flat, group=group)
                layout.table.scatter(these, flat)

    def _merge(self, which) -> None:
        """Wait for the reductions of the pending forwards ``which`` selects and OR them in."""
        layout = self.layout
        nb = 0 if layout is None else layout.nbytes
        keep = []
        for entry in self.pending:
            if not which(entry):
                keep.append(entry)
                continue
            work, buf = entry[0], entry[1]
            if work is not None:
                work.wait()
            if buf and buf[-1]:
                self._raise_unrecorded()
            if layout is not None and len(buf) == 2 * nb + 1:
                self.seen |= layout.resettable
                used, cond = int.from_bytes(buf[:nb], "little"), int.from_bytes(buf[nb:], "little")
                self.used |= used
                self.cond |= cond
                self.unaveraged |= used | cond
        self.pending = keep

    def _raise_unrecorded(self) -> None:
        names, self.unrecorded = self.unrecorded, []
        self.pending = []
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "") if names else (
            "parameters of another rank")
        raise RuntimeError(
            f"maskedbranch: {shown} got a gradient in a backward although no routing module ran them in the "
            "forward (a branch called directly, layer[k](x), instead of through its routing module). "
            "DistributedDataParallel left them to maskedbranch, which averages only the branches their "
            "routing module ran, so that step's gradients were not averaged for them. Call the routing "
            "module on every rank (-1 for no branch), or pass materialize_grads=True to keep them in DDP's "
            "buckets."
        )

    # -- the step --------------------------------------------------------------------------------

    def reset(self, params: "StepParams") -> int:
        """Before a step of an optimizer holding ``params``: set to None the gradients that
        no rank used and if/else would have left None. Returns how many."""
        if self.needs_first:  # the first forward's routed outputs got no gradient on this rank
            number = self.launch_first()
            if number is not None:
                self._backward_starts(number, True)
        layout = self.layout  # (held: a local reducer's finalizer may drop it during the reset)
        if layout is None:
            return 0
        self._merge(lambda entry: True)
        if self._backwards:
            self._check_reduction_finished(params)
        self._backwards = 0
        by_position, mine = params.by_position, params.bits
        window = self.seen & self.cleared & mine
        unused = window & ~self.used & ~self.cond  # no rank used it: as if/else, no gradient
        done = layout.table.to_none(as_bytes(unused, layout.nbytes)) if unused else 0
        done += _reset_zeros([by_position[k] for k in positions(window & self.cond & ~self.used)])
        self.seen &= ~mine
        self.used &= ~mine
        self.cond &= ~mine
        self.cleared &= ~mine
        self.last_reset = done
        return done

    def _check_reduction_finished(self, params: "StepParams") -> None:
        """Under DDP with ``find_unused_parameters=False`` every parameter it buckets has a
        gradient after a backward; one without took no part on this rank, and DDP will raise at
        the next forward: say which, and what to do, now."""
        w = self.ref()
        if not isinstance(w, nn.parallel.DistributedDataParallel) or w.find_unused_parameters or w.static_graph:
            return
        ignored = getattr(w, "parameters_to_ignore", ()) or ()
        names = self.layout.names
        # (the branches' own parameters have none either then: DDP wrote nothing)
        missing = [names[k] for k, p in params.others if p.requires_grad and p.grad is None and names[k] not in ignored]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise RuntimeError(
                f"maskedbranch: {shown} took no part in this backward on this rank, outside any routing "
                "module, so DistributedDataParallel(find_unused_parameters=False) could not average this "
                "step's gradients (it raises 'Expected to have finished reduction in the prior iteration' "
                "at the next forward). Route the code that skips them through a maskedbranch module (or "
                "the transformers patch), set requires_grad=False on parameters the model never uses, or "
                "use find_unused_parameters=True."
            )

    def step_params(self, params: Sequence[Tensor]) -> Optional["StepParams"]:
        """What a step of an optimizer holding ``params`` reads; None when it holds none of the
        wrapper's."""
        mine = [(p, k) for p, k in zip(params, self.positions_of(params)) if k >= 0]
        if not mine:
            return None
        layout = self.layout
        for p, k in mine:
            if p is not layout.params[k]:
                layout.table.set(k, p)  # (FSDP2's sharded parameter: its optimizer holds another object)
        return StepParams(mine, layout.others)

    def positions_of(self, params: Sequence[Tensor]) -> List[int]:
        """Each of ``params``' position (-1: not the wrapper's), by name: parameters swapped since
        the layout was made (FSDP2 shards) are still found."""
        layout = self._layout()
        root = self.root()
        if layout is None or root is None:
            return [-1] * len(params)
        index = {n: k for k, n in enumerate(layout.names)}
        now = {id(p): index.get(n, -1) for n, p in root.named_parameters()}
        return [now.get(id(p), -1) for p in params]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        w = self.ref()
        if w is not None and REDUCERS.by_wrapper.get(w) is self:
            del REDUCERS.by_wrapper[w]
            REDUCERS.version += 1
        _unit.forget_all(self.units)


def _reset_zeros(params: List[Tensor]) -> int:
    """Of parameters used only conditionally, set to None the gradients that are all zeros (one
    host read per device); returns how many."""
    held: dict = {}
    for p in params:
        grad = p.grad
        if grad is not None:
            local = getattr(grad, "to_local", lambda: grad)()
            held.setdefault(local.device, []).append((p, local))
    done = 0
    for pairs in held.values():
        nonzero = torch.stack([g.any() for _, g in pairs]).tolist()
        for (p, _), used in zip(pairs, nonzero):
            if not used:
                p.grad = None
                done += 1
    return done


def _no_wrapper() -> None:
    return None


def ownable(root: nn.Module, ignored: frozenset = frozenset()) -> Tuple[set, Optional[int]]:
    """The ids of the parameters of ``root`` that a DDP module leaves to the reducer: those only
    "auto" units' groups hold, trainable, not a sparse embedding's, not ignored already (none
    where the backward's end cannot be reached); and the id of the one DDP keeps where it would
    keep no trainable parameter (it crashes without): the first, tied into every forward."""
    if not _compat.can_queue_backward_callback():
        return set(), None
    layout = Layout(root, [m._unit for m in _unit.routing_modules(root) if m._unit.materialize is None])
    sparse = {id(p) for m in root.modules() if getattr(m, "sparse", False) is True for p in m.parameters(recurse=False)}
    owned = [id(layout.params[k]) for k in positions(layout.resettable)
             if layout.params[k].requires_grad and id(layout.params[k]) not in sparse and layout.names[k] not in ignored]
    owned_set = set(owned)
    if owned and all(id(p) in owned_set or not p.requires_grad or n in ignored for n, p in root.named_parameters()):
        owned_set.discard(owned[0])
        return owned_set, owned[0]
    return owned_set, None


def _ddp_ownable(ddp: nn.Module, root: nn.Module) -> Tuple[set, set, Optional[int]]:
    """What the DDP module ``ddp`` built around ``root`` can leave to the reducer: its ignored
    names (the set DDP builds its buckets without) and :func:`ownable`'s answer for them; nothing
    where that set cannot be reached or DDP runs on its Python reducer (compiled autograd)."""
    ignored = _compat.ddp_ignored_names(ddp)
    if ignored is None or _compat.ddp_uses_python_reducer(ddp):
        return set(), set(), None
    return (ignored, *ownable(root, ignored))


def _broadcast(params: List[Tensor], group: Any) -> None:
    """Copy rank 0's values of ``params`` to every rank of ``group``, one broadcast per dtype
    and device."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    kinds: dict = {}
    for p in params:
        kinds.setdefault((p.device, p.dtype), []).append(p)
    with torch.no_grad():
        for ps in kinds.values():
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=src, group=group)
            for p, v in zip(ps, flat.split([p.numel() for p in ps])):
                p.copy_(v.view_as(p))


class LocalReducer(Reducer):
    """The reducer of the "auto" units that no wrapper runs and that were compiled (their graphs
    gave dead branches zeros where if/else leaves ``None``): the phases read at the step
    (docs/design.md, "The data-parallel layer beside DDP's Reducer"). A conditional use counts as
    a use: no wrapper reads those gradients."""

    def __init__(self) -> None:
        super().__init__(None)
        self.context = _decide.LOCAL
        self.local_units: List[RoutingUnit] = []
        self._watched: set = set()  # ids of the units' owners, each watched until it is gone

    def holds(self, units: List[RoutingUnit]) -> bool:
        """Reduce for ``units`` from now on; whether there are any. The layout holds their
        parameters: it goes when an owner goes, so that a model deleted between steps is freed."""
        if units != self.local_units:
            self.local_units = units
            self.layout = None
            for u in units:
                owner = u.owner()
                if owner is not None and id(owner) not in self._watched:
                    self._watched.add(id(owner))
                    weakref.finalize(owner, self._owner_gone, id(owner))
        return bool(units)

    def _owner_gone(self, key: int) -> None:
        self._watched.discard(key)
        self.local_units = []
        self.layout = None
        REDUCERS.version += 1

    def _new_layout(self) -> Optional[Layout]:
        return Layout(None, self.local_units) if self.local_units else None

    def positions_of(self, params: Sequence[Tensor]) -> List[int]:
        layout = self._layout()
        if layout is None:
            return [-1] * len(params)
        index = {id(p): k for k, p in enumerate(layout.params)}
        return [index.get(id(p), -1) for p in params]

    def reset(self, params: "StepParams") -> int:
        layout = self._layout()
        if layout is None:
            return 0
        # The forward and backward phases, read now: a gradient that is not the tensor noted at
        # the previous step (of any optimizer) was cleared and produced again since, so only
        # the calls recorded since count for it; the others keep what earlier calls used.
        used, cond, _, _ = layout.take(self, ())
        changed = from_bytes(layout.table.changed(layout.grouped_bytes))
        self.used = (self.used & ~changed) | used | cond
        self.seen |= layout.resettable
        self.cleared |= changed
        done = super().reset(params)
        layout.table.note(layout.grouped_bytes)
        return done


class StepParams:
    """An optimizer's parameters in one reducer's layout: by position, as a bit set, and those
    outside every group (for :meth:`Reducer._check_reduction_finished`)."""

    __slots__ = ("by_position", "bits", "others")

    def __init__(self, mine: List[tuple], others: Sequence[int]):
        self.by_position = {k: p for p, k in mine}
        self.bits = sum(1 << k for k in self.by_position)
        self.others = [(k, self.by_position[k]) for k in others if k in self.by_position]


@torch.compiler.disable
def _before_forward(module: nn.Module, args: Any) -> None:
    _unit.DATA_PARALLEL.running.append(module)
    if torch.is_grad_enabled():
        reducer = REDUCERS.by_wrapper.get(module)
        if reducer is not None:
            reducer.before_forward()


@torch.compiler.disable
def _after_forward(module: nn.Module, args: Any, output: Any) -> Any:
    running = _unit.DATA_PARALLEL.running
    if running and running[-1] is module:
        running.pop()
    elif module in running:
        running.remove(module)
    if output is None or not torch.is_grad_enabled():
        return None  # (None: also what a forward that raised gives this hook)
    reducer = REDUCERS.by_wrapper.get(module)
    return None if reducer is None else reducer.after_forward(output)
