"""MaskedBranch is the ``nn.ModuleList`` it replaces: the same state_dict keys, strict loading
both ways between an if/else model and a MaskedBranch model, checkpoints of the old
``branches.`` layout, and the list operations (indexing, len, iteration, slicing, append,
extend, insert, setitem, del, pop) with the routing still right after every edit."""
import copy
import io

import pytest
import torch
from torch import nn

from maskedbranch import MaskedBranch, reference

D_IN, D, N, B = 5, 6, 3, 10


def block(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh()).double()


class IfElse(nn.Module):
    """The model MaskedBranch replaces: a ModuleList chosen from by a Python index."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(D_IN, D).double()
        self.choices = nn.ModuleList([block(seed * 10 + i) for i in range(N)])
        self.head = nn.Linear(D, 2).double()

    def forward(self, x, k):
        return self.head(self.choices[k](self.stem(x)))


class Routed(IfElse):
    """The same model with ``self.choices = MaskedBranch(...)`` in place of the ModuleList."""

    def __init__(self, seed=0, **kw):
        super().__init__(seed)
        self.choices = MaskedBranch(self.choices, **kw)

    def forward(self, x, gate):
        return self.head(self.choices(self.stem(x), gate))


def trained(model, steps=2):
    """A few training steps, so that the BatchNorm buffers differ from a fresh model's."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        model(torch.randn(B, D_IN, generator=g, dtype=torch.float64), step % N)
    return model.eval()


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_state_dict_keys_are_the_module_lists():
    ifelse = IfElse()
    routed = Routed()
    assert list(routed.state_dict()) == list(ifelse.state_dict())
    assert "choices.0.0.weight" in routed.state_dict() and "choices.2.1.num_batches_tracked" in routed.state_dict()
    assert list(MaskedBranch([nn.Linear(2, 2)] * 2).state_dict()) == list(nn.ModuleList([nn.Linear(2, 2)] * 2).state_dict())


@pytest.mark.parametrize("direction", ["ifelse->routed", "routed->ifelse"])
def test_strict_load_both_ways(direction):
    src, dst = (trained(IfElse(seed=1)), Routed(seed=2)) if direction == "ifelse->routed" else (trained(Routed(seed=1)), IfElse(seed=2))
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    result = dst.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_state(src, dst)
    dst.eval()
    x = torch.randn(B, D_IN, dtype=torch.float64)
    for k in range(N):
        torch.testing.assert_close(dst(x, k), src(x, k), rtol=0, atol=0)


def test_loaded_model_routes_per_row_like_ifelse():
    routed = Routed(seed=2)
    routed.load_state_dict(trained(IfElse(seed=1)).state_dict())
    routed.eval()
    x = torch.randn(B, D_IN, dtype=torch.float64)
    ids = torch.tensor([0, 2, -1, 1, 1, 0, 2, 2, -1, 0])
    h = routed.stem(x)
    want = routed.head(reference.masked_branch_ifelse(list(routed.choices), h, ids))
    torch.testing.assert_close(routed(x, ids), want)


def test_strict_loading_still_reports_wrong_keys():
    state = trained(IfElse()).state_dict()
    missing = {k: v for k, v in state.items() if k != "choices.1.0.bias"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"choices\.1\.0\.bias"'):
        Routed().load_state_dict(missing)
    extra = dict(state, **{"choices.3.0.weight": torch.zeros(D, D, dtype=torch.float64)})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\).*"choices\.3\.0\.weight"'):
        Routed().load_state_dict(extra)


def test_whole_model_pickle_and_deepcopy():
    model = trained(Routed(seed=1))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    ids = torch.tensor([0, 1, 2, -1, 0, 1, 2, 2, 1, 0])
    for m in (loaded, copy.deepcopy(model)):
        assert isinstance(m.choices, MaskedBranch)
        torch.testing.assert_close(m(x, ids), model(x, ids), rtol=0, atol=0)
        torch.testing.assert_close(m(x, 1), model(x, 1), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# The list operations. After each edit both the int gate (its fast path caches the branches) and
# a per-row gate must route to the list as it is now.


def branches(n=N):
    return [block(100 + i).eval() for i in range(n)]


def check_routing(m, x):
    n = len(m)
    for k in range(n):
        m(x, k)  # warm the int gate's cache on the current structure
        torch.testing.assert_close(m(x, k), m[k](x), rtol=0, atol=0)
    ids = torch.arange(B) % (n + 1) - 1
    torch.testing.assert_close(m(x, ids), reference.masked_branch_ifelse(list(m), x, ids))
    mask = torch.ones(B, n, dtype=torch.bool)
    torch.testing.assert_close(m(x, mask), reference.masked_branch_ifelse(list(m), x, mask))


def test_indexing_len_iteration_like_module_list():
    bs = branches()
    m, ml = MaskedBranch(bs), nn.ModuleList(bs)
    assert isinstance(m, nn.ModuleList)
    assert len(m) == len(ml) == m.num_branches == N
    assert list(m) == list(ml) == bs
    assert m[0] is bs[0] and m[-1] is bs[-1]
    assert list(m.children()) == bs and [k for k, _ in m.named_children()] == ["0", "1", "2"]
    with pytest.raises(IndexError):
        m[N]


@pytest.mark.parametrize("idx", [slice(1, None), slice(None, 2), slice(None, None, -1), slice(N, None)])
def test_slicing_like_module_list(idx):
    bs = branches()
    got, want = MaskedBranch(bs)[idx], nn.ModuleList(bs)[idx]
    assert type(got) is nn.ModuleList  # a sub-list of branches, not a second router
    assert list(got) == list(want)
    assert list(got.state_dict()) == list(want.state_dict())


def edits():
    extra = [block(200 + i).eval() for i in range(2)]
    return {
        "append": lambda m: m.append(extra[0]),
        "extend": lambda m: m.extend(extra),
        "iadd": lambda m: m.__iadd__(extra),
        "insert": lambda m: m.insert(0, extra[0]),
        "setitem": lambda m: m.__setitem__(1, extra[0]),
        "delitem": lambda m: m.__delitem__(0),
        "delslice": lambda m: m.__delitem__(slice(0, 2)),
        "pop": lambda m: m.pop(1),
    }


@pytest.mark.parametrize("materialize", [None, True])
@pytest.mark.parametrize("edit", list(edits()))
def test_edits_like_module_list(edit, materialize):
    bs = branches()
    m, ml = MaskedBranch(bs, materialize_grads=materialize), nn.ModuleList(bs)
    x = torch.randn(B, D, dtype=torch.float64)
    check_routing(m, x)  # caches built on the old structure
    do = edits()[edit]
    do(m)
    do(ml)
    assert list(m) == list(ml)
    assert list(m.state_dict()) == list(ml.state_dict())
    check_routing(m, x)
    if materialize:
        # the branches that did not run are now those of the edited list: all get zeros
        m.zero_grad(set_to_none=True)
        m(x.requires_grad_(), 0).sum().backward()
        assert all(p.grad is not None for p in m.parameters())
        assert all(torch.count_nonzero(p.grad) == 0 for b in list(m)[1:] for p in b.parameters())

