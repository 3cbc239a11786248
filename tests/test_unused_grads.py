"""The step-time pruning (maskedbranch/unused_grads.py), in one process: parameters of branches
that no rank ran get a None gradient before the optimizer step, so that training equals if/else
routing with find_unused_parameters=True (momentum, Adam moments and weight decay leave them
alone). The explicit handle (``unused_grads_to_none``) with modules that materialize zero
gradients, its edge cases, and where the reduced bytes must live per backend. The 2-rank gloo
jobs are in tests/test_unused_grads_ddp.py.
"""
import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from maskedbranch import MaskedBranch, ResidualDropPath, unused_grads, unused_grads_to_none

from harness import leave_job, run_ranks, state_diff, training_state
from unused_grads_model import D, N, ROWS, Net, data, grads_none, loss_of, mlp, sgd


def test_dead_branches_pruned_and_optimizer_state_untouched():
    torch.manual_seed(0)
    model = Net().double()
    opt = sgd(model.parameters())
    handle = unused_grads_to_none(opt, model)
    loss_of(model, 0, [0, 2]).backward()
    assert all(p.grad is not None for p in model.parameters())  # zeros before the step ...
    opt.step()
    assert handle.last_reset == 2 * 2 * 4  # ... 2 layers x 2 unused branches x 4 tensors pruned
    for layer, used in zip(model.layers, (0, 2)):
        for i, branch in enumerate(layer):
            for p in branch.parameters():
                assert (p.grad is not None) == (i == used) and (p in opt.state) == (i == used)
    assert model.pre.weight.grad is not None and model.head.weight.grad is not None


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_matches_ifelse_in_one_process(optimizer):
    torch.manual_seed(1)
    masked = Net().double()
    ifelse = Net(masked=False).double()
    ifelse.load_state_dict(masked.state_dict())
    make = sgd if optimizer == "sgd" else (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=1e-2))
    opts = [make(m.parameters()) for m in (masked, ifelse)]
    unused_grads_to_none(opts[0], masked)
    for step in range(8):
        gates = [step % N, torch.randint(-1, N - 1, (ROWS,), generator=torch.Generator().manual_seed(step))]
        for m, opt in zip((masked, ifelse), opts):
            opt.zero_grad()
            loss_of(m, step, gates).backward()
            opt.step()
        worst, none_mismatch = state_diff(training_state(masked), training_state(ifelse))
        assert worst < 1e-12 and not none_mismatch, (step, worst, none_mismatch)
    assert len(opts[0].state) == len(opts[1].state)


def test_no_grad_calls_do_not_count():
    model = Net().double()
    opt = sgd(model.parameters())
    handle = unused_grads_to_none(opt, model)
    loss_of(model, 0, [0, 0]).backward()
    with torch.no_grad():
        model(data(0)[0], [1, 1])  # an evaluation between backward and step
    opt.step()
    assert handle.last_reset == 2 * 2 * 4
    assert all(grads_none(model.layers[0][1]))


def test_calls_outside_the_forward_do_not_count():
    """A routed layer called on its own, outside the model's forward (a probe, eagerly or
    compiled: a compiled call writes the unit's tensor record), uses nothing: the model's next
    forward clears what such calls recorded."""
    model = Net().double()
    opt = sgd(model.parameters())
    handle = unused_grads_to_none(opt, model)
    loss_of(model, 0, [0, 0]).backward()  # the units decide for the model
    opt.step()
    opt.zero_grad()
    layer = model.layers[0]
    h = torch.randn(ROWS, D, dtype=torch.float64)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    # (torch < 2.13 turns these on only when asked: the tensor gate's row counts are data)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled(h, torch.full((ROWS,), 1)).sum().backward()
    layer(h, 2).sum().backward()
    opt.zero_grad()
    loss_of(model, 1, [0, 0]).backward()
    opt.step()
    assert handle.last_reset == 2 * 2 * 4
    assert all(grads_none(layer[1])) and all(grads_none(layer[2])) and not any(grads_none(layer[0]))


