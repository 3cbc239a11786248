"""The bad-input matrix: every public entry point (modules, functional forms, ops) fed wrong ranks
and shapes, wrong dtypes, mixed devices, out-of-range ids, non-finite gates, bad branch lists,
collectives inside a branch, bad drop probabilities, modes and generators.

Every case must
* raise a Python exception of the expected type whose message names the argument and the
  expected form (the regex below);
* raise again when repeated (no state consumed by the failing call);
* leave everything untouched: module state_dicts (parameters and buffers, so no branch ran),
  no ``.grad`` created, the modules' internal caches, the generators' and torch's RNG states,
  the plan and input tensors;
* leave the library usable: a sequence of good calls afterwards (every module, functional form
  and op, forward and backward) gives results bitwise identical to those of a fresh set of
  objects that never saw the bad call.

The CUDA variant runs the same matrix with every tensor on the GPU and also checks that no
device-side assert fired (the context stays usable); it skips without a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from torch import Tensor, nn

import maskedbranch as mb
from maskedbranch import DropPath, MaskedBranch, ResidualDropPath, drop_add_residual, drop_path, masked_branch

from devices import DEVICES

B, D, N = 6, 4, 3
IDS = [0, 1, -1, 2, 0, 1]


class Branch(nn.Module):
    """A row-wise branch that counts its real calls in a buffer, so that a state_dict comparison
    also tells whether a failing call ran it. Extra arguments are accepted and ignored."""

    def __init__(self, d_in: int = D, d_out: int = D, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, dtype=dtype)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        with torch.no_grad():
            self.calls += 1
        return self.lin(x)


class Returns(nn.Module):
    """A branch returning ``fn(x)``: wrong rows, a tuple, another dtype."""

    def __init__(self, fn: Callable[[Tensor], Any]):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fn = fn

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.lin(x))


def bn_branch() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D))


class FakeCudaGenerator(torch.Generator):
    """A CPU generator that claims to live on a GPU (stands in for torch.Generator('cuda'))."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


# ----------------------------------------------------------------------------------------------
# A world: fresh objects every case works on, a snapshot of everything a failing call must not
# touch, and the good calls that must still work afterwards.


