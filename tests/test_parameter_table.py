"""The data-parallel layer's parameter table (csrc/parameters.cpp, ``_ops.parameter_table``): a
wrapper's parameters by position and its loops over a bit set of them, against the same loops
written in Python; bit sets as bytes (``_layout.as_bytes`` / ``from_bytes``); bad arguments raise
an error naming them and the table keeps working."""
import random

import pytest
import torch

from maskedbranch import _ops
from maskedbranch._layout import as_bytes, from_bytes


def params(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(3, generator=g)) for _ in range(n)]
    for k, p in enumerate(ps):
        if k % 3 != 1:
            p.grad = torch.full_like(p, float(k))
    return ps


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 130])
def test_bytes_round_trip(n):
    rng = random.Random(n)
    for _ in range(20):
        bits = rng.getrandbits(n) if n else 0
        t = as_bytes(bits, (n + 7) // 8)
        assert t.dtype == torch.uint8 and t.numel() == (n + 7) // 8
        assert from_bytes(t) == bits


@pytest.mark.parametrize("n", [1, 8, 13, 70])
def test_undefined_and_to_none_match_python(n):
    rng = random.Random(n)
    for _ in range(10):
        ps = params(n)
        table = _ops.parameter_table(ps)
        assert table.size() == n
        bits = rng.getrandbits(n)
        nb = (n + 7) // 8
        want = sum(1 << k for k, p in enumerate(ps) if bits >> k & 1 and p.grad is None)
        assert from_bytes(table.undefined(as_bytes(bits, nb))) == want
        had = [k for k, p in enumerate(ps) if bits >> k & 1 and p.grad is not None]
        untouched = {k: p.grad for k, p in enumerate(ps) if not bits >> k & 1}
        assert table.to_none(as_bytes(bits, nb)) == len(had)
        for k, p in enumerate(ps):
            if bits >> k & 1:
                assert p.grad is None
            else:
                assert p.grad is untouched[k]  # the same tensor, not a copy
        assert table.to_none(as_bytes(bits, nb)) == 0


def test_bits_past_the_end_are_ignored():
    ps = params(5)
    table = _ops.parameter_table(ps)
    assert from_bytes(table.undefined(torch.full((4,), 255, dtype=torch.uint8))) == 0b10010  # (positions 1 and 4 have none)
    assert table.to_none(torch.full((4,), 255, dtype=torch.uint8)) == 3
    assert all(p.grad is None for p in ps)


def test_set_replaces_what_a_position_reads():
    ps = params(4)
    table = _ops.parameter_table(ps)
    other = torch.nn.Parameter(torch.zeros(3))
    table.set(2, other)
    assert table.to_none(as_bytes(0b0100, 1)) == 0  # the replacement has no gradient
    assert ps[2].grad is not None
    other.grad = torch.ones(3)
    assert table.to_none(as_bytes(0b0100, 1)) == 1 and other.grad is None and ps[2].grad is not None


@pytest.mark.parametrize("bad, words", [
    (torch.zeros(2, dtype=torch.int64), "uint8"),
    (torch.zeros(2, 2, dtype=torch.uint8), "1-d"),
    (torch.zeros(2, dtype=torch.uint8, device="meta"), "CPU"),
])
def test_bad_bits_name_the_argument(bad, words):
    ps = params(9)
    table = _ops.parameter_table(ps)
    for method in (table.undefined, table.to_none):
        with pytest.raises(RuntimeError, match=rf"bits: .*{words}|bits: expected a 1-d uint8 CPU tensor"):
            method(bad)
    assert table.to_none(as_bytes(0b1, 2)) == 1  # still works


def test_set_out_of_range_names_k():
    table = _ops.parameter_table(params(3))
    with pytest.raises(RuntimeError, match="k: position 3 is outside the table's 3 parameters"):
        table.set(3, torch.zeros(1))
    with pytest.raises(RuntimeError, match="k: position -1"):
        table.set(-1, torch.zeros(1))
    assert table.size() == 3


def test_changed_names_the_gradients_made_since_noted():
    ps = params(10)
    table = _ops.parameter_table(ps)
    all_bits = as_bytes((1 << 10) - 1, 2)
    defined = sum(1 << k for k, p in enumerate(ps) if p.grad is not None)
    assert from_bytes(table.changed(all_bits)) == defined  # nothing noted yet
    table.note(as_bytes(0b1111111101, 2))  # position 1 has no gradient; not 9 ... 8 noted
    assert from_bytes(table.changed(all_bits)) == 0
    ps[0].grad.zero_()  # the same tensor (zero_grad(set_to_none=False)): unchanged
    ps[2].grad = None
    ps[2].grad = torch.ones(3)  # a new tensor: changed
    ps[1].grad = torch.ones(3)  # none noted there: changed
    ps[3].grad = None  # undefined: not changed
    assert from_bytes(table.changed(all_bits)) == 0b0110
    assert from_bytes(table.changed(as_bytes(0b0010, 2))) == 0b0010  # only the positions asked
    table.note(as_bytes(0b1111, 2))
    assert from_bytes(table.changed(all_bits)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 9, 70])