def test_use_accumulates_until_the_step():
    """Gradient accumulation: a branch used by any micro-batch since the last step is kept."""
    model = Net().double()
    opt = sgd(model.parameters())
    handle = unused_grads_to_none(opt, model)
    for gates in ([0, 0], [1, 0]):
        loss_of(model, 0, gates).backward()
    opt.step()
    assert handle.last_reset == (1 + 2) * 4  # layer 0: branch 2; layer 1: branches 1 and 2
    opt.zero_grad()
    loss_of(model, 1, [2, 2]).backward()
    opt.step()  # the step reset what was used
    assert handle.last_reset == 2 * 2 * 4


def test_several_optimizers_prune_their_own_parameters():
    model = Net().double()
    first = sgd(model.layers[0].parameters())
    rest = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("layers.0.")], lr=0.01)
    handles = [unused_grads_to_none(first, model), unused_grads_to_none(rest, model)]
    loss_of(model, 0, [1, 2]).backward()
    first.step()
    assert handles[0].last_reset == 2 * 4 and all(grads_none(model.layers[0][0])) and not any(grads_none(model.layers[0][1]))
    assert not any(grads_none(model.layers[1][0]))  # not this optimizer's: untouched so far
    rest.step()
    assert handles[1].last_reset == 2 * 4 and all(grads_none(model.layers[1][0])) and not any(grads_none(model.layers[1][2]))


def test_one_branch_split_across_two_optimizers():
    """Weights in one optimizer, biases in another (as with Muon and AdamW): each step judges
    what ran since its own previous step, so the second one still sees the branch that ran."""
    model = Net().double()
    names = dict(model.named_parameters())
    opts = [sgd([p for n, p in names.items() if n.endswith("weight")]),
            torch.optim.AdamW([p for n, p in names.items() if n.endswith("bias")], lr=0.01)]
    for opt in opts:
        unused_grads_to_none(opt, model)
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        loss_of(model, step, [step, 0]).backward()
        for opt in opts:
            opt.step()
        for i, branch in enumerate(model.layers[0]):
            assert grads_none(branch) == [i != step] * 4, (step, i)


def test_branch_added_after_construction():
    """Inserted without the optimizer knowing it: never pruned, and the other branches' flags
    do not shift. Appended and given to the optimizer: pruned like the others."""
    model = Net().double()
    inserted, appended = mlp().double(), mlp().double()
    opt = sgd(model.parameters())
    unused_grads_to_none(opt, model)
    loss_of(model, 0, [0, 0]).backward()
    opt.step()
    opt.zero_grad()
    model.layers[0].insert(N, inserted)
    loss_of(model, 1, [N, 0]).backward()
    opt.step()
    assert not any(grads_none(inserted))
    assert [all(grads_none(b)) for b in model.layers[1]] == [False, True, True]
    model.layers[1].append(appended)
    opt.add_param_group({"params": list(appended.parameters())})
    opt.zero_grad()
    loss_of(model, 2, [0, 0]).backward()
    for p in appended.parameters():  # a stale gradient: pruned since the branch did not run
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(grads_none(appended)) and all(grads_none(model.layers[1][1]))


def test_parameters_shared_with_the_trunk_are_never_pruned():
    trunk = nn.Linear(D, D)
    a, b, c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
    b.weight = a.weight  # shared by branches 0 and 1
    c.weight = trunk.weight  # shared with the trunk

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = trunk
            self.mb = MaskedBranch([a, b, c], materialize_grads=True)

        def forward(self, x, gate):
            return self.mb(self.trunk(x), gate)

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    unused_grads_to_none(opt, model)
    x = torch.randn(3, D)
    model(x, 1).sum().backward()
    opt.step()
    assert a.weight.grad is not None  # used through branch 1
    assert a.bias.grad is None and c.bias.grad is None
    assert c.weight.grad is not None  # the trunk's weight
    opt.zero_grad()
    model(x, 2).sum().backward()
    opt.step()
    assert a.weight.grad is None and a.bias.grad is None and b.bias.grad is None and c.weight.grad is not None


