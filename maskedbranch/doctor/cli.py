"""The command line, ``python -m maskedbranch.doctor MODULE:FACTORY``; its help is ``_HELP``."""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Sequence, Tuple

from torch import Tensor, nn

from .find import find_divergent_parameters
from .rank import Inputs
from .report import wrap

_DESCRIPTION = ("Run a model's forward and backward on simulated ranks (in this process) and list by module "
                "the parameters that would break DistributedDataParallel with find_unused_parameters=False, "
                "and the branches of routing modules that no rank sampled.")

_HELP = """\
MODULE is a module name (found on PYTHONPATH or in the current directory) or a .py file; FACTORY
names a callable in it (Builder.make is allowed) that takes no arguments and returns

  (model, inputs)             one rank's inputs, fed on every simulated rank
  (model, [inputs_r0, ...])   one element per simulated rank
  (model, make_inputs)        make_inputs(rank) -> inputs
  a dict with "model" and "inputs", "inputs_per_rank" or "make_inputs"

and optionally a loss, callable(output) -> tensor (a tuple's third element, or "loss_fn"; default:
the sum of the floating tensors in the output). One rank's inputs are a tuple of positional
arguments, a maskedbranch.doctor.Inputs (positional and keyword arguments) or one object. Rank r
is seeded with S + r (--seed S), so random routing differs per rank as in a real job.

Example, check.py:

    import torch
    from torch import nn
    import maskedbranch
    from maskedbranch.doctor import Inputs

    class Supernet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.choices = maskedbranch.MaskedBranch([nn.Linear(8, 8) for _ in range(4)])

        def forward(self, x, choice):
            return self.choices(self.stem(x), choice)

    def factory():  # the choice that each rank samples (in a real job, at random): rank % 4
        return Supernet(), lambda rank: Inputs(torch.randn(2, 8), choice=rank % 4)

python -m maskedbranch.doctor check.py:factory --ranks 2

exits with status 0 (safe) and lists choices 2 and 3, which neither rank drew, as not sampled (not
as unused). With nn.ModuleList in place of maskedbranch.MaskedBranch and self.choices[choice](...)
in place of self.choices(..., choice), it exits with status 1: choices 0 and 1 are divergent, and
2 and 3 are routing choices not sampled (plain Python routing), still not unused.

Exit status: 0 safe for DDP with find_unused_parameters=False, 1 some parameters would break it,
2 usage error (the target cannot be imported, the factory raised or returned something else),
3 the model raised in the forward, the loss or the backward.
"""

_CONTRACT = ("the factory must return (model, inputs), (model, [inputs_rank0, inputs_rank1, ...]), "
             "(model, make_inputs) or a dict with 'model' and one of 'inputs', 'inputs_per_rank', "
             "'make_inputs' (and optionally 'loss_fn')")


class _UsageError(Exception):
    pass


def _load_factory(target: str) -> Callable[[], Any]:
    module_part, _, attr = target.rpartition(":")
    if not module_part or not attr:
        raise _UsageError(f"TARGET must be MODULE:FACTORY (for example package.module:make_model), got {target!r}")
    try:
        if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
            path = os.path.abspath(module_part)
            if not os.path.isfile(path):
                raise _UsageError(f"no such file: {module_part}")
            name = os.path.splitext(os.path.basename(path))[0]
            sys.path.insert(0, os.path.dirname(path))  # so that the file's own imports resolve
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_part)
    except _UsageError:
        raise
    except BaseException:  # SystemExit from a module that runs a script on import, too
        raise _UsageError(f"cannot import {module_part!r}:\n{traceback.format_exc().rstrip()}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _UsageError(f"{module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise _UsageError(f"{target} is a {type(obj).__name__}, not a callable factory")
    return obj


def _spec(result: Any, ranks: Optional[int]) -> Tuple[nn.Module, List[Any], Optional[Callable]]:
    """The model, the per-rank inputs and the loss function that the factory's result gives."""
    if isinstance(result, Mapping):
        unknown = set(result) - {"model", "inputs", "inputs_per_rank", "make_inputs", "loss_fn"}
        if unknown:
            raise _UsageError(f"the factory's dict has unknown keys {sorted(map(str, unknown))}; {_CONTRACT}")
        spec = dict(result)
    elif isinstance(result, tuple) and len(result) in (2, 3) and not hasattr(type(result), "_fields"):
        inputs = result[1]
        key = ("inputs_per_rank" if isinstance(inputs, list) else "make_inputs"
               if callable(inputs) and not isinstance(inputs, (Tensor, nn.Module, Inputs)) else "inputs")
        spec = {"model": result[0], key: inputs, "loss_fn": result[2] if len(result) == 3 else None}
    else:
        raise _UsageError(f"the factory returned {type(result).__name__}; {_CONTRACT}")
    model, per_rank, maker, loss_fn = (spec.get(k) for k in ("model", "inputs_per_rank", "make_inputs", "loss_fn"))
    if not isinstance(model, nn.Module):
        raise _UsageError(f"the factory's model is a {type(model).__name__}, expected an nn.Module; {_CONTRACT}")
    if per_rank is None and maker is None and "inputs" not in spec:
        raise _UsageError(f"the factory gave a model but no inputs; {_CONTRACT}")
    if per_rank is not None and (not isinstance(per_rank, (list, tuple)) or not per_rank):
        raise _UsageError("'inputs_per_rank' must be a non-empty list, one element per simulated rank")
    for key, what in (("make_inputs", "callable(rank) -> inputs"), ("loss_fn", "callable(output) -> tensor")):
        if spec.get(key) is not None and not callable(spec[key]):
            raise _UsageError(f"'{key}' must be a {what}, got {type(spec[key]).__name__}")
    if per_rank is not None:
        if ranks not in (None, len(per_rank)):
            raise _UsageError(f"--ranks {ranks} disagrees with the factory's {len(per_rank)} per-rank inputs")
        return model, list(per_rank), loss_fn
    k = ranks or 4
    if maker is not None and (k > 1 or "inputs" not in spec):
        return model, [functools.partial(maker, r) for r in range(k)], loss_fn
    return model, [spec["inputs"]] * k, loss_fn


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maskedbranch.doctor", description=wrap(_DESCRIPTION),
                                     epilog=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar="MODULE:FACTORY", help="the factory, for example package.module:make_model")
    parser.add_argument("--ranks", type=int, metavar="K",
                        help="simulated ranks (default: the number of per-rank inputs, else 4)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="rank r is seeded with S + r (default 0)")
    parser.add_argument("--eval", action="store_true", help="run in eval mode (default: training mode)")
    parser.add_argument("--all", action="store_true", help="list the modules without findings too")
    args = parser.parse_args(argv)
    if args.ranks is not None and args.ranks < 1:
        parser.error(f"argument --ranks: expected a positive integer, got {args.ranks}")
    try:
        factory = _load_factory(args.target)
        try:
            result = factory()
        except Exception:
            raise _UsageError(f"the factory {args.target} raised:\n{traceback.format_exc().rstrip()}") from None
        model, inputs, loss_fn = _spec(result, args.ranks)
    except _UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    report = find_divergent_parameters(model, inputs, loss_fn=loss_fn, seed=args.seed, train=not args.eval)
    print(f"maskedbranch doctor: {args.target}\n{report.format(show_all=args.all)}", flush=True)
    return report.exit_code