def test_gather_and_scatter_match_python(n, dtype):
    """gather: the set's gradients times the scale, one after another (zeros where a parameter
    has none), with the bits of DDP's bucket fill (grad * (1 / world), ATen's multiplication by a
    scalar), whether a gradient is copied by the table's own loop (contiguous) or by ATen (a
    channels-last or transposed one); scatter: each slice back, copied into the gradient tensor
    that is there (the same object) or as a new one with the parameter's strides."""
    rng = random.Random(n)
    for scale in (0.5, 1.0 / 3, 1.0 / 7):
        g = torch.Generator().manual_seed(n)
        ps = [torch.nn.Parameter((torch.randn(3, generator=g) * 10).to(dtype)) for _ in range(n)]
        for k, p in enumerate(ps):
            if k % 3 != 1:
                p.grad = (torch.randn(3, generator=g) * 10).to(dtype)
        if n > 2:  # a channels-last parameter keeps its strides in a new gradient
            ps[1] = torch.nn.Parameter(torch.randn(2, 3, 2, 2).to(dtype).to(memory_format=torch.channels_last))
        if n > 3:  # a transposed gradient of a contiguous parameter, and an empty one
            ps[2] = torch.nn.Parameter(torch.randn(3, 2).to(dtype))
            ps[2].grad = torch.randn(2, 3).to(dtype).t()
            ps[3] = torch.nn.Parameter(torch.zeros(0, 4, dtype=dtype))
        if n > 4:  # a large parameter: its copies are ATen's
            ps[4] = torch.nn.Parameter(torch.randn(200, 200).to(dtype))
            ps[4].grad = torch.randn(200, 200).to(dtype)
        table = _ops.parameter_table(ps)
        bits = rng.getrandbits(n) | 1 | (0b11110 if n > 4 else 0)
        chosen = [p for k, p in enumerate(ps) if bits >> k & 1]
        want = torch.cat([(p.grad * scale if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in chosen])
        flat = table.gather(as_bytes(bits, (n + 7) // 8), scale)
        assert flat.dtype == dtype and torch.equal(flat, want)
        held = [p.grad for p in chosen]
        table.scatter(as_bytes(bits, (n + 7) // 8), flat * 2)
        offset = 0
        for p, before in zip(chosen, held):
            assert torch.equal(p.grad.reshape(-1), 2 * want[offset:offset + p.numel()])
            assert p.grad is before if before is not None else p.grad.stride() == p.stride()
            offset += p.numel()


def test_gather_and_scatter_bad_arguments_name_them():
    ps = params(4) + [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    table = _ops.parameter_table(ps)
    with pytest.raises(RuntimeError, match="bits: the set is empty"):
        table.gather(as_bytes(0, 1), 1.0)
    with pytest.raises(RuntimeError, match="bits: position 4 is a Double parameter .* gather one dtype and device at a time"):
        table.gather(as_bytes(0b10001, 1), 1.0)
    before = ps[0].grad.clone()
    with pytest.raises(RuntimeError, match="flat: holds 4 elements, the set's parameters 6"):
        table.scatter(as_bytes(0b11, 1), torch.zeros(4))
    assert torch.equal(ps[0].grad, before)  # nothing written
    with pytest.raises(RuntimeError, match="flat: holds 7 elements, the set's parameters 6"):
        table.scatter(as_bytes(0b11, 1), torch.zeros(7))
    ps[0].grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="only dense gradients are gathered"):
        table.gather(as_bytes(0b1, 1), 1.0)
    ps[0].grad = None
    assert torch.equal(table.gather(as_bytes(0b101, 1), 1.0), torch.tensor([0.0, 0, 0, 2, 2, 2]))  # still works