def test_nested_and_residual_drop_path():
    inner = MaskedBranch([mlp(), mlp()], materialize_grads=True)
    outer = MaskedBranch([nn.Sequential(inner), mlp()], materialize_grads=True)
    rdp = ResidualDropPath(mlp(), drop_prob=0.999, mode="batch", generator=torch.Generator().manual_seed(0), materialize_grads=True)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer, self.rdp = outer, rdp

        def forward(self, x, k, j):
            return self.rdp(self.outer(x, k) if k != 0 else inner(x, j))

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = unused_grads_to_none(opt, model)
    x = torch.randn(4, D)
    model(x, 1, 0).sum().backward()
    opt.step()
    assert all(grads_none(outer[0])) and not any(grads_none(outer[1])) and all(grads_none(rdp))
    assert handle.last_reset == 2 * 4 + 4
    opt.zero_grad()
    model(x, 0, 1).sum().backward()  # inner called directly: one unit of its parameters ran
    opt.step()
    assert not any(grads_none(inner[1])) and all(grads_none(inner[0])) and all(grads_none(outer[1]))
    assert handle.last_reset == 4 + 4  # inner branch 0 and the dropped block (outer[1] had none)


def test_a_step_skipped_by_grad_scaler_leaves_what_zero_grad_cleared():
    """GradScaler skips optimizer.step() (and its hook) when a gradient is inf. What ran in that
    iteration counts only until zero_grad clears its gradients, as for if/else: a branch used
    in the skipped iteration only has no gradient at the next step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    model = Net().float()
    opt = sgd(model.parameters())
    handle = unused_grads_to_none(opt, model)
    x, t = data(0)
    scaler.scale((model(x.float(), [1, 1]) - t.float()).square().mean()).backward()
    model.head.weight.grad[0, 0] = float("inf")
    scaler.step(opt)  # skipped
    scaler.update()
    assert handle.last_reset == 0 and model.layers[0][1][0].weight.grad is not None
    opt.zero_grad()
    scaler.scale((model(x.float(), [0, 0]) - t.float()).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(grads_none(model.layers[0][2]))  # used in neither iteration
    assert all(grads_none(model.layers[0][1]))  # used in the skipped one only: cleared by zero_grad
    assert not any(grads_none(model.layers[0][0]))


def test_remove_and_bad_inputs():
    model = Net().double()
    opt = sgd(model.parameters())
    handle = unused_grads_to_none(opt, model)
    handle.remove()
    loss_of(model, 0, [0, 0]).backward()
    opt.step()
    assert model.layers[0][1][0].weight.grad is not None  # not pruned any more
    with pytest.raises(TypeError, match="optimizer"):
        unused_grads_to_none(model, model)
    with pytest.raises(TypeError, match="model"):
        unused_grads_to_none(opt, [model])
    with pytest.raises(ValueError, match="model: contains no MaskedBranch"):
        unused_grads_to_none(opt, nn.Linear(2, 2))


def _cpu_group_job(rank, world, init_file, out_dir):
    from maskedbranch import _layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    found = {}
    world_group = _layout.cpu_group(None)
    found["world is its own gloo group"] = world_group is not dist.group.WORLD and dist.get_backend(world_group) == "gloo"
    found["made once"] = _layout.cpu_group(None) is world_group
    group = dist.new_group(backend="gloo")
    own = _layout.cpu_group(group)
    found["one per group"] = own is not group and own is not world_group and dist.get_process_group_ranks(own) == [0, 1]
    alone = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
    found["a group of one rank has none"] = _layout.cpu_group(alone) is None
    groups = [weakref.ref(g) for g in (dist.group.WORLD, world_group, group, own, alone)]
    del world_group, group, own, alone
    leave_job()
    # Each group's own gloo group goes with it: nothing here keeps a destroyed group (nor its
    # worker threads) to the interpreter's teardown.
    gc.collect()
    found["gone with their groups"] = [g() for g in groups] == [None] * 5
    torch.save(found, os.path.join(out_dir, f"rank{rank}.pt"))


def test_usage_reduces_on_a_cpu_group():
    """The bits go to a gloo group of their own over the wrapper's ranks, made once per group (no
    device in the loop, never queued behind the wrapper's own collectives), beside NCCL too
    (tests/test_unused_grads.py's GPU case runs it); a group of one rank reduces nothing."""
    for found in run_ranks(_cpu_group_job, 2, 120, "the cpu group job"):
        assert found == {k: True for k in found} and len(found) == 5, found


def test_functional_call_ties_the_swapped_in_tensors():
    """torch.func.functional_call outside any transform: the tensors handed in get the dead
    branches' zero gradients, the module's own parameters nothing."""
    torch.manual_seed(0)
    module = MaskedBranch([nn.Linear(D, D) for _ in range(N)], materialize_grads=True)
    module(torch.randn(2, D), 0).sum().backward()  # the cache holds the module's own parameters
    for p in module.parameters():
        p.grad = None
    swapped = {k: v.detach().clone().requires_grad_(True) for k, v in module.named_parameters()}
    out = torch.func.functional_call(module, swapped, (torch.randn(2, D), 1))
    out.sum().backward()
    assert all(p.grad is None for p in module.parameters())
    assert swapped["0.weight"].grad is not None and not swapped["0.weight"].grad.any()  # dead: zeros
    assert swapped["1.weight"].grad is not None and swapped["1.weight"].grad.any()


def test_the_step_hook_goes_with_the_last_routing_module():
    """Importing maskedbranch registers no hook; the optimizer step pre-hook, once something
    needed it (a reducer), goes when the last routing module and reducer are gone (when it comes:
    tests/test_process_wide_hooks.py)."""
    import gc

    from maskedbranch import _reducer

    gc.collect()
    if unused_grads._hook.units or _reducer.all_reducers():
        pytest.skip("routing modules of other tests are still alive")
    assert unused_grads._hook.handle is None
    m = MaskedBranch([nn.Linear(2, 2)])
    model = nn.Sequential(m)
    handle = unused_grads_to_none(torch.optim.SGD(m.parameters(), lr=0.1), model)
    assert unused_grads._hook.handle is not None
    handle.remove()
    del m, model, handle
    gc.collect()
    assert unused_grads._hook.handle is None


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()), reason="needs a GPU and NCCL")
def test_nccl_group_reduces_on_the_device(tmp_path):
    """A one-process NCCL group: the bytes are reduced on a gloo group beside it, and the reset is right."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        model = Net().cuda()
        opt = sgd(model.parameters())
        handle = unused_grads_to_none(opt, model)
        x, t = data(0)
        (model(x.float().cuda(), [0, 1]) - t.float().cuda()).square().mean().backward()
        opt.step()
        assert handle.last_reset == 2 * 2 * 4
        assert all(grads_none(model.layers[0][1])) and not any(grads_none(model.layers[1][1]))
    finally:
        dist.destroy_process_group()


class _Counting:
    """Counts calls of a function of a module (monkeypatched in)."""

    def __init__(self, monkeypatch, module, name):
        self.calls, fn = 0, getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def test_int_gate_in_a_training_loop_calls_the_branch_and_decides_once(monkeypatch):
    """A routed int-gate call between optimizer steps, as users train: the chosen branch is
    called directly (no routing path), whatever the optimizer did before, and each module decides
    what its dead parameters get once, not per call or per step."""
    from maskedbranch import _route, _unit, _reducer

    torch.manual_seed(7)
    layers = nn.ModuleList(MaskedBranch([mlp() for _ in range(N)]) for _ in range(4))
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    routed = _Counting(monkeypatch, _route, "route")
    decided = _Counting(monkeypatch, _reducer, "decide")
    monkeypatch.setattr(_unit.DATA_PARALLEL, "decide", _reducer.decide)  # the seam holds the function itself
    x = torch.randn(ROWS, D)
    for step in range(6):
        h = x
        for i, layer in enumerate(layers):
            h = h + layer(h, (step + i) % N)
        h.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert routed.calls == 0
    assert decided.calls == len(layers)
