"""maskedbranch.integrations.timm on every tested family: each tiny model patched against timm's
(state_dict keys, eval bitwise, training with the same masks and all gradients, rows actually
skipped, fx as timm), and the residual patterns the rewrite recognizes.

The masks are made identical as tests/test_timm_integration.py explains."""
import copy
import warnings

import pytest
import torch
from torch import nn

from timm_models import (  # skips the module when timm is not usable
    BATCH,
    DropPath,
    FAMILIES,
    RowCounter,
    assert_grads_equal,
    freeze_batch_norms,
    fx_outcome,
    images,
    mb_timm,
    pair,
    run,
)


def test_mask_streams_match():
    """timm's draw and maskedbranch's consume the default generator identically."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        torch.manual_seed(123)
        timm_mask = torch.empty(64, 1, 1, dtype=dtype).bernoulli_(0.6)
        torch.manual_seed(123)
        ours = torch.empty(64, dtype=torch.float32).bernoulli_(0.6)
        assert torch.equal(timm_mask.flatten().float(), ours)


# float64 for exact comparisons, except where float64 convolutions (no oneDNN) would dominate CI
FLOAT32 = {
    "fastvit", "mobilenetv3", "efficientnet", "maxvit", "coatnet", "hiera", "convformer", "efficientformer", "pvt_v2",
    "focalnet", "edgenext", "tiny_vit", "poolformer",
}
# float32: the patched branch's gradients sum over the kept rows only, in another order than the
# dense formula's sum over every row (zeros included); with AVX-512 kernels a bias gradient of
# tiny_vit summed to 3.05e-5 away from timm's (its entries cancel to about 0.02).
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=2e-4, atol=5e-5)}


# The slowest families (about 4 s or more each on 2 cores) run in the full suite only.
SLOW = {"mobilenetv3", "fastvit", "efficientnet", "focalnet", "tiny_vit", "maxvit", "convformer"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in FAMILIES])
def test_family(name):
    dtype = torch.float32 if name in FLOAT32 else torch.float64
    original, patched, report = pair(name, dtype)
    owners = {n for n, m in original.named_modules() if any(isinstance(c, DropPath) for c in m.children())}
    assert report.converted and not report.skipped and set(report.converted) <= owners
    for n in report.converted:
        block = patched.get_submodule(n)
        assert mb_timm.is_patched(block) and isinstance(block, type(original.get_submodule(n)))
    assert list(patched.state_dict()) == list(original.state_dict())
    patched.load_state_dict(original.state_dict())  # checkpoints load both ways
    original.load_state_dict(patched.state_dict())

    x = images(FAMILIES[name][1], dtype)
    original.eval(), patched.eval()
    with torch.no_grad():
        assert torch.equal(patched(x), original(x))

    original.train(), patched.train()
    freeze_batch_norms(original, patched)
    with RowCounter(original) as dense:
        want, want_grads = run(original, x, 3)
    with RowCounter(patched) as counted:
        got, got_grads = run(patched, x, 3)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert_grads_equal(got_grads, want_grads, **TOL[dtype])
    assert all(g is not None for g in got_grads.values())  # timm's test_model_backward
    assert counted.rows < dense.rows  # the dropped samples' branches did not run
    assert not torch.allclose(run(original, x, 4)[0], want)  # the masks matter

    assert fx_outcome(patched) == fx_outcome(original)  # traces as timm's (train mode)


def test_report_notes():
    _, _, report = pair("resnet")
    assert report.notes and all("BatchNorm" in v for v in report.notes.values())
    _, _, report = pair("edgenext")
    assert any("another drop path" in v for v in report.notes.values())  # nested residuals
    _, _, report = pair("tiny_vit")
    assert any("input shapes" in v for v in report.notes.values())  # traced at the first call
    text = str(report)
    assert "converted" in text and "note" in text and len(report) == len(report.converted)






class Blocks:
    """Blocks holding timm's DropPath, each a pattern the rewrite must handle."""

    class PostAct(nn.Module):  # an activation after the add (ResNet-like)
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            return torch.relu(x + self.drop_path(self.fc(x)))

    class NoShortcut(nn.Module):  # drop path on the whole output: the masked form
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            return nn.functional.gelu(self.drop_path(self.fc(x))) + 1

    class SharedNorm(nn.Module):  # two residuals reading one norm output
        def __init__(self):
            super().__init__()
            self.norm, self.a, self.b = nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 6)
            self.drop_path1, self.drop_path2 = DropPath(0.5), DropPath(0.3)

        def forward(self, x):
            n = self.norm(x)
            return x + self.drop_path1(self.a(n)) + self.drop_path2(self.b(n))

    class Tokens(nn.Module):  # the batch size read once, reused inside the branch and the tail
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)
            self.gamma = nn.Parameter(torch.full((6,), 0.5))

        def forward(self, x):
            B, N, C = x.shape
            y = self.fc(x.reshape(B * N, C)).reshape(B, N * C)
            return x + self.gamma * self.drop_path(y).view(B, N, C)

    class InPlace(nn.Module):  # base.add_(...), with base read again afterwards (fx records
        def __init__(self):  # ``x += y`` on a proxy as ``x = x + y``, as timm's fx tracing does)
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            x = x * 1.0
            s = x
            x.add_(self.drop_path(self.fc(x * 2)))  # (fc does not save x, which changes)
            return x + s

    class PerToken(nn.Module):  # drops rows of [B * N, C]: tokens, not samples
        def __init__(self):
            super().__init__()
            self.fc, self.drop_path = nn.Linear(6, 6), DropPath(0.5)

        def forward(self, x):
            B, N, C = x.shape
            return x + self.drop_path(self.fc(x.reshape(B * N, C))).view(B, N, C)


@pytest.mark.parametrize("name", ["PostAct", "NoShortcut", "SharedNorm", "Tokens", "InPlace", "PerToken"])
def test_residual_patterns(name):
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(6, 6), getattr(Blocks, name)(), getattr(Blocks, name)()).double()
    patched = copy.deepcopy(original)
    report = mb_timm.patch(patched)
    assert sorted(report.converted) == ["1", "2"]
    original.train(), patched.train()
    x = torch.randn(BATCH, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RowCounter(patched) as counted:
            got, got_grads = run(patched, x, 5)
    with RowCounter(original) as dense:
        want, want_grads = run(original, x, 5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_grads_equal(got_grads, want_grads, rtol=1e-10, atol=1e-12)
    warned = [str(w.message) for w in caught if "maskedbranch" in str(w.message)]
    if name == "PerToken":  # timm's semantics kept (tokens dropped), with a warning
        assert warned and "not the samples" in warned[0] and counted.rows == dense.rows
    else:
        assert not warned and counted.rows < dense.rows
