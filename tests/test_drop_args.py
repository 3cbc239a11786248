"""Arguments of the four drop-path forms (DropPath, drop_path, ResidualDropPath,
drop_add_residual): one keyword-only order, bool checks that catch torchvision's argument order,
positional settings refused with a TypeError that says what to write, reprs that show every
non-default setting, and torchvision's StochasticDepth spelling."""
import pytest
import torch
from torch import nn

import maskedbranch as mb

tv_ops = pytest.importorskip("torchvision.ops")


def x():
    return torch.randn(6, 4)


def lin():
    torch.manual_seed(0)
    return nn.Linear(4, 4)


# torchvision's stochastic_depth(x, p, mode, training) order, and other misreadings: each
# raises a TypeError that names the form and the argument.
MISREAD = {
    "drop_path torchvision order": (lambda: mb.drop_path(x(), 0.5, "batch", True), r"^drop_path: training: expected a bool, got str 'batch'; the argument order is drop_path\(x, drop_prob, training, scale_by_keep, \*, mode="),
    "drop_add_residual torchvision order": (lambda: mb.drop_add_residual(x(), lin(), 0.5, "batch"), r"^drop_add_residual: training: expected a bool, got str 'batch'; the argument order is drop_add_residual\(x, branch,"),
    "stochastic_depth training str": (lambda: mb.stochastic_depth(x(), 0.5, "batch", "yes"), r"^stochastic_depth: training: expected a bool, got str 'yes'$"),
    "DropPath mode positional": (lambda: mb.DropPath(0.5, True, "batch"), r"^DropPath: the settings after scale_by_keep are keyword-only: write DropPath\(\.\.\., mode='batch'\); the argument order is DropPath\(drop_prob, scale_by_keep, \*, "),
    "DropPath mode in scale_by_keep's place": (lambda: mb.DropPath(0.5, "batch"), r"^scale_by_keep: expected a bool, got str 'batch'"),
    "DropPath scale_by_keep int": (lambda: mb.DropPath(0.5, scale_by_keep=1), r"^scale_by_keep: expected a bool, got int 1"),
    "drop_path training int": (lambda: mb.drop_path(x(), 0.5, 1), r"^drop_path: training: expected a bool, got int 1$"),
    "ResidualDropPath mode int": (lambda: mb.ResidualDropPath(lin(), 0.1, mode=3), r"^mode: expected 'row' \(drop per sample\) or 'batch'"),
    "ResidualDropPath settings positional": (lambda: mb.ResidualDropPath(lin(), 0.1, "batch", False, None), r"^ResidualDropPath: the settings after drop_prob are keyword-only: write ResidualDropPath\(\.\.\., mode='batch', scale_by_keep=False, generator=None\)"),
    "drop_path mode positional": (lambda: mb.drop_path(x(), 0.5, True, True, "batch"), r"^drop_path: the settings after scale_by_keep are keyword-only: write drop_path\(\.\.\., mode='batch'\); the argument order is drop_path\(x, drop_prob, training, scale_by_keep, \*, "),
    "drop_add_residual mode positional": (lambda: mb.drop_add_residual(x(), lin(), 0.5, True, "batch"), r"^drop_add_residual: the settings after training are keyword-only: write drop_add_residual\(\.\.\., mode='batch'\)"),
    "drop_path unknown mode": (lambda: mb.drop_path(x(), 0.5, True, mode="rows"), r"mode"),
}


@pytest.mark.parametrize("name", list(MISREAD))
def test_misread_arguments_raise_naming_the_argument(name):
    call, message = MISREAD[name]
    expected = (TypeError, ValueError) if name in ("drop_path unknown mode", "ResidualDropPath mode int") else TypeError
    with pytest.raises(expected, match=message):
        call()


def test_torchvision_order_never_runs_in_row_mode():
    """A string in `training` would otherwise run the call in row mode, silently."""
    with pytest.raises(TypeError):
        mb.drop_path(x(), 0.5, "batch", True)
    # torchvision's own spelling, argument for argument, equals torchvision's for the same seed
    inp = torch.randn(64, 3)
    for mode in ("row", "batch"):
        torch.manual_seed(3)
        want = tv_ops.stochastic_depth(inp, 0.5, mode, True)
        torch.manual_seed(3)
        assert torch.equal(mb.stochastic_depth(inp, 0.5, mode, True), want)


