"""MaskedBranch over the branches' own container: an ``nn.ModuleDict`` keeps its keys
(``experts.expert_0.weight``, branch i = the i-th value in insertion order), an ``nn.ModuleList``
its indices. For the plain ModuleDict model routing with if/else: state_dict keys equal, state
dicts load both ways, every gate kind gives the reference's output and gradients, copies and
pickles keep the names; the dict's own access (``[name]``, ``keys()``, ``items()``, ``in``) and
the positional one; bad containers are refused with the argument named. The functional form
takes a ModuleDict too."""
import copy
import io

import pytest
import torch
from torch import nn

from maskedbranch import MaskedBranch, masked_branch, reference

N, B, D = 3, 10, 5
NAMES = ["expert_0", "expert_1", "shared"]  # any names: the order is the insertion order


def experts(seed=0):
    torch.manual_seed(seed)
    return nn.ModuleDict({name: nn.Sequential(nn.Linear(D, 7), nn.Tanh(), nn.Linear(7, D)).double() for name in NAMES})


class Plain(nn.Module):
    """The model before: a ModuleDict of experts, routed with if/else."""

    def __init__(self, seed=0):
        super().__init__()
        self.experts = experts(seed)


class Masked(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.experts = MaskedBranch(experts(seed))


def gates():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-1, N - 1, (B,), generator=g)  # the last branch is never chosen
    ids[0], ids[1] = -1, 0
    mask = torch.rand(B, N, generator=g) < 0.5
    mask[0] = False
    return {"int": 1, "ids": ids, "mask": mask, "weights": torch.rand(B, N, generator=g, dtype=torch.float64) * mask}


def test_module_dict_keys_kept_and_checkpoints_load_both_ways():
    plain, masked = Plain(seed=0), Masked(seed=1)
    assert list(masked.state_dict()) == list(plain.state_dict())
    assert list(masked.state_dict())[:2] == ["experts.expert_0.0.weight", "experts.expert_0.0.bias"]
    masked.load_state_dict(plain.state_dict())  # saved from the plain ModuleDict model
    for (k, a), (_, b) in zip(plain.state_dict().items(), masked.state_dict().items()):
        assert torch.equal(a, b), k
    back = Plain(seed=2)
    back.load_state_dict(masked.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), plain.state_dict().values()))


