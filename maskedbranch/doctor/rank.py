"""One simulated rank: make its inputs, run the forward, the loss and the backward, and say for
each trainable parameter whether it is in the autograd graph, as DDP decides it (a walk from the
loss to the gradient accumulators, what ``find_unused_parameters=True`` does)."""
from __future__ import annotations

import dataclasses
import inspect
import os
import traceback
from collections.abc import Mapping
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .report import GRAD, TIED, UNUSED, ZERO, RankFailure


class Inputs:
    """The positional and keyword arguments of one forward call: ``Inputs(x, mask=m)``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


class RankError(Exception):
    def __init__(self, rank: int, stage: str, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.failure = RankFailure(rank, stage, f"{type(exc).__name__}: {exc}", _user_traceback(exc))


def _user_traceback(exc: BaseException) -> str:
    """The traceback without the doctor's frames and nn.Module's call wrappers."""
    here, module_py = os.path.dirname(os.path.abspath(__file__)), os.path.join("torch", "nn", "modules", "module.py")
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list([
        f for f in te.stack if os.path.dirname(os.path.abspath(f.filename)) != here
        and not (f.filename.endswith(module_py) and "call_impl" in f.name)])
    return "".join(te.format())


def run_rank(model: nn.Module, params: List[Tensor], spec: Any, rank: int,
             loss_fn: Optional[Callable[[Any], Tensor]], note: Callable[[str], None],
             wrapper_tie: Callable[[Any], Any] = lambda out: out) -> List[str]:
    """The state of each of ``params`` on this rank (GRAD, ZERO, TIED or UNUSED). ``wrapper_tie``:
    what the DDP wrapper ties into the forward's output (maskedbranch/_reducer.py)."""
    states, stage = [UNUSED] * len(params), "inputs"
    try:
        args, kwargs = _as_call(resolve(spec, rank))
        with torch.enable_grad():
            stage = "forward"
            out = wrapper_tie(model(*args, **kwargs))
            stage = "loss"
            loss = _loss(out, loss_fn, note)
            if loss is None or not loss.requires_grad:
                return states
            reached = _leaves_reached(loss.grad_fn) if loss.grad_fn is not None else {id(loss)}
            in_graph = [i for i, p in enumerate(params) if id(p) in reached]
            stage = "backward"
            grads = torch.autograd.grad(loss, [params[i] for i in in_graph], allow_unused=True) if in_graph else ()
    except Exception as e:
        raise RankError(rank, stage, e) from None
    for i, g in zip(in_graph, grads):
        g = g.coalesce().values() if g is not None and g.is_sparse else g
        states[i] = TIED if g is None else GRAD if bool(g.any()) else ZERO
    return states


def resolve(spec: Any, rank: int) -> Any:
    """A callable element makes the rank's inputs (called with the rank if it takes an argument)."""
    if not callable(spec) or isinstance(spec, (Tensor, nn.Module, Inputs)):
        return spec
    try:
        inspect.signature(spec).bind(rank)
    except TypeError:
        return spec()
    except ValueError:  # no signature to read
        pass
    return spec(rank)


def _as_call(inputs: Any) -> Tuple[tuple, dict]:
    if isinstance(inputs, Inputs):
        return tuple(inputs.args), dict(inputs.kwargs)
    if isinstance(inputs, tuple) and not hasattr(type(inputs), "_fields"):  # a namedtuple is one argument
        return inputs, {}
    return (inputs,), {}


def _loss(out: Any, loss_fn: Optional[Callable[[Any], Tensor]], note: Callable[[str], None]) -> Optional[Tensor]:
    if loss_fn is not None:
        loss = loss_fn(out)
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss_fn returned {type(loss).__name__}, expected a tensor")
        if not loss.requires_grad:
            note("the loss does not require grad: it depends on no trainable parameter.")
        return loss.sum() if loss.numel() != 1 else loss
    floating = [t for t in _tensors(out, set()) if t.is_floating_point() or t.is_complex()]
    live = [t for t in floating if t.requires_grad]
    if not live:
        what = "no tensor that requires grad" if floating else "no floating tensor"
        note(f"the output ({type(out).__name__}) holds {what}: nothing in it depends on a trainable parameter "
             "(pass loss_fn if the loss is computed some other way).")
        return None
    total = None
    for t in live:
        t = torch.view_as_real(t) if t.is_complex() else t
        s = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
        total = s if total is None else total + s.to(total.device)
    return total


def _tensors(obj: Any, seen: set) -> Iterator[Tensor]:
    """Every tensor in a (nested) output: tuples, lists, dicts, dataclasses."""
    if isinstance(obj, Tensor):
        yield obj
    elif id(obj) not in seen:
        seen.add(id(obj))
        if isinstance(obj, Mapping):
            items: Any = obj.values()
        elif isinstance(obj, (list, tuple)):
            items = obj
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
        else:
            items = ()
        for item in items:
            yield from _tensors(item, seen)


def _leaves_reached(root: Any) -> set:
    """ids of the leaf tensors whose gradient accumulators the backward of ``root`` reaches."""
    reached, seen, keep, stack = set(), set(), [], [root]  # keep: node wrappers alive, ids unique
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        if isinstance(getattr(node, "variable", None), Tensor):
            reached.add(id(node.variable))
        stack.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return reached


def snapshot_buffers(model: nn.Module) -> List[Tuple[nn.Module, str, Tensor, Tensor]]:
    return [(m, k, b, b.detach().clone()) for m in model.modules() for k, b in m._buffers.items() if b is not None]


def restore_buffers(saved: List[Tuple[nn.Module, str, Tensor, Tensor]]) -> None:
    with torch.no_grad():
        for m, name, original, copy in saved:
            m._buffers[name] = original  # in case the forward replaced the buffer object
            if original.shape == copy.shape:
                original.copy_(copy)
            else:
                original.data = copy.clone()
