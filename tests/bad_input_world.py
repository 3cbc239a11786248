"""What tests/test_bad_inputs.py works on: fresh modules, inputs and plans for each case
(`World`), a snapshot of everything a failing call must leave untouched, the good calls that must
still work afterwards, and the branches the cases use."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
from torch import Tensor, nn

import maskedbranch as mb
from maskedbranch import DropPath, MaskedBranch, ResidualDropPath, drop_add_residual, drop_path, masked_branch

B, D, N = 6, 4, 3
IDS = [0, 1, -1, 2, 0, 1]



class Branch(nn.Module):
    """A row-wise branch that counts its calls in a buffer (a state_dict comparison then also
    tells whether a failing call ran it). Extra arguments are accepted and ignored."""

    def __init__(self, d_in: int = D, d_out: int = D):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        with torch.no_grad():
            self.calls += 1
        return self.lin(x)


class Returns(nn.Module):
    """A branch returning ``fn(lin(x))``: wrong rows, a tuple, another dtype."""

    def __init__(self, fn: Callable[[Tensor], Any]):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fn = fn

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.lin(x))


def bn_branch() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D))


class GpuGenerator(torch.Generator):
    """A CPU generator that says it lives on a GPU (torch.Generator('cuda') where none exists)."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


def cuda_generator() -> torch.Generator:
    return torch.Generator(device="cuda") if torch.cuda.is_available() else GpuGenerator()


class World:
    """Fresh objects a case works on, everything a failing call must leave untouched, and the
    good calls that must still work afterwards."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        # another device for mixed-device inputs: meta next to the CPU, the host next to a GPU
        # (a CPU gate is legal with a GPU x, so gates use meta on both)
        self.other = "meta" if self.device.type == "cpu" else "cpu"
        torch.manual_seed(0)
        self.mb = MaskedBranch([Branch() for _ in range(N)], materialize_grads=True).to(self.device)
        self.res = ResidualDropPath(Branch(), 0.5, generator=torch.Generator().manual_seed(2)).to(self.device)
        self.drop = DropPath(0.5, generator=torch.Generator().manual_seed(3))
        self.gen = torch.Generator().manual_seed(4)
        self.x = torch.randn(B, D, device=self.device, requires_grad=True)
        w = [[0.5, 0, 1], [0, 2, 0], [0, 0, 0], [1, 1, 1], [0.25, 0, 0], [0, 0, 3]]
        self.weights = torch.tensor(w, device=self.device, requires_grad=True)
        self.ids = torch.tensor(IDS, device=self.device)
        self.plan = mb.make_plan(torch.tensor(IDS), N, device=self.device)
        self.ys = [torch.randn(c, D, device=self.device) for c in self.plan.counts]
        self.extra: List[nn.Module] = []  # modules a case made for itself

    def track(self, module: nn.Module) -> nn.Module:
        self.extra.append(module)
        return module

    def tensor(self, data, **kw) -> Tensor:
        return torch.tensor(data, device=self.device, **kw)

    def snapshot(self) -> Dict[str, Any]:
        snap: Dict[str, Any] = {"rng": torch.get_rng_state(), "gen": self.gen.get_state()}
        modules = [("mb", self.mb), ("res", self.res), ("drop", self.drop)] + [(f"extra{i}", m) for i, m in enumerate(self.extra)]
        for name, m in modules:
            snap[name + ".state"] = {k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()}
            snap[name + ".grads"] = [k for k, p in m.named_parameters() if p.grad is not None]
            snap[name + ".training"] = [s.training for s in m.modules()]
            if isinstance(m, MaskedBranch):
                sig = m._unit.signatures
                snap[name + ".signatures"] = [] if sig is None else list(sig.table.items())
            if isinstance(m, (DropPath, ResidualDropPath)):
                g = m.generator
                snap[name + ".drop"] = (m.drop_prob, m.mode, m.scale_by_keep, None if g is None else g.get_state())
        snap["x"] = (self.x.detach().clone(), self.x.grad)
        snap["weights"] = (self.weights.detach().clone(), self.weights.grad)
        snap["plan"] = [t.clone() for t in self.plan[1:]] + [list(self.plan.counts)]
        snap["ys"] = [y.clone() for y in self.ys]
        return snap

    def good(self) -> Dict[str, Any]:
        x = self.x
        outs = {
            "mb.ids": self.mb(x, self.ids),
            "mb.host_ids": self.mb(x, torch.tensor(IDS)),
            "mb.int": self.mb(x, 2),
            "mb.none": self.mb(x, -1),
            "mb.mask": self.mb(x, self.weights != 0),
            "mb.weights": self.mb(x, self.weights),
            "res": self.res(x),
            "drop": self.drop.train()(x),
            "masked_branch": masked_branch(list(self.mb), x, self.ids),
            "drop_path": drop_path(x, 0.4, True, generator=self.gen),
            "drop_path.batch": drop_path(x, 0.4, True, mode="batch", generator=self.gen),
            "drop_add_residual": drop_add_residual(x, self.res.branch, 0.4, True, generator=self.gen),
        }
        plan = mb.make_plan(self.ids, N)
        ys = [y * (i + 1) for i, y in enumerate(mb.gather(x, plan))]
        outs["combine"] = mb.combine(ys, plan, weights=self.weights, base=x)
        outs["tie"] = mb.tie(x * 2, list(self.mb.parameters()), True)
        sum(o.square().sum() for o in outs.values()).backward()
        result: Dict[str, Any] = {k: v.detach() for k, v in outs.items()}
        result.update({"x.grad": x.grad, "weights.grad": self.weights.grad, "gen": self.gen.get_state()})
        for name, m in [("mb", self.mb), ("res", self.res)]:
            result.update({f"{name}.{k}.grad": p.grad for k, p in m.named_parameters()})
            result.update({f"{name}.{k}": v for k, v in m.state_dict().items()})
        return result


def assert_equal(a, b, where: str) -> None:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        assert isinstance(a, Tensor) and isinstance(b, Tensor), where
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            assert_equal(u, v, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