def test_module_list_keys_unchanged():
    m = MaskedBranch(nn.ModuleList(nn.Linear(2, 2) for _ in range(2)))
    assert list(m.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert repr(m).splitlines()[1].strip().startswith("(0-1): 2 x Linear")


@pytest.mark.parametrize("kind", ["int", "ids", "mask", "weights"])
def test_every_gate_equals_the_reference(kind):
    gate = gates()[kind]
    plain, masked = Plain(), Masked()
    branches = list(plain.experts.values())
    if kind == "weights":
        gate = gate.clone().requires_grad_(True)
    gate_ref = gate.detach().clone().requires_grad_(True) if kind == "weights" else gate
    x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(B, D, dtype=torch.float64)

    out = masked.experts(x, gate)
    want = reference.masked_branch_ifelse(branches, x_ref, gate_ref)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    out.backward(grad_out)
    want.backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    if kind == "weights":
        torch.testing.assert_close(gate.grad, gate_ref.grad * (gate_ref != 0), rtol=1e-12, atol=1e-12)
    for (name, p), (_, q) in zip(masked.named_parameters(), plain.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    if kind in ("int", "ids"):
        assert masked.experts["shared"][0].weight.grad is None  # never routed to: untouched, as with if/else


def test_functional_form_takes_a_module_dict():
    plain = Plain()
    x, ids = torch.randn(B, D, dtype=torch.float64), gates()["ids"]
    want = reference.masked_branch_ifelse(list(plain.experts.values()), x, ids)
    torch.testing.assert_close(masked_branch(plain.experts, x, ids), want, rtol=1e-12, atol=1e-12)


def test_names_and_positions():
    m = Masked().experts
    values = list(m.values())
    assert list(m.keys()) == NAMES and [k for k, _ in m.items()] == NAMES and len(m) == N
    assert m[0] is m["expert_0"] is values[0] and m[-1] is m["shared"] and m[1:][0] is values[1]
    assert "shared" in m and "expert_9" not in m and values[2] in m
    assert m.num_branches == N and "(shared): Sequential(" in repr(m)
    x = torch.randn(4, D, dtype=torch.float64)
    torch.testing.assert_close(m(x, 2), m["shared"](x))  # int gate k: the k-th value
    torch.testing.assert_close(m(x, torch.tensor([2, 0, -1, 2])), torch.stack([m["shared"](x[0]), m["expert_0"](x[1]),
                                                                              torch.zeros(D, dtype=torch.float64), m["shared"](x[3])]))
    with pytest.raises(IndexError, match="index 3 is out of range"):
        m[3]
    with pytest.raises(KeyError):
        m["nope"]
    new = nn.Sequential(nn.Linear(D, D)).double()
    m[1] = new  # by position: the name stays
    assert m["expert_1"] is new and list(m.keys()) == NAMES
    m["extra"] = nn.Linear(D, D).double()  # by name: a new branch at the end
    assert list(m.keys()) == NAMES + ["extra"] and m(x, torch.tensor([3, 3, 3, 3])).shape == (4, D)
    del m["expert_0"]  # the others keep their names (not renumbered)
    assert list(m.keys()) == ["expert_1", "shared", "extra"]
    torch.testing.assert_close(m(x, 0), new(x))
    for op in (lambda: m.append(nn.Linear(D, D)), lambda: m.insert(0, nn.Linear(D, D)), lambda: m.extend([nn.Linear(D, D)])):
        with pytest.raises(TypeError, match=r"the branches are named \(built from an nn.ModuleDict\).*module\['name'\] = branch"):
            op()


def test_copies_and_pickles_keep_the_names():
    m = Masked()
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    x, ids = torch.randn(B, D, dtype=torch.float64), gates()["ids"]
    for other in (copy.deepcopy(m), torch.load(buf, weights_only=False)):
        assert list(other.state_dict()) == list(m.state_dict()) and list(other.experts.keys()) == NAMES
        torch.testing.assert_close(other.experts(x, ids), m.experts(x, ids), rtol=0, atol=0)


@pytest.mark.parametrize("bad,error,message", [
    ({}, ValueError, r"branches: expected at least one branch, got an empty dict"),
    (nn.ModuleDict(), ValueError, r"branches: expected at least one branch, got an empty ModuleDict"),
    ({"a": nn.Linear(2, 2), "b": 3}, TypeError, r"branches\['b'\]: expected an nn.Module, got int"),
    ({"a": lambda x: x}, TypeError, r"branches\['a'\]: expected an nn.Module, got function"),
    ({1: nn.Linear(2, 2)}, TypeError, r"branches: the keys of a mapping name its branches' modules: expected strings, got 1"),
    ({"a.b": nn.Linear(2, 2)}, ValueError, r"branches\['a.b'\]: cannot name a child module: module name can't contain"),
    ({"forward": nn.Linear(2, 2)}, ValueError, r"branches\['forward'\]: cannot name a child module: attribute 'forward' already exists"),
    (nn.Linear(2, 2), TypeError, r"branches: expected an iterable of nn.Module \(a list, an nn.ModuleList or an nn.ModuleDict\), got a single Linear"),
])
def test_bad_containers(bad, error, message):
    with pytest.raises(error, match=message):
        MaskedBranch(bad)


def test_functional_form_bad_mapping():
    with pytest.raises(TypeError, match=r"branches\['b'\]: expected a callable, got int"):
        masked_branch({"a": nn.Linear(2, 2), "b": 3}, torch.randn(2, 2), torch.tensor([0, 0]))
