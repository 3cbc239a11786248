"""Side by side with the modules maskedbranch replaces: timm's ``drop_path`` / ``DropPath`` and
torchvision's ``stochastic_depth`` / ``StochasticDepth``, run on the same inputs with the same
seed. Outputs and gradients are bitwise equal in training and evaluation, for every dtype and
layout; attributes, repr and accepted argument types are timm's."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import maskedbranch as mb

timm_layers = pytest.importorskip("timm.layers")
tv_ops = pytest.importorskip("torchvision.ops")

PROBS = [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.9, 1.0, 1]


def peer_fn(mode):
    """The peer function for ``mode``: timm's drop_path per row, torchvision's per batch."""
    if mode == "row":
        return lambda x, p, training, scale_by_keep=True: timm_layers.drop_path(x, p, training, scale_by_keep)
    return lambda x, p, training, scale_by_keep=True: tv_ops.stochastic_depth(x, p, "batch", training)


def same_seed(fn, x, seed):
    """Output, input gradient and output strides of ``fn(x)`` drawn at ``seed``."""
    x = x.detach().requires_grad_(True)  # a view with x's own strides
    torch.manual_seed(seed)
    out = fn(x)
    grad_out = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape).to(out.dtype)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad, out.stride()


def assert_bitwise(a, b):
    for u, v in zip(a, b):
        assert (u is None and v is None) or (u == v if isinstance(u, tuple) else torch.equal(u, v))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("p", PROBS)
def test_functional_bitwise(dtype, mode, p, training):
    theirs = peer_fn(mode)
    x = torch.randn(33, 3, 5).to(dtype)
    for seed in range(3):
        for scale in (True, False) if mode == "row" else (True,):
            want = same_seed(lambda t: theirs(t, p, training, scale), x, seed)
            got = same_seed(lambda t: mb.drop_path(t, p, training, scale_by_keep=scale, mode=mode), x, seed)
            assert_bitwise(got, want)


def layouts():
    base = torch.randn(8, 6, 5, 7)
    return {
        "contiguous": base,
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "strided": base[:, ::2, :, 1:],
        "expanded": base[:1].expand(8, 6, 5, 7),
    }


@pytest.mark.parametrize("layout", list(layouts()))
@pytest.mark.parametrize("mode", ["row", "batch"])
def test_output_strides_and_values_by_layout(layout, mode):
    """timm keeps the input's strides (``x * mask``); so does maskedbranch, with the default
    generator and with one of its own."""
    x = layouts()[layout]
    theirs = peer_fn(mode)
    for training in (True, False):
        for seed in range(3):
            want = same_seed(lambda t: theirs(t, 0.5, training), x, seed)
            assert_bitwise(same_seed(lambda t: mb.drop_path(t, 0.5, training, mode=mode), x, seed), want)
            gen = torch.Generator().manual_seed(seed)
            out = mb.drop_path(x, 0.5, training, mode=mode, generator=gen)
            assert out.stride() == want[2]


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_modules_bitwise(mode):
    ours = mb.DropPath(0.3, mode=mode)
    theirs = timm_layers.DropPath(0.3) if mode == "row" else tv_ops.StochasticDepth(0.3, "batch")
    x = torch.randn(40, 7)
    for training in (True, False):
        ours.train(training)
        theirs.train(training)
        for seed in range(4):
            assert_bitwise(same_seed(ours, x, seed), same_seed(theirs, x, seed))
    ours.eval()
    assert ours(x) is x and timm_layers.DropPath(0.3).eval()(x) is x  # identity, no copy
    assert mb.DropPath(0.0).train()(x) is x


@pytest.mark.parametrize("p", [0.0, 0.1, 0.25, 1 / 3, 1, 1.0, np.float32(0.25), np.float64(0.2), np.float32(1)])
def test_attributes_and_repr_are_timms(p):
    ours, theirs = mb.DropPath(p), timm_layers.DropPath(p)
    assert ours.drop_prob == theirs.drop_prob and type(ours.drop_prob) is type(theirs.drop_prob)
    assert ours.scale_by_keep == theirs.scale_by_keep
    assert repr(ours) == repr(theirs) and ours.extra_repr() == theirs.extra_repr()
    assert isinstance(mb.DropPath(1).drop_prob, int) and mb.DropPath(1).drop_prob == 1
    # a copied model keeps its values as given
    assert copy.deepcopy(ours).drop_prob == theirs.drop_prob


REPR_PROBS = sorted(set([i / 20 for i in range(21)] + [1 / 3, 2 / 3, 0.0005, 0.0015, 0.1234, 0.9995, 0, 1]))


@pytest.mark.parametrize("scale_by_keep", [True, False])
@pytest.mark.parametrize("p", REPR_PROBS)
def test_repr_equals_timms_for_every_setting(p, scale_by_keep):
    """timm's DropPath prints ``drop_prob`` alone, whatever ``scale_by_keep`` is; so does ours,
    alone and inside a model (where nn.Module prints the child's repr)."""
    ours = mb.DropPath(p, scale_by_keep=scale_by_keep)
    theirs = timm_layers.DropPath(p, scale_by_keep=scale_by_keep)
    assert ours.extra_repr() == theirs.extra_repr()
    assert repr(ours) == repr(theirs)
    assert repr(nn.Sequential(nn.Identity(), ours)) == repr(nn.Sequential(nn.Identity(), theirs))
    # mode and generator are ours: shown only when they are not the default
    assert repr(mb.DropPath(p, scale_by_keep=scale_by_keep, mode="row", generator=None)) == repr(theirs)
    assert repr(mb.DropPath(p, scale_by_keep=scale_by_keep, mode="batch")) == repr(theirs)[:-1] + ", mode=batch)"
    with_gen = mb.DropPath(p, scale_by_keep=scale_by_keep, generator=torch.Generator())
    assert repr(with_gen) == repr(theirs)[:-1] + ", generator=torch.Generator('cpu'))"


@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("p", REPR_PROBS)
def test_stochastic_depth_repr_equals_torchvisions(p, mode):
    ours, theirs = mb.StochasticDepth(p, mode), tv_ops.StochasticDepth(p, mode)
    assert repr(ours) == repr(theirs) and ours.extra_repr() == theirs.extra_repr()
    assert repr(nn.Sequential(ours)) == repr(nn.Sequential(theirs))


def test_numpy_scalars_accepted_like_timm():
    x = torch.randn(64, 5)
    for p in (np.float32(0.25), np.float64(0.25), np.float16(0.5)):
        for seed in range(3):
            want = same_seed(lambda t: timm_layers.drop_path(t, p, True), x, seed)
            assert_bitwise(same_seed(lambda t: mb.drop_path(t, p, True), x, seed), want)
            assert_bitwise(same_seed(mb.DropPath(p).train(), x, seed), same_seed(timm_layers.DropPath(p).train(), x, seed))
    block = mb.ResidualDropPath(nn.Linear(5, 5), np.float32(0.25))
    assert "drop_prob=0.250" in repr(block)
    block(x).sum().backward()


def test_torchvision_module_in_a_model():
    """A torchvision-style block: StochasticDepth in "row" and "batch" mode inside a residual."""
    torch.manual_seed(0)
    f = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(6, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    for mode in ("row", "batch"):
        ours, theirs = mb.DropPath(0.4, mode=mode), tv_ops.StochasticDepth(0.4, mode)
        a = nn.Sequential(f, ours).train()
        b = nn.Sequential(copy.deepcopy(f), theirs).train()
        for seed in range(3):
            assert_bitwise(same_seed(a, x, seed), same_seed(b, x, seed))
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p.grad, q.grad)
            a.zero_grad(), b.zero_grad()
        for u, v in zip(a.buffers(), b.buffers()):
            assert torch.equal(u, v)


def test_residual_factor_is_timms_mask_value(dtype):
    """ResidualDropPath scales kept rows by the very value timm's mask holds (1 / keep_prob
    rounded in x's dtype), so that a kept row equals timm's ``x + y * mask`` in that factor."""
    g = torch.Generator().manual_seed(0)
    keeps = torch.rand(200, generator=g, dtype=torch.float64).tolist() + [0.5, 0.9, 1 / 3, 1e-4, 9.002520605120974e-05]
    ones = lambda t: torch.ones_like(t)  # noqa: E731
    x = torch.zeros(64, 1, dtype=dtype)
    checked = 0
    for keep in keeps:
        p = 1.0 - keep
        if keep == 0.0 or p == 0.0:
            continue
        torch.manual_seed(0)
        mask = timm_layers.drop_path(torch.ones(256, 1, dtype=dtype), p, True)
        want = set(mask.unique().tolist()) - {0.0}
        out = mb.drop_add_residual(x, ones, p, True, generator=torch.Generator().manual_seed(1))
        got = set(out.unique().tolist()) - {0.0}
        assert got <= want, (dtype, keep, got, want)
        checked += bool(got)
    assert checked > 150  # kept rows were compared for most of the factors
