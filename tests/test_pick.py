"""pick, pick_backward, put_ (a compiled whole-batch choice's chosen branch, maskedbranch/_choice.py)
on every device of the harness: equal to the pure-PyTorch reference for every dtype and layout,
outputs new contiguous tensors, put_ writes the chosen branch only (nothing for -1) and moves its
version counters; the autograd Function against gradcheck in float64; opcheck on the three ops;
bad arguments raise a Python exception naming the argument, and the ops keep working."""
import re

import pytest
import torch

from maskedbranch import _autograd, reference

ops = torch.ops.maskedbranch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def branch_tensors(branches, device, dtype=torch.float32, layout="contiguous", seed=0):
    """k = 4 tensors per branch: a conv weight, a vector, a 0-d tensor and an odd-sized one
    (not a whole number of 16-byte vectors), branch after branch."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 3, 3, 3), (16,), (), (5, 3)]
    out = []
    for _ in range(branches):
        for shape in shapes:
            t = (torch.randn(shape, generator=gen) * 10).to(dtype).to(device)
            if layout == "channels_last" and t.dim() == 4:
                t = t.contiguous(memory_format=torch.channels_last)
            elif layout == "strided" and t.dim() == 2:
                t = torch.randn(3, 5, generator=gen).to(dtype).to(device).t()
            out.append(t)
    return out


def index(i, device, dtype=torch.int64):
    return torch.tensor(i, dtype=dtype, device=device)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("branches", [1, 4, 70])
def test_pick_equals_the_reference(device, dtype, layout, branches):
    tensors = branch_tensors(branches, device, dtype, layout)
    for i in {0, branches // 2, branches - 1}:
        got = ops.pick(tensors, index(i, device), branches)
        want = reference.pick(tensors, index(i, device), branches)
        assert len(got) == 4
        for g, w, src in zip(got, want, tensors[4 * i:4 * i + 4]):
            assert g.is_contiguous() and g.dtype == src.dtype and g.device == src.device
            assert torch.equal(g, w) and torch.equal(g, src)
            assert g.numel() == 0 or g.data_ptr() != src.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("branches", [1, 3, 70])
def test_pick_backward_equals_the_reference(device, dtype, branches):
    grads = branch_tensors(1, device, dtype, "channels_last")
    i = branches - 1
    got = ops.pick_backward(grads, index(i, device, torch.int32), branches)
    want = reference.pick_backward(grads, index(i, device), branches)
    assert len(got) == 4 * branches
    for e, (g, w) in enumerate(zip(got, want)):
        assert g.is_contiguous() and torch.equal(g, w)
        assert torch.equal(g, grads[e % 4]) if e // 4 == i else not g.any()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("branches", [1, 4, 70])
def test_put_writes_the_chosen_branch_only(device, dtype, layout, branches):
    for i in {-1, 0, branches - 1}:
        tensors = branch_tensors(branches, device, dtype, layout)
        before = [t.clone() for t in tensors]
        versions = [t._version for t in tensors]
        values = branch_tensors(1, device, dtype, seed=7)
        ops.put_(tensors, index(i, device), branches, values)
        want = [t.clone() for t in before]
        reference.put_(want, index(i, device), branches, values)
        for e, (t, w, b) in enumerate(zip(tensors, want, before)):
            assert torch.equal(t, w)
            assert torch.equal(t, values[e % 4]) if e // 4 == i else torch.equal(t, b)
        assert all(t._version > v for t, v in zip(tensors, versions)), "put_ must move every mutated tensor's version"


def test_put_of_a_tensor_into_itself(device):
    tensors = branch_tensors(2, device)
    want = [t.clone() for t in tensors]
    ops.put_(tensors, index(1, device), 2, tensors[4:])
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))


def test_no_tensors(device):
    assert ops.pick([], index(1, device), 3) == []
    ops.put_([], index(1, device), 3, [])
    assert ops.pick_backward([], index(0, device), 2) == []


def test_pick_gradcheck(device):
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(shape, generator=gen, dtype=torch.float64).to(device).requires_grad_()
               for _ in range(3) for shape in [(2, 3), (4,)]]
    for i in range(3):
        assert torch.autograd.gradcheck(lambda *ts: _autograd.pick(ts, index(i, device), 3), tensors)
        grads = torch.autograd.grad(sum(t.sum() * (j + 1) for j, t in enumerate(_autograd.pick(tensors, index(i, device), 3))),
                                    tensors)
        for e, g in enumerate(grads):
            want = torch.full_like(tensors[e], e % 2 + 1.0) if e // 2 == i else torch.zeros_like(tensors[e])
            assert torch.equal(g, want)


def test_raw_ops_are_not_differentiable(device):
    tensors = [torch.ones(2, device=device, requires_grad=True) for _ in range(2)]
    for out in (ops.pick(tensors, index(1, device), 2), ops.pick_backward(tensors[:1], index(1, device), 2)):
        with pytest.raises(RuntimeError, match="not implemented|does not require grad"):
            sum(g.sum() for g in out).backward()
    with pytest.raises(RuntimeError, match=r"tensors\[0\]: put_ writes into tensors that do not require grad"):
        ops.put_(tensors, index(1, device), 2, [torch.zeros(2, device=device)])
    targets = [torch.zeros(2, device=device) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"values\[0\]: put_ has no derivative"):
        ops.put_(targets, index(1, device), 2, tensors[:1])
    with torch.no_grad():
        ops.put_(targets, index(1, device), 2, tensors[:1])
    assert torch.equal(targets[1], tensors[0].detach())


@pytest.mark.parametrize("branches", [2, 70])
def test_opcheck(device, branches):
    tensors = branch_tensors(branches, device, torch.float32, "channels_last")
    idx = index(branches - 1, device)
    torch.library.opcheck(ops.pick, (tensors, idx, branches))
    torch.library.opcheck(ops.pick_backward, (tensors[:4], idx, branches))
    torch.library.opcheck(ops.put_, (tensors, idx, branches, branch_tensors(1, device, seed=5)))
    torch.library.opcheck(ops.put_, (tensors, index(-1, device), branches, branch_tensors(1, device, seed=5)))


def _error(fn):
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        fn()
    return str(info.value).split("\n")[0]


def test_bad_arguments_name_the_argument(device):
    t = branch_tensors(2, device)
    v = branch_tensors(1, device)
    cases = [
        (lambda: ops.pick(t, index(0, device), 0), "branches: expected at least 1"),
        (lambda: ops.pick(t, index(0, device), 3), "tensors: expected the same number of tensors for each of the 3"),
        (lambda: ops.pick(t[:4] + [t[5], t[4], t[6], t[7]], index(0, device), 2), r"tensors\[4\] \(branch 1, tensor 0\)"),
        (lambda: ops.pick(t[:4] + [t[4].double()] + t[5:], index(0, device), 2), r"tensors\[4\].*dtype"),
        (lambda: ops.pick(t, torch.tensor(0.0, device=device), 2), "index: expected an integer tensor"),
        (lambda: ops.pick(t, torch.tensor([0, 1], device=device), 2), "index: expected one element"),
        (lambda: ops.put_(t, index(0, device), 2, v[:3]), r"values: expected one tensor per tensor of a branch \(4\)"),
        (lambda: ops.put_(t, index(0, device), 2, [v[1]] + v[1:]), r"values\[0\]: expected shape"),
        (lambda: ops.pick_backward(v, index(0, device), 0), "branches: expected at least 1"),
    ]
    if device == "cpu":  # a GPU checks the range on the device (an assert, tests/cuda_emu)
        cases += [
            (lambda: ops.pick(t, index(2, device), 2), r"index: expected a branch in \[0, 2\), got 2"),
            (lambda: ops.pick(t, index(-1, device), 2), r"index: expected a branch in \[0, 2\), got -1"),
            (lambda: ops.put_(t, index(-2, device), 2, v), r"index: expected a branch in \[-1, 2\), got -2"),
            (lambda: ops.pick_backward(v, index(3, device), 2), r"index: expected a branch in \[0, 2\), got 3"),
        ]
    for fn, message in cases:
        assert re.search(message, _error(fn)), (message, _error(fn))
    # the ops keep working
    assert torch.equal(ops.pick(t, index(1, device), 2)[0], t[4])
