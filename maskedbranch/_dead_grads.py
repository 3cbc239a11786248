"""What the parameters of a branch that did not run receive in the backward, decided once per
(routing module, data-parallel wrapper).

The *context* of a call is the data-parallel wrapper whose forward runs it:

* ``local``: one process, or a model that no wrapper runs (a rank-local model in a distributed
  job: a probe, a predictor). Nothing is tied: ``.grad`` stays as it was, exactly as with
  if/else, and nothing communicates.
* ``ddp``: DistributedDataParallel's C++ reducer without ``static_graph``. Dead parameters are
  tied with undefined gradients: DDP's hooks fire and it fills zeros into its buckets.
* ``ddp-static``, ``ddp-python-reducer``, ``fsdp2``, ``explicit`` (a model handed to
  :func:`maskedbranch.unused_grads_to_none`, e.g. for hand-written averaging): zeros, since each
  needs a defined gradient on every rank (static_graph learns the used set from the first
  step's defined gradients, FSDP2 and the Python reducer pair defined gradients across ranks).

Under a wrapper, zeros for a branch that no rank ran would step it (momentum, weight decay),
where if/else with ``find_unused_parameters=True`` leaves its gradient ``None``: the wrapper's
wiring (maskedbranch/_wiring.py) resets those gradients before the optimizer step.
``materialize_grads=True`` / ``False`` on a module override the tie (zeros / undefined, no reset),
except where undefined gradients would train wrong: ``static_graph`` and the Python reducer
refuse ``False`` in the forward, FSDP2 at the step.

The DDP whose forward runs is read from DDP itself (``_compat.active_ddp``); other wrappers are
looked for on the Python stack, once per module and optimizer step (:func:`_wrapper_on_stack`).
Under torch.compile the binding is made while the graph is traced, for real
(``torch.compiler.assume_constant_result``), so compiled code reads no Python state of ours.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _compat, _wiring

LOCAL, DDP, DDP_STATIC, PYTHON_REDUCER, FSDP2, EXPLICIT = "local", "ddp", "ddp-static", "ddp-python-reducer", "fsdp2", "explicit"
_ZEROS = {DDP_STATIC: True, PYTHON_REDUCER: True, FSDP2: True, EXPLICIT: True, DDP: False, LOCAL: None}


class Context:
    """A data-parallel wrapper whose forward runs routed calls (``wrapper`` None: ``local``),
    and the wiring that resets its unused gradients (maskedbranch/_wiring.py)."""

    __slots__ = ("kind", "ref", "wiring", "epoch", "__weakref__")

    def __init__(self, kind: str, wrapper: Optional[nn.Module] = None, wiring: Any = None, epoch: int = -1):
        self.kind = kind
        self.ref = None if wrapper is None else weakref.ref(wrapper)
        self.wiring = wiring
        self.epoch = epoch

    @property
    def zeros(self) -> Optional[bool]:
        return _ZEROS[self.kind]

    def wrapper(self) -> Optional[nn.Module]:
        return None if self.ref is None else self.ref()


_LOCAL = Context(LOCAL)
_AS_IF_DDP = Context(DDP)  # the doctor's simulated ranks
_as_if_ddp = [False]
_epoch = [0]  # advanced at every optimizer step: contexts found on the stack are looked for again
_stack_cache: list = [None]  # the last context found on the stack, for functional forms


def advance_epoch() -> None:
    _epoch[0] += 1


def epoch() -> int:
    return _epoch[0]


@contextlib.contextmanager
def as_if_under_ddp() -> Iterator[None]:
    """Inside, one process ties as under DDP without static_graph (undefined gradients), for
    maskedbranch.doctor, whose simulated ranks must see the graph that a DDP job would see."""
    before, _as_if_ddp[0] = _as_if_ddp[0], True
    try:
        yield
    finally:
        _as_if_ddp[0] = before


_SPELLINGS = {"auto": None, "zeros": True, "none": False}
_NAMES = {None: "auto", True: "zeros", False: "none"}


def materialize(value: Any, allow_auto: bool = True) -> Optional[bool]:
    """``materialize_grads`` as stored: its spellings ``"auto"`` (None: what the training
    setting needs, the if/else result), ``"zeros"`` (True: zero gradients) and ``"none"`` (False:
    no gradient from the routing; a wrapper that needs one, DDP, fills zeros itself), and the
    values None / True / False they stand for."""
    if isinstance(value, str) and value in _SPELLINGS:
        value = _SPELLINGS[value]
    if (value is None and allow_auto) or isinstance(value, bool):
        return value
    allowed = "'auto' (None), 'zeros' (True) or 'none' (False)" if allow_auto else "'zeros' (True) or 'none' (False)"
    raise TypeError(f"materialize_grads: expected {allowed}, got {value!r}")


def materialize_name(value: Optional[bool]) -> str:
    return _NAMES[value]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _fsdp_module_type() -> Optional[type]:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # only if the user imported FSDP
    t = getattr(fsdp, "FSDPModule", None)
    return t if isinstance(t, type) else None


_CALL_CODES = frozenset(getattr(nn.Module, n).__code__ for n in ("_call_impl", "_wrapped_call_impl") if hasattr(nn.Module, n))


def _wrapper_on_stack() -> Optional[nn.Module]:
    """The outermost module on the Python stack, whose forward is running, that is a
    data-parallel wrapper: a DDP, an FSDP2 unit, or a model with an explicit wiring. A compiled
    module (``torch.compile``) counts as the module it compiles."""
    fsdp = _fsdp_module_type()
    found = None
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in _CALL_CODES:
            m = f.f_locals.get("self")
            m = getattr(m, "_orig_mod", m)
            if isinstance(m, nn.parallel.DistributedDataParallel) or (fsdp is not None and isinstance(m, fsdp)) or _wiring.explicit(m):
                found = m
        f = f.f_back
    return found


def _context_of(wrapper: Optional[nn.Module], active: bool) -> Context:
    if wrapper is None:
        return Context(LOCAL, epoch=_epoch[0])
    wiring = _wiring.wiring_for(wrapper)
    if wiring.explicit_kind:
        kind = EXPLICIT
    elif isinstance(wrapper, nn.parallel.DistributedDataParallel):
        if not active and _compat.ddp_uses_python_reducer(wrapper):
            kind = PYTHON_REDUCER
        else:
            kind = DDP_STATIC if getattr(wrapper, "static_graph", False) else DDP
    else:
        kind = FSDP2
    return wiring.context(kind, _epoch[0])


def context(usage: Any = None) -> Context:
    """The context of this call; ``usage`` (a module's record) caches it."""
    if not distributed():
        if _wiring._spotter:
            _wiring.disarm()  # no wrapper can run in this process (maskedbranch/_wiring.py)
        return _AS_IF_DDP if _as_if_ddp[0] else _LOCAL
    ddp = _compat.active_ddp()
    cached = _stack_cache if usage is None else None
    known = usage.binding if usage is not None else cached[0]
    if ddp is not None:
        if known is not None and known.ref is not None and known.ref() is ddp:
            return known
        found = _context_of(ddp, True)
    else:
        if known is not None and known.epoch == _epoch[0] and (known.ref is None or known.ref() is not None):
            if known.kind != DDP and known.kind != DDP_STATIC:
                return known
        found = _context_of(_wrapper_on_stack(), False)
    previous = usage.binding if usage is not None else cached[0]
    if usage is not None:
        usage.binding = found
    else:
        cached[0] = found
    if previous is None or previous.kind != found.kind or previous.wrapper() is not found.wrapper():
        _epoch[0] += 1  # a new wrapper: every cache is checked in depth again (see _structure)
    return found


def _owner(key: Optional[int]) -> Any:
    from . import _usage

    return _usage.module_by_id(key)


@torch.compiler.assume_constant_result
def _policy_while_tracing(explicit: Optional[bool], where: str, key: Optional[int], ddp_key: Optional[int]) -> Optional[bool]:
    """:func:`tie_policy` run for real while torch.compile traces, once per graph: binds the
    module (``key``: its id) and answers a constant. The DDP whose forward runs is read in the
    traced code (``ddp_key``), so that another wrapper's forward makes another graph. (Modules
    are passed by id: torch 2.6 takes only constants here.)"""
    module = _owner(key)
    return _policy(explicit, where, context(getattr(module, "_usage", None)))


def _keys(module: Any) -> Tuple[Optional[int], Optional[int]]:
    ddp = _compat.active_ddp()
    return (None if module is None else id(module)), (None if ddp is None else id(ddp))


def tie_policy(explicit: Optional[bool], where: str, usage: Any = None, module: Any = None) -> Optional[bool]:
    """None: do not tie the dead parameters; True: tie them with zero gradients; False: tie them
    with undefined gradients. ``usage``: the record of the module (``module``) that calls, which
    caches its binding."""
    if torch.compiler.is_compiling():
        return _policy_while_tracing(explicit, where, *_keys(module))
    return _policy(explicit, where, context(usage))


def _policy(explicit: Optional[bool], where: str, ctx: Context) -> Optional[bool]:
    if explicit is None:
        return ctx.zeros
    if not explicit:
        if ctx.kind == DDP_STATIC:
            raise RuntimeError(
                f"{where}: materialize_grads=False under DistributedDataParallel(static_graph=True). "
                "static_graph treats a parameter whose gradient is undefined in the first step as "
                "unused forever, so branches that no rank ran then would never be averaged. Use "
                "materialize_grads=None (the default, which gives them zeros here) or True."
            )
        if ctx.kind == PYTHON_REDUCER:
            raise RuntimeError(
                f"{where}: materialize_grads=False with DDP's Python reducer (torch._dynamo.config."
                "optimize_ddp='python_reducer', as compiled autograd needs). It all-reduces only the "
                "parameters whose gradient is defined, so ranks that ran different branches would "
                "pair different parameters. Use materialize_grads=None (the default) or True."
            )
    return explicit


@torch.compiler.assume_constant_result
def _canonical_while_tracing(key: Optional[int], ddp_key: Optional[int]) -> bool:
    return distributed() and context(getattr(_owner(key), "_usage", None)).kind == PYTHON_REDUCER


def canonical_order(usage: Any = None, module: Any = None) -> bool:
    """True when zero-gradient ties must go to the branches' input (DDP's Python reducer: see
    maskedbranch/_route.py, ``_aliases``)."""
    if torch.compiler.is_compiling():
        return _canonical_while_tracing(*_keys(module))
    return distributed() and context(usage).kind == PYTHON_REDUCER


def after_call(usage: Any, out: Any) -> None:
    """After a routed call: the first forward of a wrapper wired during it is reduced from its
    backward (maskedbranch/_wiring.py, ``first_forward_hook``)."""
    ctx = usage.binding
    if ctx is not None and ctx.wiring is not None and ctx.wiring.needs_first:
        ctx.wiring.first_forward_hook(out)