class World:
    def __init__(self, device: str):
        self.device = torch.device(device)
        # "another device" for mixed-device inputs: meta next to CPU tensors, the host next to
        # GPU ones (a CPU *gate* is legal with GPU x, so gates use meta on both)
        self.other = "meta" if self.device.type == "cpu" else "cpu"
        torch.manual_seed(0)
        self.mb = MaskedBranch([Branch() for _ in range(N)]).to(self.device)
        self.res = ResidualDropPath(Branch(), 0.5, generator=torch.Generator().manual_seed(2)).to(self.device)
        self.drop = DropPath(0.5, generator=torch.Generator().manual_seed(3))
        self.gen = torch.Generator().manual_seed(4)
        self.x = torch.randn(B, D, device=self.device, requires_grad=True)
        self.weights = torch.tensor(
            [[0.5, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.25, 0.0, 0.0], [0.0, 0.0, 3.0]],
            device=self.device,
            requires_grad=True,
        )
        self.ids = torch.tensor(IDS, device=self.device)
        self.plan = mb.make_plan(torch.tensor(IDS), N, device=self.device)
        self.packed = torch.randn(self.plan.num_entries, D, device=self.device)
        self.ys = mb.split_packed(self.packed, self.plan)
        self.extra: List[Any] = []  # objects a case made for itself

    def track(self, obj):
        self.extra.append(obj)
        return obj

    def tensor(self, data, **kw) -> Tensor:
        return torch.tensor(data, device=self.device, **kw)

    # -- everything a failing call must leave untouched ----------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        snap: Dict[str, Any] = {"rng": torch.get_rng_state(), "gen": self.gen.get_state()}
        modules = [("mb", self.mb), ("res", self.res), ("drop", self.drop)]
        modules += [(f"extra{i}", m) for i, m in enumerate(self.extra) if isinstance(m, nn.Module)]
        for name, m in modules:
            snap[name + ".state"] = {k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()}
            snap[name + ".grads"] = [n for n, p in m.named_parameters() if p.grad is not None]
            snap[name + ".training"] = [s.training for s in m.modules()]
            if isinstance(m, MaskedBranch):
                sig = m._signatures
                snap[name + ".signatures"] = (sig.first_call, list(sig.table.items()))
            if isinstance(m, (DropPath, ResidualDropPath)):
                g = m.generator
                snap[name + ".drop"] = (m.drop_prob, m.mode, m.scale_by_keep, None if g is None else g.get_state())
        snap["x"] = (self.x.detach().clone(), self.x.grad)
        snap["weights"] = (self.weights.detach().clone(), self.weights.grad)
        snap["plan"] = [t.clone() for t in self.plan[1:]] + [list(self.plan.counts)]
        snap["packed"] = self.packed.clone()
        return snap

    # -- good calls: every module, functional form and op, forward and backward ---------------
    def good(self) -> Dict[str, Tensor]:
        x, dev = self.x, self.device
        outs = {
            "mb.ids": self.mb(x, self.ids),
            "mb.host_ids": self.mb(x, torch.tensor(IDS)),
            "mb.int": self.mb(x, 2),
            "mb.none": self.mb(x, -1),
            "mb.mask": self.mb(x, self.weights != 0),
            "mb.weights": self.mb(x, self.weights),
            "res": self.res(x),
            "drop": self.drop(x),
            "masked_branch": masked_branch(list(self.mb.branches), x, self.ids),
            "drop_path": drop_path(x, 0.4, True, generator=self.gen),
            "drop_path.batch": drop_path(x, 0.4, True, mode="batch", generator=self.gen),
            "drop_add_residual": drop_add_residual(x, self.res.branch, 0.4, True, generator=self.gen),
        }
        plan = mb.make_plan(self.ids, N)
        ys = [y * (i + 1) for i, y in enumerate(mb.split_packed(mb.gather(x, plan), plan))]
        outs["ops.combine"] = mb.combine(ys, plan, weights=self.weights, base=x)
        outs["ops.drop_path_scale"] = mb.drop_path_scale(x, torch.linspace(0, 1, B, device=dev), base=x)
        outs["ops.anchor"] = mb.anchor(x * 2, list(self.mb.parameters()))
        sum(o.float().square().sum() for o in outs.values()).backward()
        result = {k: v.detach() for k, v in outs.items()}
        result["x.grad"] = x.grad
        result["weights.grad"] = self.weights.grad
        for name, m in [("mb", self.mb), ("res", self.res)]:
            for k, p in m.named_parameters():
                result[f"{name}.{k}.grad"] = p.grad
            for k, v in m.state_dict().items():
                result[f"{name}.{k}"] = v
        result["gen"] = self.gen.get_state()
        return result


def assert_same_snapshot(before: Dict[str, Any], after: Dict[str, Any], ran: bool) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if ran and key.endswith((".state", ".drop")) and key.startswith("extra"):
            # detected only once a branch ran: its buffers and the mask draw may have moved,
            # as in the plain model that fails at the same place; parameters are checked below
            continue
        _assert_equal(before[key], after[key], key)
    if ran:
        for key in before:
            if key.endswith(".state") and key.startswith("extra"):
                for name, v in before[key].items():
                    if v.is_floating_point():
                        _assert_equal(v, after[key][name], f"{key}[{name}]")


