"""Arguments of the four drop-path forms (DropPath, drop_path, ResidualDropPath,
drop_add_residual): one keyword-only order, bool checks that catch torchvision's argument order,
the deprecated positional settings of 0.2, reprs that show every non-default setting, and
torchvision's StochasticDepth spelling."""
import warnings

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
    "drop_path torchvision order": (lambda: mb.drop_path(x(), 0.5, "batch", True), r"^drop_path: training: expected a bool, got str 'batch'; the argument order is drop_path\(x, drop_prob, training, \*, mode="),
    "drop_add_residual torchvision order": (lambda: mb.drop_add_residual(x(), lin(), 0.5, "batch"), r"^drop_add_residual: training: expected a bool, got str 'batch'; the argument order is drop_add_residual\(x, branch,"),
    "stochastic_depth training str": (lambda: mb.stochastic_depth(x(), 0.5, "batch", "yes"), r"^stochastic_depth: training: expected a bool, got str 'yes'$"),
    "DropPath mode in scale_by_keep's place": (lambda: mb.DropPath(0.5, "batch"), r"^DropPath: scale_by_keep: expected a bool, got str 'batch'\. The settings after drop_prob are keyword-only: write DropPath\(\.\.\., mode='batch'\)"),
    "DropPath scale_by_keep int": (lambda: mb.DropPath(0.5, scale_by_keep=1), r"^scale_by_keep: expected a bool, got int 1"),
    "drop_path training int": (lambda: mb.drop_path(x(), 0.5, 1), r"^drop_path: training: expected a bool, got int 1$"),
    "ResidualDropPath mode int": (lambda: mb.ResidualDropPath(lin(), 0.1, 3), r"^ResidualDropPath: mode: expected 'row' or 'batch', got int"),
    "ResidualDropPath too many positional": (lambda: mb.ResidualDropPath(lin(), 0.1, "row", True, None), r"^ResidualDropPath: takes at most 4 positional arguments"),
    "drop_path twice": (lambda: mb.drop_path(x(), 0.5, True, True, scale_by_keep=True), r"^drop_path: got scale_by_keep both positionally and by name$"),
    "drop_path unknown mode": (lambda: mb.drop_path(x(), 0.5, True, mode="rows"), r"mode"),
}


@pytest.mark.parametrize("name", list(MISREAD))
def test_misread_arguments_raise_naming_the_argument(name):
    call, message = MISREAD[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError if name != "drop_path unknown mode" else (TypeError, ValueError), match=message):
            call()


def test_torchvision_order_never_runs_in_row_mode():
    """The silent case of 0.2: the string landed in `training` and the call ran in row mode."""
    with pytest.raises(TypeError):
        mb.drop_path(x(), 0.5, "batch", True)
    # torchvision's own spelling, argument for argument, equals torchvision's for the same seed
    inp = torch.randn(64, 3)
    for mode in ("row", "batch"):
        torch.manual_seed(3)
        want = tv_ops.stochastic_depth(inp, 0.5, mode, True)
        torch.manual_seed(3)
        assert torch.equal(mb.stochastic_depth(inp, 0.5, mode, True), want)


def settings(module):
    return module.mode, module.scale_by_keep


@pytest.mark.parametrize(
    "positional, keywords, form",
    [
        ((False,), {"scale_by_keep": False}, "DropPath"),
        ((False, "batch"), {"scale_by_keep": False, "mode": "batch"}, "DropPath"),
        (("batch", False), {"mode": "batch", "scale_by_keep": False}, "ResidualDropPath"),
        (("batch",), {"mode": "batch"}, "ResidualDropPath"),
    ],
)
def test_deprecated_positional_settings_warn_and_match_keywords(positional, keywords, form):
    make = (lambda *a, **k: mb.DropPath(0.5, *a, **k)) if form == "DropPath" else (lambda *a, **k: mb.ResidualDropPath(lin(), 0.5, *a, **k))
    with pytest.warns(DeprecationWarning, match=rf"^{form}: passing .* positionally is deprecated; pass (it|them) by name"):
        old = make(*positional)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the keyword spelling does not warn
        new = make(**keywords)
    assert settings(old) == settings(new) and repr(old) == repr(new)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_deprecated_positional_functional_forms_give_the_keyword_results(mode):
    inp = torch.randn(16, 4)
    branch = lin()
    for old_call, new_call in [
        (lambda g: mb.drop_path(inp, 0.5, True, False, mode, g), lambda g: mb.drop_path(inp, 0.5, True, scale_by_keep=False, mode=mode, generator=g)),
        (lambda g: mb.drop_add_residual(inp, branch, 0.5, True, mode, False, g), lambda g: mb.drop_add_residual(inp, branch, 0.5, True, mode=mode, scale_by_keep=False, generator=g)),
    ]:
        with pytest.warns(DeprecationWarning):
            old = old_call(torch.Generator().manual_seed(5))
        assert torch.equal(old, new_call(torch.Generator().manual_seed(5)))


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
