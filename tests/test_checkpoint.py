"""Activation checkpointing (torch.utils.checkpoint, reentrant and not) around MaskedBranch,
ResidualDropPath, DropPath and drop_add_residual: the same outputs and gradients as without
checkpointing (bitwise), with the routing plan and the drop mask replayed identically in the
recomputation (checked by recording what the branches receive in the forward and in the
recomputation), and replay_generators for generators of the user's own."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

import maskedbranch as mb
from harness import GPU
from maskedbranch.integrations.checkpoint import replay_generators

D = 6
B = 12


class Recorder(nn.Module):
    """A branch that records every input it gets (forward and recomputation)."""

    def __init__(self, d=D):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.seen = []

    def forward(self, x):
        if x.device.type != "meta":  # (not the probe of an all-dead call's output shape)
            self.seen.append(x.detach().clone())
        return self.fc2(torch.tanh(self.fc1(x)))


def grads(module):
    return {k: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for k, p in module.named_parameters()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


CKPT = ["plain", "reentrant"]  # checkpoint(..., use_reentrant=False / True)


def run(module, x, *args, ckpt=None, seed=0, context_fn=None):
    """Forward + backward, checkpointed with ``ckpt`` ("plain", "reentrant") or not (None);
    returns (out, grad of x, grads of module (None as zeros), names of the parameters whose
    grad is None)."""
    if isinstance(module, nn.Module):
        module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    if ckpt:
        kw = {} if context_fn is None else {"context_fn": context_fn}
        out = checkpoint(module, x, *args, use_reentrant=ckpt == "reentrant", **kw)
    else:
        out = module(x, *args)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    if out.requires_grad:  # (not when nothing ran and nothing is tied, as with if/else)
        (out * w).sum().backward()
    if not isinstance(module, nn.Module):
        return out.detach(), x.grad
    undefined = frozenset(k for k, p in module.named_parameters() if p.grad is None)
    return out.detach(), x.grad, grads(module), undefined


def gates(n=3):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, n, (B,), generator=g)
    mask = torch.rand(B, n, generator=g) < 0.5
    weights = torch.rand(B, n, generator=g, dtype=torch.float64) * mask
    return {
        "int": 1,
        "ids": ids,
        "ids_one_dead": ids.clamp(max=n - 2),
        "all_dead": torch.full((B,), -1),
        "mask": mask,
        "weights": weights,
    }


# ----------------------------------------------------------------------------------------------
# MaskedBranch


@pytest.mark.parametrize("ckpt", CKPT)
@pytest.mark.parametrize("materialize", [None, False, True])
@pytest.mark.parametrize("kind", list(gates()))
def test_masked_branch_same_gradients(kind, materialize, ckpt):
    torch.manual_seed(0)
    module = mb.MaskedBranch([Recorder() for _ in range(3)], materialize_grads=materialize).double()
    x = torch.randn(B, D, dtype=torch.float64)
    gate = gates()[kind]
    module(x, gate)  # first call (checks the branches on meta tensors) out of the way
    want = run(module, x, gate)
    for b in module:
        b.seen.clear()
    if kind == "all_dead" and materialize is None and ckpt == "reentrant":
        # nothing ran and nothing is tied: the output does not depend on x, which reentrant
        # checkpointing refuses, for the if/else model (zeros) as for this one
        for fn in (module, lambda x, gate: torch.zeros_like(x)):
            with pytest.raises(RuntimeError, match="none of output has requires_grad"):
                run(fn, x, gate, ckpt=ckpt)
        return
    got = run(module, x, gate, ckpt=ckpt)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert_same(got[2], want[2])
    # undefined stays undefined and zeros stay zeros (what DDP / FSDP2 see)
    assert got[3] == want[3]
    if materialize:
        assert not got[3]
    # the plan replayed: every branch that ran got the same rows twice (forward, recomputation)
    for b in module:
        assert len(b.seen) in (0, 2), len(b.seen)
        if b.seen:
            assert torch.equal(b.seen[0], b.seen[1])


@pytest.mark.parametrize("ckpt", CKPT)
def test_masked_branch_weights_gradient_and_router(ckpt):
    """A learned router inside the checkpointed region: gate weights get the same gradients."""
    torch.manual_seed(0)

    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(D, 3)
            self.mb = mb.MaskedBranch([Recorder() for _ in range(3)])

        def forward(self, x):
            probs = self.router(x).softmax(1)
            top = probs.topk(2, dim=1).indices
            keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top, True)
            return self.mb(x, probs * keep)

    module = Routed().double()
    x = torch.randn(B, D, dtype=torch.float64)
    want = run(module, x)
    got = run(module, x, ckpt=ckpt)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert_same(got[2], want[2])
    assert torch.count_nonzero(got[2]["router.weight"]) > 0


@pytest.mark.parametrize("ckpt", CKPT)
def test_masked_branch_function_form(ckpt):
    torch.manual_seed(0)
    branches = nn.ModuleList([Recorder() for _ in range(2)]).double()
    x = torch.randn(B, D, dtype=torch.float64)
    gate = torch.randint(0, 2, (B,), generator=torch.Generator().manual_seed(1))

    def fn(x, gate):
        return mb.masked_branch(list(branches), x, gate)

    outs = []
    for checkpointed in (False, True):
        branches.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        out = checkpoint(fn, xx, gate, use_reentrant=ckpt == "reentrant") if checkpointed else fn(xx, gate)
        out.square().sum().backward()
        outs.append((out.detach(), xx.grad, grads(branches)))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)
    assert_same(outs[1][2], outs[0][2])


# ----------------------------------------------------------------------------------------------
# ResidualDropPath / drop_add_residual / DropPath: the mask is drawn again in the recomputation.


@pytest.mark.parametrize("ckpt", CKPT)
@pytest.mark.parametrize("materialize", [None, True])
@pytest.mark.parametrize("mode", ["row", "batch"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_residual_drop_path_default_generator_replays(mode, seed, materialize, ckpt):
    torch.manual_seed(0)
    module = mb.ResidualDropPath(Recorder(), 0.5, mode=mode, materialize_grads=materialize).double().train()
    x = torch.randn(B, D, dtype=torch.float64)
    want = run(module, x, seed=seed)
    n_plain = len(module.branch.seen)
    module.branch.seen.clear()
    got = run(module, x, ckpt=ckpt, seed=seed)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert_same(got[2], want[2])
    seen = module.branch.seen
    assert len(seen) == 2 * n_plain  # ran in the forward and in the recomputation, or in neither
    if seen:
        assert torch.equal(seen[0], seen[1])  # the same kept rows
    assert got[3] == want[3]  # a skipped branch's parameters: zeros or None, as without checkpointing


def test_residual_drop_path_rows_really_dropped():
    """The seeds above exercise partial drops (else the replay check would be vacuous)."""
    torch.manual_seed(0)
    module = mb.ResidualDropPath(Recorder(), 0.5).double().train()
    x = torch.randn(B, D, dtype=torch.float64)
    sizes = []
    for seed in range(4):
        module.branch.seen.clear()
        run(module, x, seed=seed)
        sizes.append(module.branch.seen[0].shape[0] if module.branch.seen else 0)
    assert any(0 < s < B for s in sizes), sizes


@pytest.mark.parametrize("ckpt", CKPT)
def test_drop_add_residual_and_drop_path_in_checkpoint(ckpt):
    torch.manual_seed(0)
    branch = Recorder().double()
    dp = mb.DropPath(0.4).train()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.branch = branch

        def forward(self, x):
            x = mb.drop_add_residual(x, self.branch, 0.4, True)
            return x + dp(self.branch(x))

    block = Block()
    x = torch.randn(B, D, dtype=torch.float64)
    for seed in range(3):
        want = run(block, x, seed=seed)
        got = run(block, x, ckpt=ckpt, seed=seed)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert_same(got[2], want[2])


def test_user_generator_needs_replay_generators():
    """A generator of your own is not restored by checkpoint: the recomputation draws another
    mask (an error when the kept count changes, silently wrong gradients when it does not).
    replay_generators makes it draw the same one, and leaves the generator where it was."""
    torch.manual_seed(0)
    gen = torch.Generator()
    module = mb.ResidualDropPath(Recorder(), 0.5, generator=gen).double().train()
    x = torch.randn(64, D, dtype=torch.float64)

    gen.manual_seed(7)
    want = run(module, x)
    after_plain = gen.get_state()

    # without replay: the recomputation's mask differs
    gen.manual_seed(7)
    module.branch.seen.clear()
    try:
        got = run(module, x, ckpt="plain")
    except CheckpointError:
        pass  # the kept counts differed
    else:
        assert not torch.equal(module.branch.seen[0], module.branch.seen[1])
        assert any(not torch.equal(got[2][k], want[2][k]) for k in want[2])

    # with replay_generators: identical, and the generator ends where the plain run left it
    gen.manual_seed(7)
    module.branch.seen.clear()
    got = run(module, x, ckpt="plain", context_fn=replay_generators(module))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert_same(got[2], want[2])
    assert torch.equal(module.branch.seen[0], module.branch.seen[1])
    assert torch.equal(gen.get_state(), after_plain)


def test_replay_generators_collects_and_restores():
    """Generators given directly and those of the modules' submodules are replayed, each once,
    and left where the forward left them."""
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    model = nn.Sequential(mb.ResidualDropPath(nn.Linear(2, 2), 0.1, generator=g1), mb.DropPath(0.1, generator=g1), mb.DropPath(0.1))
    forward_ctx, recompute_ctx = replay_generators(model, g2, g1)()  # states recorded here
    first = [torch.rand(3, generator=g) for g in (g1, g1, g2)]
    after = [g.get_state() for g in (g1, g2)]
    with forward_ctx, recompute_ctx:
        again = [torch.rand(3, generator=g) for g in (g1, g1, g2)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(g.get_state(), s) for g, s in zip((g1, g2), after))
    with pytest.raises(TypeError, match="replay_generators: argument 1 is a int"):
        replay_generators(model, 3)


@pytest.mark.parametrize("ckpt", CKPT)
def test_nested_blocks_each_checkpointed(ckpt):
    """A stack of blocks, each checkpointed on its own (as timm's checkpoint_seq does)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        [mb.ResidualDropPath(Recorder(), p, mode=m) for p, m in [(0.3, "row"), (0.5, "batch"), (0.6, "row")]]
    ).double().train()
    router = mb.MaskedBranch([Recorder() for _ in range(3)]).double()

    class Net(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.blocks, self.router, self.ckpt = blocks, router, ckpt

        def forward(self, x, gate):
            reentrant = self.ckpt == "reentrant"
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=reentrant) if self.ckpt else blk(x)
            return checkpoint(self.router, x, gate, use_reentrant=reentrant) if self.ckpt else self.router(x, gate)

    x = torch.randn(B, D, dtype=torch.float64)
    gate = gates()["ids"]
    for seed in range(3):
        want = run(Net(None), x, gate, seed=seed)
        got = run(Net(ckpt), x, gate, seed=seed)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert_same(got[2], want[2])


@pytest.mark.cuda
@pytest.mark.skipif(not GPU, reason="needs a GPU and a CUDA build")
def test_cuda_residual_drop_path_replays():
    """On a GPU the mask is still drawn on the host (default CPU generator), which checkpoint
    restores along with the device's generator."""
    torch.manual_seed(0)
    module = mb.ResidualDropPath(Recorder(), 0.5).cuda().train()
    router = mb.MaskedBranch([Recorder() for _ in range(3)]).cuda()
    x = torch.randn(B, D, device="cuda")
    for seed in range(3):
        want = run(module, x, seed=seed)
        got = run(module, x, ckpt="plain", seed=seed)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert_same(got[2], want[2])
    gate = gates()["ids"]  # a host gate with a device x
    want = run(router, x, gate)
    got = run(router, x, gate, ckpt="plain")
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert_same(got[2], want[2])