def _assert_equal(a, b, where: str) -> None:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        assert isinstance(a, Tensor) and isinstance(b, Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_equal(u, v, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ----------------------------------------------------------------------------------------------
# The matrix. setup(world) returns the bad call; objects it creates for itself are tracked.


@dataclasses.dataclass
class Case:
    id: str
    setup: Callable[[World], Callable[[], Any]]
    exc: type
    match: str
    ran: bool = False  # detected only after a branch ran (see assert_same_snapshot)
    cpu_only: bool = False  # nothing device-specific about it


CASES: List[Case] = []


def case(id: str, exc: type, match: str, **kw):
    def register(setup):
        CASES.append(Case(id, setup, exc, match, **kw))
        return setup

    return register


# -- MaskedBranch: construction ------------------------------------------------------------------

case("MaskedBranch/empty branch list", ValueError, r"^branches: expected at least one branch, got none", cpu_only=True)(
    lambda w: lambda: MaskedBranch([])
)
case("MaskedBranch/a single module", TypeError, r"^branches: expected an iterable of nn\.Module .*got a single Linear", cpu_only=True)(
    lambda w: functools.partial(MaskedBranch, nn.Linear(D, D))  # arguments built before the call
)
case("MaskedBranch/a function among modules", TypeError, r"^branches\[1\]: expected an nn\.Module, got builtin_function", cpu_only=True)(
    lambda w: functools.partial(MaskedBranch, [nn.Linear(D, D), torch.sin])
)
case("MaskedBranch/SyncBatchNorm in a branch", ValueError, r"^branches: branches\[1\]\.1 is a SyncBatchNorm.*Use nn\.BatchNorm", cpu_only=True)(
    lambda w: functools.partial(MaskedBranch, [nn.Linear(D, D), nn.Sequential(nn.Linear(D, D), nn.SyncBatchNorm(D))])
)


@case("MaskedBranch/SyncBatchNorm converted after construction", ValueError, r"^branches: branches\[0\]\.1 is a SyncBatchNorm")
def _(w):
    m = w.track(nn.SyncBatchNorm.convert_sync_batchnorm(MaskedBranch([bn_branch(), bn_branch()]).to(w.device)))
    return lambda: m(w.x, w.ids[:B].clamp(max=1))


# -- MaskedBranch: x and gate ----------------------------------------------------------------------

case("MaskedBranch/x not a tensor", TypeError, r"^x: expected a tensor, got list")(lambda w: lambda: w.mb([[1.0] * D] * B, 0))
case("MaskedBranch/x 0-d", ValueError, r"^x: expected at least one dimension")(lambda w: lambda: w.mb(w.tensor(1.0), 0))
case("MaskedBranch/gate a bool", TypeError, r"^gate: got a bool; pass an int branch id, an integer tensor \[B\] of ids or a bool tensor \[B, 3\]")(
    lambda w: lambda: w.mb(w.x, True)
)
case("MaskedBranch/gate None", TypeError, r"^gate: expected an int branch id, an integer tensor \[B\] of branch ids or a bool/floating tensor \[B, 3\], got NoneType")(
    lambda w: lambda: w.mb(w.x, None)
)
case("MaskedBranch/gate a float", TypeError, r"^gate: expected an int branch id.*got float")(lambda w: lambda: w.mb(w.x, 1.0))
case("MaskedBranch/int gate out of range", IndexError, r"^gate: branch id 3 is out of range; expected -1 \(no branch\) to 2")(
    lambda w: lambda: w.mb(w.x, 3)
)
case("MaskedBranch/int gate below -1", IndexError, r"^gate: branch id -2 is out of range; expected -1 \(no branch\) to 2")(
    lambda w: lambda: w.mb(w.x, -2)
)
case("MaskedBranch/0-d float gate", TypeError, r"^gate: a 0-d gate must be an integer branch id, got dtype torch\.float32")(
    lambda w: lambda: w.mb(w.x, w.tensor(1.0))
)
case("MaskedBranch/float ids", TypeError, r"^gate: a 1-D gate holds one integer branch id per row \(-1 = no branch\), got dtype torch\.float32")(
    lambda w: lambda: w.mb(w.x, w.ids.float())
)
case("MaskedBranch/1-D bool gate", TypeError, r"^gate: a 1-D gate holds one integer branch id.*; for a mask use shape \[B, 3\]")(
    lambda w: lambda: w.mb(w.x, w.ids >= 0)
)
case("MaskedBranch/ids of the wrong length", ValueError, r"^gate: expected 6 branch ids \(one per row of x\), got shape \(5,\)")(
    lambda w: lambda: w.mb(w.x, w.ids[:5])
)
case("MaskedBranch/id out of range", IndexError, r"^gate: branch id 3 at row 4 is out of range; expected -1 \(no branch\) to 2")(
    lambda w: lambda: w.mb(w.x, w.tensor([0, 1, -1, 2, 3, 1]))
)
case("MaskedBranch/id below -1", IndexError, r"^gate: branch id -2 at row 0 is out of range; expected -1 \(no branch\) to 2")(
    lambda w: lambda: w.mb(w.x, w.tensor([-2, 1, -1, 2, 0, 1]))
)
case("MaskedBranch/uint8 id 255", IndexError, r"^gate: branch id 255 at row 1 is out of range; expected -1 \(no branch\) to 2")(
    lambda w: lambda: w.mb(w.x, w.tensor([0, 255, 0, 1, 2, 0], dtype=torch.uint8))
)
case("MaskedBranch/int32 id out of range on a 0-d device tensor", IndexError, r"^gate: branch id 7 .*out of range; expected -1 \(no branch\) to 2")(
    lambda w: lambda: w.mb(w.x, w.tensor(7, dtype=torch.int32))
)
case("MaskedBranch/mask with the wrong number of branches", ValueError, r"^gate: expected shape \[6, 3\] \(rows of x, branches\), got \(6, 4\)")(
    lambda w: lambda: w.mb(w.x, torch.ones(B, N + 1, dtype=torch.bool, device=w.device))
)
case("MaskedBranch/weights with the wrong number of rows", ValueError, r"^gate: expected shape \[6, 3\] \(rows of x, branches\), got \(7, 3\)")(
    lambda w: lambda: w.mb(w.x, torch.ones(B + 1, N, device=w.device))
)
case("MaskedBranch/integer weights", TypeError, r"^gate: a 2-D gate must be bool \(a mask\) or floating \(weights\), got dtype torch\.int64")(
    lambda w: lambda: w.mb(w.x, torch.ones(B, N, dtype=torch.long, device=w.device))
)
case("MaskedBranch/3-D gate", ValueError, r"^gate: expected an int, branch ids \[B\] or a mask/weights \[B, 3\], got shape \(6, 3, 1\)")(
    lambda w: lambda: w.mb(w.x, torch.ones(B, N, 1, device=w.device))
)
case("MaskedBranch/complex gate", TypeError, r"^gate: complex gates are not supported, got dtype torch\.complex64")(
    lambda w: lambda: w.mb(w.x, torch.ones(B, N, dtype=torch.complex64, device=w.device))
)
case("MaskedBranch/NaN gate weight", ValueError, r"^gate: weight nan at row 2, branch 1 is not finite")(
    lambda w: lambda: w.mb(w.x, w.weights.detach().index_put((w.tensor(2), w.tensor(1)), w.tensor(float("nan"))))
)
case("MaskedBranch/inf gate weight", ValueError, r"^gate: weight inf at row 0, branch 0 is not finite")(
    lambda w: lambda: w.mb(w.x, torch.full((B, N), float("inf"), device=w.device))
)
case("MaskedBranch/-inf gate weight (float64)", ValueError, r"^gate: weight -inf at row 5, branch 2 is not finite")(
    lambda w: lambda: w.mb(w.x, w.weights.detach().double().index_put((w.tensor(5), w.tensor(2)), w.tensor(-float("inf"), dtype=torch.float64)))
)
case("MaskedBranch/gate on another device", ValueError, r"^gate: expected a CPU tensor or one on (cpu|cuda:0), got one on meta")(
    lambda w: lambda: w.mb(w.x, w.ids.to("meta"))
)
case("MaskedBranch/per-row argument on another device", ValueError, r"^args\[0\]: a per-row argument \(first dimension 6, routed with x\) must live on x's device")(
    lambda w: lambda: w.mb(w.x, w.ids, torch.ones(B, 2, device=w.other))
)
case("MaskedBranch/per-row keyword argument on another device", ValueError, r"^mask: a per-row argument \(first dimension 6, routed with x\) must live on x's device")(
    lambda w: lambda: w.mb(w.x, w.ids, mask=torch.ones(B, device=w.other))
)


# -- MaskedBranch: branches whose outputs do not fit -----------------------------------------------


@case("MaskedBranch/branches with different trailing shapes", ValueError,
      r"^branches: the outputs disagree: branches\[1\] returns rows of shape \[5\].*branches\[0\] rows of shape \[4\].*every branch must return the same trailing shape and dtype",
      ran=True)
def _(w):
    m = w.track(MaskedBranch([Branch(D, 4), Branch(D, 5), Branch(D, 4)]).to(w.device))
    return lambda: m(w.x, w.ids)


@case("MaskedBranch/a branch with another trailing shape, found on the first call by the meta probe", ValueError,
      r"^branches: the outputs disagree: branches\[2\] returns rows of shape \[5\]", ran=True)
def _(w):
    m = w.track(MaskedBranch([Branch(D, 4), Branch(D, 4), Branch(D, 5)]).to(w.device))
    return lambda: m(w.x, 0)  # branch 2 gets no rows: only the first-call probe can see it


@case("MaskedBranch/branches with different dtypes", ValueError,
      r"^branches: the outputs disagree: branches\[1\] returns rows of shape \[4\] and dtype torch\.float64", ran=True)
def _(w):
    m = w.track(MaskedBranch([Branch(), Returns(lambda y: y.double()), Branch()]).to(w.device))
    return lambda: m(w.x, w.ids)


@case("MaskedBranch/a branch dropping rows", ValueError,
      r"^branches\[1\]: the branch was given 2 rows and returned shape \(1, 4\); a branch must return one row per input row", ran=True)
def _(w):
    m = w.track(MaskedBranch([Branch(), Returns(lambda y: y[:1]), Branch()]).to(w.device))
    return lambda: m(w.x, w.ids)


@case("MaskedBranch/a branch returning a tuple", TypeError, r"^branches\[0\]: expected the branch to return a tensor, got tuple", ran=True)
def _(w):
    m = w.track(MaskedBranch([Returns(lambda y: (y,)), Branch()]).to(w.device))
    return lambda: m(w.x, 0)


# -- masked_branch (functional) ---------------------------------------------------------------------

case("masked_branch/branches an int", TypeError, r"^branches: expected an iterable of nn\.Module, got int")(
    lambda w: lambda: masked_branch(3, w.x, 0)
)
case("masked_branch/empty branch list", ValueError, r"^branches: expected at least one branch, got none")(
    lambda w: lambda: masked_branch([], w.x, 0)
)
case("masked_branch/a branch that is not callable", TypeError, r"^branches\[1\]: expected a callable, got int")(
    lambda w: lambda: masked_branch([torch.sin, 3], w.x, 0)
)
case("masked_branch/SyncBatchNorm in a branch", ValueError, r"^branches: branches\[0\] is a SyncBatchNorm, which runs collectives")(
    lambda w: lambda: masked_branch([nn.SyncBatchNorm(D), torch.sin], w.x, 1)
)
case("masked_branch/mask of the wrong shape", ValueError, r"^gate: expected shape \[6, 2\] \(rows of x, branches\), got \(6, 3\)")(
    lambda w: lambda: masked_branch([torch.sin, torch.cos], w.x, w.weights != 0)
)
case("masked_branch/functions with different outputs", ValueError, r"^branches: the outputs disagree: branches\[1\] returns rows of shape \[2\]")(
    lambda w: lambda: masked_branch([torch.sin, lambda t: t[:, :2]], w.x, w.ids.clamp(max=1))
)


# -- drop_path / DropPath ---------------------------------------------------------------------------

for _p in (-0.1, 1.5, float("nan"), float("inf")):
    case(f"drop_path/drop_prob={_p}", ValueError, rf"^drop_prob: expected a probability in \[0, 1\], got {_p}")(
        functools.partial(lambda w, p: lambda: drop_path(w.x, p, True, generator=w.gen), p=_p)
    )
case("drop_path/drop_prob a string", TypeError, r"^drop_prob: expected a number in \[0, 1\], got str")(
    lambda w: lambda: drop_path(w.x, "0.5", True, generator=w.gen)
)
case("drop_path/drop_prob a tensor of two", ValueError, r"^drop_prob: expected a number in \[0, 1\], got a tensor of shape \(2,\)")(
    lambda w: lambda: drop_path(w.x, torch.tensor([0.1, 0.2]), True, generator=w.gen)
)
case("drop_path/unknown mode", ValueError, r"^mode: expected 'row' \(drop per sample\) or 'batch' \(drop the whole batch\), got 'sample'")(
    lambda w: lambda: drop_path(w.x, 0.5, True, mode="sample", generator=w.gen)
)
case("drop_path/generator on a GPU", ValueError, r"^generator: expected a CPU torch\.Generator, got one on cuda")(
    lambda w: lambda: drop_path(w.x, 0.5, True, generator=cuda_generator())
)
case("drop_path/generator not a generator", TypeError, r"^generator: expected a CPU torch\.Generator or None, got int")(
    lambda w: lambda: drop_path(w.x, 0.5, True, generator=123)
)
case("drop_path/x 0-d", ValueError, r"^x: expected at least one dimension")(lambda w: lambda: drop_path(w.tensor(1.0), 0.5, True, generator=w.gen))
case("drop_path/integer x", TypeError, r"^x: expected a floating-point tensor.*got dtype torch\.int64")(
    lambda w: lambda: drop_path(torch.ones(B, D, dtype=torch.long, device=w.device), 0.5, True, generator=w.gen)
)
case("DropPath/drop_prob outside [0, 1] at construction", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got 2")(
    lambda w: lambda: DropPath(2)
)
case("DropPath/generator a string", TypeError, r"^generator: expected a CPU torch\.Generator or None, got str")(
    lambda w: lambda: DropPath(0.5, generator="cpu")
)


@case("DropPath/drop_prob set outside [0, 1] after construction", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got -0\.5")
def _(w):
    m = w.track(DropPath(0.5, generator=torch.Generator().manual_seed(9)))
    m.drop_prob = -0.5  # as a drop-path schedule might
    return lambda: m(w.x)


@case("DropPath/mode set to an unknown value after construction", ValueError, r"^mode: expected 'row' .* or 'batch' .*, got 'Batch'")
def _(w):
    m = w.track(DropPath(0.5, generator=torch.Generator().manual_seed(9)))
    m.mode = "Batch"
    return lambda: m(w.x)


# -- drop_add_residual / ResidualDropPath -----------------------------------------------------------

case("drop_add_residual/branch not callable", TypeError, r"^branch: expected a callable \(a module or a function\), got str")(
    lambda w: lambda: drop_add_residual(w.x, "mlp", 0.5, True, generator=w.gen)
)
case("drop_add_residual/drop_prob=1.01", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got 1\.01")(
    lambda w: lambda: drop_add_residual(w.x, w.res.branch, 1.01, True, generator=w.gen)
)
case("drop_add_residual/unknown mode", ValueError, r"^mode: expected 'row' .* or 'batch' .*, got 'layer'")(
    lambda w: lambda: drop_add_residual(w.x, w.res.branch, 0.5, True, "layer", generator=w.gen)
)
case("drop_add_residual/generator on a GPU", ValueError, r"^generator: expected a CPU torch\.Generator, got one on cuda")(
    lambda w: lambda: drop_add_residual(w.x, w.res.branch, 0.5, True, generator=cuda_generator())
)
case("drop_add_residual/integer x", TypeError, r"^x: expected a floating-point tensor.*got dtype torch\.int32")(
    lambda w: lambda: drop_add_residual(torch.ones(B, D, dtype=torch.int32, device=w.device), torch.neg, 0.5, True, generator=w.gen)
)
case("drop_add_residual/per-row argument on another device", ValueError, r"^args\[0\]: a per-row argument \(first dimension 6, routed with x\) must live on x's device")(
    lambda w: lambda: drop_add_residual(w.x, w.res.branch, 0.5, True, generator=w.gen, args=(torch.ones(B, 2, device=w.other),))
)


@case("drop_add_residual/a branch dropping rows", ValueError,
      r"^branch: a residual branch must return a tensor shaped like its input rows \(\d+, 4\), got \(1, 4\)", ran=True)
def _(w):
    g = w.track(torch.Generator().manual_seed(5))
    return lambda: drop_add_residual(w.x, lambda t: t[:1] * 2, 0.5, True, generator=g)


@case("drop_add_residual/a branch dropping rows, nothing dropped", ValueError,
      r"^branch: a residual branch must return a tensor shaped like its input rows \(6, 4\), got \(1, 4\)", ran=True)
def _(w):
    g = w.track(torch.Generator().manual_seed(5))
    return lambda: drop_add_residual(w.x, lambda t: t[:1] * 2, 1e-9, True, generator=g)  # broadcasting must not hide it


case("ResidualDropPath/branch a function", TypeError, r"^branch: expected an nn\.Module, got function")(
    lambda w: lambda: ResidualDropPath(lambda t: t, 0.5)
)
case("ResidualDropPath/drop_prob a list", TypeError, r"^drop_prob: expected a number in \[0, 1\], got list")(
    lambda w: lambda: ResidualDropPath(nn.Identity(), [0.5])
)
case("ResidualDropPath/generator on a GPU", ValueError, r"^generator: expected a CPU torch\.Generator, got one on cuda")(
    lambda w: lambda: ResidualDropPath(nn.Identity(), 0.5, generator=cuda_generator())
)
case("ResidualDropPath/x not a tensor", TypeError, r"^x: expected a tensor, got list")(lambda w: lambda: w.res([[1.0] * D] * B))
case("ResidualDropPath/per-row keyword argument on another device", ValueError, r"^mask: a per-row argument \(first dimension 6, routed with x\) must live on x's device")(
    lambda w: lambda: w.res(w.x, mask=torch.ones(B, device=w.other))
)


@case("ResidualDropPath/drop_prob set outside [0, 1] after construction", ValueError, r"^drop_prob: expected a probability in \[0, 1\], got -1")
def _(w):
    m = w.track(ResidualDropPath(Branch(), 0.5, generator=torch.Generator().manual_seed(6)).to(w.device))
    m.drop_prob = -1
    return lambda: m(w.x)


@case("ResidualDropPath/SyncBatchNorm converted after construction", RuntimeError,
      r"^ResidualDropPath: the branch contains SyncBatchNorm at '1', which runs collectives.*Use BatchNorm")
def _(w):
    m = w.track(nn.SyncBatchNorm.convert_sync_batchnorm(ResidualDropPath(bn_branch(), 0.5, generator=torch.Generator().manual_seed(7))).to(w.device))
    return lambda: m(w.x)


@case("ResidualDropPath/a branch changing the trailing shape", ValueError,
      r"^branch: a residual branch must return a tensor shaped like its input rows \(\d+, 4\), got \(\d+, 3\)", ran=True)
def _(w):
    m = w.track(ResidualDropPath(Branch(D, 3), 0.5, generator=torch.Generator().manual_seed(8)).to(w.device))
    return lambda: m(w.x)


# -- ops ----------------------------------------------------------------------------------------------

case("make_plan/gate a list", TypeError, r"^gate: expected a tensor, got list")(lambda w: lambda: mb.make_plan(IDS, N))
case("make_plan/num_branches negative", ValueError, r"^num_branches: expected at least 1 branch, got -3")(
    lambda w: lambda: mb.make_plan(w.ids, -3)
)
case("make_plan/-inf weight", ValueError, r"^gate: weight -inf at row 1, branch 0 is not finite")(
    lambda w: lambda: mb.make_plan(w.tensor([[1.0, 0.0], [-float("inf"), 0.0]]), 2)
)
case("gather/x not a tensor", TypeError, r"^x: expected a tensor, got list")(lambda w: lambda: mb.gather([[1.0] * D] * B, w.plan))
case("gather/x 0-d", ValueError, r"^x: expected at least one dimension")(lambda w: lambda: mb.gather(w.tensor(1.0), w.plan))
case("gather/bool x", TypeError, r"^x: expected float64, float32, float16 or bfloat16, got Bool")(lambda w: lambda: mb.gather(w.x > 0, w.plan))
case("gather/x on another device than the plan", ValueError, r"^rows: expected a tensor on \S+ like x, got one on")(
    lambda w: lambda: mb.gather(w.x.detach().to(w.other), w.plan)
)
case("combine/more outputs than branches", ValueError, r"^ys: expected one output per branch \(3\), got 4")(
    lambda w: lambda: mb.combine(w.ys + [w.ys[0]], w.plan)
)
case("combine/integer outputs", TypeError, r"^ys\[0\]: expected float64, float32, float16 or bfloat16, got Long")(
    lambda w: lambda: mb.combine([y.long() for y in w.ys], w.plan)
)
case("combine/outputs on two devices", ValueError, r"^ys\[1\]: expected a tensor on \S+ like ys\[0\], got one on")(
    lambda w: lambda: mb.combine([w.ys[0], w.ys[1].to(w.other), w.ys[2]], w.plan)
)
case("combine/weights on another device", ValueError, r"^weights: expected a tensor on \S+ like ys\[0\], got one on")(
    lambda w: lambda: mb.combine(w.ys, w.plan, weights=torch.ones(B, N, device=w.other))
)
case("combine/1-D weights", ValueError, r"^weights: expected shape \[6, 3\], got \[6\]")(
    lambda w: lambda: mb.combine(w.ys, w.plan, weights=torch.ones(B, device=w.device))
)
case("combine/base with other rows", ValueError, r"^base: the plan is for 6 rows but base has 5")(
    lambda w: lambda: mb.combine(w.ys, w.plan, base=torch.ones(B - 1, D, device=w.device))
)
case("drop_path_scale/integer scale", TypeError, r"^scale: expected float64, float32, float16 or bfloat16, got Long")(
    lambda w: lambda: mb.drop_path_scale(w.x, torch.ones(B, dtype=torch.long, device=w.device))
)
case("drop_path_scale/2-D scale", ValueError, r"^scale: expected shape \[6\] \(one factor per row of y\), got \[6, 1\]")(
    lambda w: lambda: mb.drop_path_scale(w.x, torch.ones(B, 1, device=w.device))
)
case("drop_path_scale/base in another dtype", TypeError, r"^base: expected dtype Float like y, got Double")(
    lambda w: lambda: mb.drop_path_scale(w.x, torch.ones(B, device=w.device), base=w.x.double())
)
case("drop_path_scale/scale on another device", ValueError, r"^scale: expected a tensor on \S+ like y, got one on")(
    lambda w: lambda: mb.drop_path_scale(w.x, torch.ones(B, device=w.other))
)
case("anchor/params not tensors", TypeError, r"^params\[1\]: expected a tensor, got int")(
    lambda w: lambda: mb.anchor(w.x, [w.mb.branches[0].lin.weight, 2])
)
case("anchor/x not a tensor", TypeError, r"^x: expected a tensor, got list")(
    lambda w: lambda: mb.anchor([1.0], list(w.mb.parameters()))
)


def cuda_generator() -> torch.Generator:
    return torch.Generator(device="cuda") if torch.cuda.is_available() else FakeCudaGenerator()


# ----------------------------------------------------------------------------------------------
# The tests.

def test_matrix_is_large_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 30
    entry_points = {i.split("/")[0] for i in ids}
    assert entry_points >= {
        "MaskedBranch", "masked_branch", "drop_path", "DropPath", "drop_add_residual", "ResidualDropPath",
        "make_plan", "gather", "combine", "drop_path_scale", "anchor",
    }


@functools.lru_cache(maxsize=None)
def _pristine(device: str) -> Dict[str, Tensor]:
    return World(device).good()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, device: str):
    if device == "cuda" and c.cpu_only:
        pytest.skip("nothing device-specific in this case")
    w = World(device)
    bad = c.setup(w)
    before = w.snapshot()
    for attempt in range(2):  # a failing call consumes nothing: the retry fails the same way
        with pytest.raises(c.exc, match=c.match) as info:
            bad()
        assert type(info.value) is c.exc or issubclass(type(info.value), c.exc)
        # the message is the argument's, not a traceback of internals
        assert "\n  File " not in str(info.value)
    if device == "cuda":
        torch.cuda.synchronize()  # raises if a device-side assert fired
        assert torch.ones(3, device="cuda").add_(1).sum().item() == 6.0
    assert_same_snapshot(before, w.snapshot(), c.ran)
    # the next good calls work and are unaffected
    _assert_equal(_pristine(device), w.good(), "good calls after the bad one")
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
def test_good_calls_are_reproducible(device):
    """The comparison above is meaningful: two fresh worlds agree bitwise, and the good calls do
    exercise every path (the gradients exist)."""
    a, b = World(device).good(), World(device).good()
    _assert_equal(a, b, "two fresh worlds")
    assert a["x.grad"] is not None and a["weights.grad"] is not None
    assert all(a[f"mb.branches.{i}.lin.weight.grad"] is not None for i in range(N))