@pytest.mark.parametrize(
    "call",
    [
        lambda g: mb.DropPath(0.5, False, "batch"),
        lambda g: mb.ResidualDropPath(lin(), 0.5, "batch", False),
        lambda g: mb.ResidualDropPath(lin(), 0.5, "batch"),
        lambda g: mb.drop_path(torch.randn(16, 4), 0.5, True, False, "row", g),
        lambda g: mb.drop_add_residual(torch.randn(16, 4), lin(), 0.5, True, "row", False, g),
    ],
    ids=["DropPath 1", "ResidualDropPath 2", "ResidualDropPath 1", "drop_path 2", "drop_add_residual 3"],
)
def test_positional_settings_raise_and_leave_the_generator(call):
    """Settings timm's signatures lack are keyword-only: passed positionally they raise before
    any draw."""
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    with pytest.raises(TypeError, match=r"the settings after (drop_prob|training|scale_by_keep) are keyword-only: write "):
        call(g)
    assert torch.equal(g.get_state(), state)


def test_timm_positional_scale_by_keep():
    """timm's own signatures, ``drop_path(x, drop_prob, training, scale_by_keep)`` and
    ``DropPath(drop_prob, scale_by_keep)``: the same results for the same seed."""
    timm_drop = pytest.importorskip("timm.layers")
    inp = torch.randn(16, 4)
    for keep in (True, False):
        torch.manual_seed(1)
        want = timm_drop.drop_path(inp, 0.5, True, keep)
        torch.manual_seed(1)
        assert torch.equal(mb.drop_path(inp, 0.5, True, keep), want)
        timm_module, ours = timm_drop.DropPath(0.5, keep), mb.DropPath(0.5, keep)
        assert ours.scale_by_keep is keep
        torch.manual_seed(2)
        want = timm_module(inp)
        torch.manual_seed(2)
        assert torch.equal(ours(inp), want)


def test_reprs_show_every_non_default_setting():
    assert repr(mb.DropPath(0.5)) == "DropPath(drop_prob=0.500)"  # timm's repr
    assert repr(mb.DropPath(0.5, mode="batch")) == "DropPath(drop_prob=0.500, mode=batch)"
    # scale_by_keep is timm's setting and timm never shows it; mode and generator are ours
    assert repr(mb.DropPath(0.5, mode="batch", scale_by_keep=False)) == "DropPath(drop_prob=0.500, mode=batch)"
    assert repr(mb.DropPath(0.5, scale_by_keep=False)) == "DropPath(drop_prob=0.500)"
    assert repr(mb.DropPath(0.5, generator=torch.Generator())) == "DropPath(drop_prob=0.500, generator=torch.Generator('cpu'))"
    assert repr(mb.StochasticDepth(0.5, "batch")) == repr(tv_ops.StochasticDepth(0.5, "batch"))
    head = lambda m: repr(m).splitlines()[1].strip()
    assert head(mb.ResidualDropPath(lin(), 0.1)) == "drop_prob=0.100, mode=row"
    assert head(mb.ResidualDropPath(lin(), 0.1, scale_by_keep=False, kept="fixed")) == "drop_prob=0.100, mode=row, scale_by_keep=False, kept=fixed"
    assert head(mb.ResidualDropPath(lin(), 0.1, materialize_grads="none")) == "drop_prob=0.100, mode=row, materialize_grads=none"


def test_stochastic_depth_alias_is_torchvisions():
    ours, theirs = mb.StochasticDepth(0.4, "row"), tv_ops.StochasticDepth(0.4, "row")
    assert isinstance(ours, mb.DropPath) and (ours.p, ours.mode) == (theirs.p, theirs.mode)
    ours.p = 0.25
    assert ours.drop_prob == 0.25 and "p=0.25" in repr(ours)
    with pytest.raises((TypeError, ValueError), match="drop_prob"):
        ours.p = 1.5
    assert ours.p == 0.25  # the module keeps working after a bad value
    inp = torch.randn(32, 5)
    theirs.p = 0.25
    for training in (True, False):
        ours.train(training)
        theirs.train(training)
        torch.manual_seed(9)
        want = theirs(inp)
        torch.manual_seed(9)
        assert torch.equal(ours(inp), want)


def test_module_keeps_working_after_a_misread_call():
    drop = mb.DropPath(0.5, mode="batch")
    with pytest.raises(TypeError):
        mb.DropPath(0.5, "batch")
    drop.train()
    torch.manual_seed(1)
    out = drop(torch.ones(8, 2))
    assert out.shape == (8, 2) and set(out.unique().tolist()) <= {0.0, 2.0}
