"""Bad inputs to every public entry point (modules, functional forms, routing functions): wrong
types, ranks and shapes, dtypes, devices, out-of-range ids, non-finite gates, bad branch lists,
collectives inside a branch, bad drop probabilities, modes and generators.

Each case is a real call that must
* raise the named exception type, with a message that starts with the argument's name and says
  what was expected (the regex), and no internal traceback in the message;
* raise again when repeated (the failing call consumed no state);
* leave everything untouched: the modules' parameters and buffers (so no branch ran, unless the
  branch's own output is what is wrong), no ``.grad`` created, the output-shape memory, the
  generators' and torch's RNG states, the inputs and the plan;
* leave the library usable: good calls afterwards (every module, functional form and routing
  function, forward and backward) give results bitwise equal to those of fresh objects that
  never saw the bad call.

On CUDA the same cases run with every tensor on the GPU, and the context must stay usable.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch import nn

import maskedbranch as mb
from maskedbranch import DropPath, MaskedBranch, ResidualDropPath, drop_add_residual, drop_path, masked_branch

from bad_input_world import B, D, IDS, N, Branch, Returns, World, assert_equal, bn_branch, cuda_generator


# ----------------------------------------------------------------------------------------------
# The cases: (id, exception, message regex, setup(world) -> the bad call, ran). ``ran``: the
# error is the branch's own output, found once it ran; its call counter and the mask draw may
# then have moved, as in the plain model that fails at the same place (parameters may not).

CASES: List[tuple] = []


def case(id: str, exc: type, match: str, ran: bool = False):
    def register(setup):
        CASES.append(pytest.param(setup, exc, match, ran, id=id))
        return setup

    return register


def call(id: str, exc: type, match: str, fn: Callable):
    """A case whose bad call is ``fn(world)``."""
    case(id, exc, match)(lambda w: functools.partial(fn, w))


# -- MaskedBranch ---------------------------------------------------------------------------------

call("MaskedBranch/empty branch list", ValueError, r"^branches: expected at least one branch, got none", lambda w: MaskedBranch([]))
# (the modules given are built before the snapshot: building one draws its initial weights)
case("MaskedBranch/a single module", TypeError, r"^branches: expected an iterable of nn\.Module .*got a single Linear")(
    lambda w: functools.partial(MaskedBranch, nn.Linear(D, D))
)
case("MaskedBranch/a function among modules", TypeError, r"^branches\[1\]: expected an nn\.Module, got builtin_function")(
    lambda w: functools.partial(MaskedBranch, [nn.Linear(D, D), torch.sin])
)
case("MaskedBranch/materialize_grads a string", TypeError, r"^materialize_grads: expected 'auto' \(None\), 'zeros' \(True\) or 'none' \(False\), got 'yes'")(
    lambda w: functools.partial(MaskedBranch, [nn.Linear(D, D)], materialize_grads="yes")
)
call("MaskedBranch/x not a tensor", TypeError, r"^x: expected a tensor, got list", lambda w: w.mb([[1.0] * D] * B, 0))
call("MaskedBranch/x 0-d", ValueError, r"^x: expected at least one dimension", lambda w: w.mb(w.tensor(1.0), 0))
call("MaskedBranch/gate a bool", TypeError, r"^gate: got a bool; pass an int branch id, an integer tensor \[B\] of ids or a bool tensor \[B, 3\]",
      lambda w: w.mb(w.x, True))
call("MaskedBranch/gate None", TypeError, r"^gate: expected an int branch id, an integer tensor \[B\] of branch ids or a bool/floating tensor \[B, 3\], got NoneType",
      lambda w: w.mb(w.x, None))
call("MaskedBranch/gate a float", TypeError, r"^gate: expected an int branch id.*got float", lambda w: w.mb(w.x, 1.0))
call("MaskedBranch/int gate out of range", IndexError, r"^gate: branch id 3 is out of range; expected -1 \(no branch\) to 2", lambda w: w.mb(w.x, 3))
call("MaskedBranch/int gate below -1", IndexError, r"^gate: branch id -2 is out of range; expected -1 \(no branch\) to 2", lambda w: w.mb(w.x, -2))
call("MaskedBranch/0-d float gate", TypeError, r"^gate: a 0-d gate must be an integer branch id, got dtype torch\.float32",
      lambda w: w.mb(w.x, w.tensor(1.0)))
call("MaskedBranch/float ids", TypeError, r"^gate: a 1-D gate holds one integer branch id per row \(-1 = no branch\), got dtype torch\.float32",
      lambda w: w.mb(w.x, w.ids.float()))
call("MaskedBranch/1-D bool gate", TypeError, r"^gate: a 1-D gate holds one integer branch id.*; for a mask use shape \[B, 3\]",
      lambda w: w.mb(w.x, w.ids >= 0))
call("MaskedBranch/ids of the wrong length", ValueError, r"^gate: expected 6 branch ids \(one per row of x\), got shape \(5,\)",
      lambda w: w.mb(w.x, w.ids[:5]))
call("MaskedBranch/id out of range", IndexError, r"^gate: branch id 3 at row 4 is out of range", lambda w: w.mb(w.x, w.tensor([0, 1, -1, 2, 3, 1])))
call("MaskedBranch/id below -1", IndexError, r"^gate: branch id -2 at row 0 is out of range", lambda w: w.mb(w.x, w.tensor([-2, 1, -1, 2, 0, 1])))
call("MaskedBranch/uint8 id 255", IndexError, r"^gate: branch id 255 at row 1 is out of range",
      lambda w: w.mb(w.x, w.tensor([0, 255, 0, 1, 2, 0], dtype=torch.uint8)))
call("MaskedBranch/0-d id out of range", IndexError, r"^gate: branch id 7 .*out of range", lambda w: w.mb(w.x, w.tensor(7, dtype=torch.int32)))
call("MaskedBranch/mask with the wrong number of branches", ValueError, r"^gate: expected shape \[6, 3\] \(rows of x, branches\), got \(6, 4\)",
      lambda w: w.mb(w.x, torch.ones(B, N + 1, dtype=torch.bool, device=w.device)))
call("MaskedBranch/weights with the wrong number of rows", ValueError, r"^gate: expected shape \[6, 3\] \(rows of x, branches\), got \(7, 3\)",
      lambda w: w.mb(w.x, torch.ones(B + 1, N, device=w.device)))
call("MaskedBranch/integer weights", TypeError, r"^gate: a 2-D gate must be bool \(a mask\) or floating \(weights\), got dtype torch\.int64",
      lambda w: w.mb(w.x, torch.ones(B, N, dtype=torch.long, device=w.device)))
call("MaskedBranch/3-D gate", ValueError, r"^gate: expected an int, branch ids \[B\] or a mask/weights \[B, 3\], got shape \(6, 3, 1\)",
      lambda w: w.mb(w.x, torch.ones(B, N, 1, device=w.device)))
call("MaskedBranch/complex gate", TypeError, r"^gate: complex gates are not supported, got dtype torch\.complex64",
      lambda w: w.mb(w.x, torch.ones(B, N, dtype=torch.complex64, device=w.device)))
call("MaskedBranch/NaN weight", ValueError, r"^gate: weight nan at row 2, branch 1 is not finite",
      lambda w: w.mb(w.x, w.weights.detach().index_put((w.tensor(2), w.tensor(1)), w.tensor(float("nan")))))
call("MaskedBranch/inf weight", ValueError, r"^gate: weight inf at row 0, branch 0 is not finite",
      lambda w: w.mb(w.x, torch.full((B, N), float("inf"), device=w.device)))
call("MaskedBranch/-inf weight (float64)", ValueError, r"^gate: weight -inf at row 5, branch 2 is not finite",
      lambda w: w.mb(w.x, w.weights.detach().double().index_put((w.tensor(5), w.tensor(2)), w.tensor(-float("inf"), dtype=torch.float64))))
call("MaskedBranch/gate on another device", ValueError, r"^gate: a device gate must live on x's device \(\S+\), got one on meta",
      lambda w: w.mb(w.x, w.ids.to("meta")))
call("MaskedBranch/per-row argument on another device", ValueError, r"^args\[0\]: a per-row argument \(first dimension 6, routed with x\) must live on x's device",
      lambda w: w.mb(w.x, w.ids, torch.ones(B, 2, device=w.other)))
call("MaskedBranch/per-row keyword argument on another device", ValueError, r"^mask: a per-row argument \(first dimension 6, routed with x\) must live on x's device",
      lambda w: w.mb(w.x, w.ids, mask=torch.ones(B, device=w.other)))


@case("MaskedBranch/SyncBatchNorm in a branch", ValueError, r"^branches\[1\]\.1 is a SyncBatchNorm, which runs collectives.*Use nn\.BatchNorm")
def _(w):
    m = w.track(MaskedBranch([bn_branch(), nn.Sequential(nn.Linear(D, D), nn.SyncBatchNorm(D))]).to(w.device))
    return lambda: m(w.x, w.ids.clamp(max=1))


@case("MaskedBranch/SyncBatchNorm converted after a first call", ValueError, r"^branches\[0\]\.1 is a SyncBatchNorm")
def _(w):
    m = MaskedBranch([bn_branch(), bn_branch()]).to(w.device)
    m(w.x.detach(), 1)
    m = w.track(nn.SyncBatchNorm.convert_sync_batchnorm(m))
    torch.optim.SGD(m.parameters(), lr=0.1).step()  # caches are checked in depth after each step
    return lambda: m(w.x, 0)


@case("MaskedBranch/branches with different trailing shapes", ValueError,
      r"^branches\[1\] returns rows of shape \[5\].*branches\[0\] rows of shape \[4\].*every branch must return the same trailing shape and dtype", ran=True)
def _(w):
    m = w.track(MaskedBranch([Branch(D, 4), Branch(D, 5), Branch(D, 4)]).to(w.device))
    return lambda: m(w.x, w.ids)


@case("MaskedBranch/branches with different dtypes", ValueError, r"^branches\[1\] returns rows of shape \[4\] and dtype torch\.float64", ran=True)
def _(w):
    m = w.track(MaskedBranch([Branch(), Returns(lambda y: y.double()), Branch()]).to(w.device))
    return lambda: m(w.x, w.ids)


@case("MaskedBranch/a branch dropping rows", ValueError,
      r"^branches\[1\]: the branch was given 2 rows and returned shape \(1, 4\); a branch must return one row per input row", ran=True)
def _(w):
    m = w.track(MaskedBranch([Branch(), Returns(lambda y: y[:1]), Branch()]).to(w.device))
    return lambda: m(w.x, w.ids)


@case("MaskedBranch/a branch returning a tuple (int gate, zeros to tie)", TypeError,
      r"^branches\[0\]: expected the branch to return a tensor, got tuple", ran=True)
def _(w):
    # An int gate returns what the branch returns (if/else); a tie into it needs a tensor.
    m = w.track(MaskedBranch([Returns(lambda y: (y,)), Branch()], materialize_grads="zeros").to(w.device))
    return lambda: m(w.x, 0)


# -- masked_branch ---------------------------------------------------------------------------------

call("masked_branch/branches an int", TypeError, r"^branches: expected an iterable of nn\.Module, got int", lambda w: masked_branch(3, w.x, 0))
call("masked_branch/empty branch list", ValueError, r"^branches: expected at least one branch, got none", lambda w: masked_branch([], w.x, 0))
call("masked_branch/a branch that is not callable", TypeError, r"^branches\[1\]: expected a callable, got int",
      lambda w: masked_branch([torch.sin, 3], w.x, 0))
call("masked_branch/SyncBatchNorm in a branch", ValueError, r"^branches\[0\] is a SyncBatchNorm, which runs collectives",
      lambda w: masked_branch([nn.SyncBatchNorm(D), torch.sin], w.x, 1))
call("masked_branch/mask of the wrong shape", ValueError, r"^gate: expected shape \[6, 2\] \(rows of x, branches\), got \(6, 3\)",
      lambda w: masked_branch([torch.sin, torch.cos], w.x, w.weights != 0))
call("masked_branch/functions with different outputs", ValueError, r"^branches\[1\] returns rows of shape \[2\]",
      lambda w: masked_branch([torch.sin, lambda t: t[:, :2]], w.x, w.ids.clamp(max=1)))

# -- drop_path / DropPath --------------------------------------------------------------------------

for _p in (-0.1, 1.5, float("nan"), float("inf")):
    call(f"drop_path/drop_prob={_p}", ValueError, rf"^drop_prob: expected a probability in \[0, 1\], got {_p}",
          functools.partial(lambda w, p: drop_path(w.x, p, True, generator=w.gen), p=_p))
call("drop_path/drop_prob a string", TypeError, r"^drop_prob: expected a number in \[0, 1\], got str",
      lambda w: drop_path(w.x, "0.5", True, generator=w.gen))
call("drop_path/drop_prob a bool", TypeError, r"^drop_prob: expected a number in \[0, 1\], got bool",
      lambda w: drop_path(w.x, True, True, generator=w.gen))
call("drop_path/drop_prob a tensor of two", ValueError, r"^drop_prob: expected a number in \[0, 1\], got a tensor of shape \(2,\)",
      lambda w: drop_path(w.x, torch.tensor([0.1, 0.2]), True, generator=w.gen))
call("drop_path/unknown mode", ValueError, r"^mode: expected 'row' \(drop per sample\) or 'batch' \(drop the whole batch\), got 'sample'",
      lambda w: drop_path(w.x, 0.5, True, mode="sample", generator=w.gen))
call("drop_path/generator on a GPU", ValueError, r"^generator: expected a CPU torch\.Generator, got one on cuda",
      lambda w: drop_path(w.x, 0.5, True, generator=cuda_generator()))
call("drop_path/generator not a generator", TypeError, r"^generator: expected a CPU torch\.Generator or None, got int",
      lambda w: drop_path(w.x, 0.5, True, generator=123))
call("drop_path/x 0-d", ValueError, r"^x: expected at least one dimension", lambda w: drop_path(w.tensor(1.0), 0.5, True, generator=w.gen))
call("drop_path/integer x", TypeError, r"^x: expected a floating-point tensor.*got dtype torch\.int64",
      lambda w: drop_path(torch.ones(B, D, dtype=torch.long, device=w.device), 0.5, True, generator=w.gen))
call("DropPath/drop_prob outside [0, 1]", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got 2", lambda w: DropPath(2))
call("DropPath/unknown mode", ValueError, r"^mode: expected 'row' .* or 'batch' .*, got None", lambda w: DropPath(0.5, mode=None))
call("DropPath/generator a string", TypeError, r"^generator: expected a CPU torch\.Generator or None, got str",
      lambda w: DropPath(0.5, generator="cpu"))


@case("DropPath/drop_prob set outside [0, 1] after construction", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got -0\.5")
def _(w):
    m = w.track(DropPath(0.5, generator=torch.Generator().manual_seed(9)).train())
    m.drop_prob = -0.5  # as a drop-path schedule might
    return lambda: m(w.x)


@case("DropPath/mode set to an unknown value after construction", ValueError, r"^mode: expected 'row' .* or 'batch' .*, got 'Batch'")
def _(w):
    m = w.track(DropPath(0.5, generator=torch.Generator().manual_seed(9)).train())
    m.mode = "Batch"
    return lambda: m(w.x)


# -- drop_add_residual / ResidualDropPath ----------------------------------------------------------

call("drop_add_residual/branch not callable", TypeError, r"^branch: expected a callable \(a module or a function\), got str",
      lambda w: drop_add_residual(w.x, "mlp", 0.5, True, generator=w.gen))
call("drop_add_residual/drop_prob=1.01", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got 1\.01",
      lambda w: drop_add_residual(w.x, w.res.branch, 1.01, True, generator=w.gen))
call("drop_add_residual/unknown mode", ValueError, r"^mode: expected 'row' .* or 'batch' .*, got 'layer'",
      lambda w: drop_add_residual(w.x, w.res.branch, 0.5, True, mode="layer", generator=w.gen))
call("drop_add_residual/generator on a GPU", ValueError, r"^generator: expected a CPU torch\.Generator, got one on cuda",
      lambda w: drop_add_residual(w.x, w.res.branch, 0.5, True, generator=cuda_generator()))
call("drop_add_residual/integer x", TypeError, r"^x: expected a floating-point tensor.*got dtype torch\.int32",
      lambda w: drop_add_residual(torch.ones(B, D, dtype=torch.int32, device=w.device), torch.neg, 0.5, True, generator=w.gen))
call("drop_add_residual/per-row argument on another device", ValueError, r"^args\[0\]: a per-row argument \(first dimension 6, routed with x\) must live on x's device",
      lambda w: drop_add_residual(w.x, w.res.branch, 0.5, True, generator=w.gen, args=(torch.ones(B, 2, device=w.other),)))
case("drop_add_residual/SyncBatchNorm in the branch", ValueError, r"^branch\.1 is a SyncBatchNorm, which runs collectives")(
    lambda w: functools.partial(drop_add_residual, w.x, nn.Sequential(nn.Linear(D, D), nn.SyncBatchNorm(D)).to(w.device), 0.5, True, generator=w.gen)
)
call("ResidualDropPath/branch a function", TypeError, r"^branch: expected an nn\.Module, got function", lambda w: ResidualDropPath(lambda t: t, 0.5))
call("ResidualDropPath/drop_prob a list", TypeError, r"^drop_prob: expected a number in \[0, 1\], got list",
      lambda w: ResidualDropPath(nn.Identity(), [0.5]))
call("ResidualDropPath/generator on a GPU", ValueError, r"^generator: expected a CPU torch\.Generator, got one on cuda",
      lambda w: ResidualDropPath(nn.Identity(), 0.5, generator=cuda_generator()))
call("ResidualDropPath/materialize_grads an int", TypeError, r"^materialize_grads: expected 'auto' \(None\), 'zeros' \(True\) or 'none' \(False\), got 1",
      lambda w: ResidualDropPath(nn.Identity(), 0.5, materialize_grads=1))
call("ResidualDropPath/x not a tensor", TypeError, r"^x: expected a tensor, got list", lambda w: w.res([[1.0] * D] * B))
call("ResidualDropPath/per-row keyword argument on another device", ValueError, r"^mask: a per-row argument \(first dimension 6, routed with x\) must live on x's device",
      lambda w: w.res(w.x, mask=torch.ones(B, device=w.other)))


@case("drop_add_residual/a branch dropping rows", ValueError, r"^branch: a residual branch must return a tensor shaped like its input rows \(\d+, 4\), got \(1, 4\)", ran=True)
def _(w):
    g = torch.Generator().manual_seed(5)
    return lambda: drop_add_residual(w.x, lambda t: t[:1] * 2, 0.5, True, generator=g)


@case("drop_add_residual/a branch dropping rows, nothing dropped", ValueError, r"^branch: a residual branch must return a tensor shaped like its input rows \(6, 4\), got \(1, 4\)", ran=True)
def _(w):
    g = torch.Generator().manual_seed(5)
    return lambda: drop_add_residual(w.x, lambda t: t[:1] * 2, 1e-9, True, generator=g)  # broadcasting must not hide it


@case("ResidualDropPath/drop_prob set outside [0, 1] after construction", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got -1")
def _(w):
    m = w.track(ResidualDropPath(Branch(), 0.5, generator=torch.Generator().manual_seed(6)).to(w.device))
    m.drop_prob = -1
    return lambda: m(w.x)


@case("ResidualDropPath/SyncBatchNorm converted after construction", ValueError, r"^branch\.1 is a SyncBatchNorm, which runs collectives.*Use nn\.BatchNorm")
def _(w):
    m = ResidualDropPath(bn_branch(), 0.5, generator=torch.Generator().manual_seed(7)).to(w.device)
    m = w.track(nn.SyncBatchNorm.convert_sync_batchnorm(m))
    return lambda: m(w.x)


@case("ResidualDropPath/a branch changing the trailing shape", ValueError, r"^branch: a residual branch must return a tensor shaped like its input rows \(\d+, 4\), got \(\d+, 3\)", ran=True)
def _(w):
    m = w.track(ResidualDropPath(Branch(D, 3), 0.5, generator=torch.Generator().manual_seed(8)).to(w.device))
    return lambda: m(w.x)


# -- make_plan, gather, combine, tie --------------------------------------------------------------

call("make_plan/gate a list", TypeError, r"^gate: expected a tensor, got list", lambda w: mb.make_plan(IDS, N))
call("make_plan/num_branches 0", ValueError, r"^num_branches: expected at least 1 branch, got 0", lambda w: mb.make_plan(w.ids, 0))
call("make_plan/id out of range", IndexError, r"^gate: branch id 2 at row 3 is out of range", lambda w: mb.make_plan(w.ids, 2))
call("make_plan/-inf weight", ValueError, r"^gate: weight -inf at row 1, branch 0 is not finite",
      lambda w: mb.make_plan(w.tensor([[1.0, 0.0], [-float("inf"), 0.0]]), 2))
call("gather/x not a tensor", TypeError, r"^x: expected a tensor, got list", lambda w: mb.gather([[1.0] * D] * B, w.plan))
call("gather/plan not a plan", TypeError, r"^plan: expected a maskedbranch\.Plan \(from make_plan\), got tuple",
      lambda w: mb.gather(w.x, tuple(w.plan)[1:]))
call("gather/bool x", TypeError, r"^x: expected float64, float32, float16 or bfloat16", lambda w: mb.gather(w.x > 0, w.plan))
call("gather/x on another device than the plan", ValueError, r"^rows: expected a tensor on \S+ like x, got one on",
      lambda w: mb.gather(w.x.detach().to(w.other), w.plan))
call("combine/more outputs than branches", ValueError, r"^ys: expected one output per branch \(3\), got 4",
      lambda w: mb.combine(w.ys + [w.ys[0]], w.plan))
call("combine/an output with the wrong rows", ValueError, r"^ys\[1\]: branch 1 was given 2 rows but returned shape \(3, 4\)",
      lambda w: mb.combine([w.ys[0], torch.ones(3, D, device=w.device), w.ys[2]], w.plan))
call("combine/integer outputs", TypeError, r"^ys\[0\]: expected float64, float32, float16 or bfloat16",
      lambda w: mb.combine([y.long() for y in w.ys], w.plan))
call("combine/outputs on two devices", ValueError, r"^ys\[1\]: expected a tensor on \S+ like ys\[0\], got one on",
      lambda w: mb.combine([w.ys[0], w.ys[1].to(w.other), w.ys[2]], w.plan))
call("combine/weights on another device", ValueError, r"^weights: expected a tensor on \S+ like ys\[0\], got one on",
      lambda w: mb.combine(w.ys, w.plan, weights=torch.ones(B, N, device=w.other)))
call("combine/1-D weights", ValueError, r"^weights: expected shape \[6, 3\], got \[6\]",
      lambda w: mb.combine(w.ys, w.plan, weights=torch.ones(B, device=w.device)))
call("combine/base with other rows", ValueError, r"^base: the plan is for 6 rows but base has 5",
      lambda w: mb.combine(w.ys, w.plan, base=torch.ones(B - 1, D, device=w.device)))
call("tie/params not tensors", TypeError, r"^params\[1\]: expected a tensor, got int", lambda w: mb.tie(w.x, [w.mb[0].lin.weight, 2]))
call("tie/x not a tensor", TypeError, r"^x: expected a tensor, got list", lambda w: mb.tie([1.0], list(w.mb.parameters())))


@functools.lru_cache(maxsize=None)
def pristine(device: str) -> Dict[str, Any]:
    return World(device).good()


@pytest.mark.parametrize("setup,exc,match,ran", CASES)
def test_bad_input(setup, exc, match, ran, device):
    w = World(device)
    bad = setup(w)
    before = w.snapshot()
    for _ in range(2):  # a failing call consumes nothing: the retry fails the same way
        with pytest.raises(exc, match=match) as info:
            bad()
        assert "\n  File " not in str(info.value)  # the message is the argument's, not internals
    if device == "cuda":
        torch.cuda.synchronize()  # raises if a device-side assert fired
    after = w.snapshot()
    for key in before:
        if ran and key.startswith("extra") and key.endswith((".state", ".drop")):
            for name, v in before[key].items() if key.endswith(".state") else ():
                if v.is_floating_point():  # the branch ran: its counter moved, its parameters not
                    assert_equal(v, after[key][name], f"{key}[{name}]")
            continue
        assert_equal(before[key], after[key], key)
    assert_equal(pristine(device), w.good(), "good calls after the bad one")
