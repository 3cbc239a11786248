"""Helpers shared by the test files (tests/conftest.py turns the common ones into fixtures).

* ``DEVICES`` / ``DTYPES`` / ``TOL``: the parametrizations every op test uses; CUDA cases skip
  without a GPU and a CUDA build.
* ``random_gate``: the gate kinds of MaskedBranch, drawn from a generator.
* ``run_ranks`` / ``results_of``: real multi-process jobs (spawned, gloo, as torchrun starts them).
* ``conversions_replace_parameters``: ``.to()`` that replaces parameter objects.
* ``accumulator_hooks``: hooks where DDP's reducer learns that a gradient is ready.
* ``training_state`` / ``state_diff``: parameters and gradients of a model, compared with a
  reference model's (the DDP, FSDP2 and pruning tests).
* ``ReferenceResidual``: the residual blocks ResidualDropPath replaces (timm's dense formula, or
  the block that skips its dropped rows' branch), drawing as it draws.
* ``rss``: resident memory of this process.
* ``Counting``: a torch.compile backend that counts the graphs it compiles and their calls, and
  keeps each graph's text.
"""
import contextlib
import os
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import maskedbranch as mb

GPU = torch.cuda.is_available() and mb.WITH_CUDA

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not GPU, reason="needs a GPU and a CUDA build")]),
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# The kernels accumulate in float32 (float64 for float64) and round once; references built from
# separate torch ops round at each step.
TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

GATE_KINDS = ["ids", "bool", "float"]


def random_gate(kind: str, batch: int, n: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """ids: int64 [B] in -1..n-1; bool: [B, n] about half live; float: [B, n] weights, 40% zero."""
    if kind == "ids":
        return torch.randint(-1, n, (batch,), generator=gen)
    if kind == "bool":
        return torch.rand(batch, n, generator=gen) < 0.5
    if kind == "float":
        g = torch.rand(batch, n, generator=gen)
        return torch.where(g < 0.4, torch.zeros_like(g), g).to(dtype)
    raise ValueError(f"unknown gate kind {kind!r}")


def run_ranks(worker, world: int, timeout_s: float, what: str = "the job"):
    """Per-rank results of ``worker(rank, world, init_file, out_dir)`` run on ``world`` spawned
    processes, each saving its result to ``out_dir/rank{rank}.pt``. Fails the test (and
    terminates the processes) when they do not finish within ``timeout_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(worker, args=(world, init_file, tmp), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    pytest.fail(f"{what} did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_scenarios(rank: int, world: int, init_file: str, out_dir: str, scenarios: dict, timeout_s: float = 90) -> None:
    """The body of a rank job for :func:`run_ranks`: each ``scenarios[name](rank, group)`` on a
    gloo group of its own, recorded as ("ok", value) or ("error", traceback) in
    ``out_dir/rank{rank}.pt`` (read back with :func:`results_of`)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    results = {}
    for name, fn in scenarios.items():
        group = dist.new_group(backend="gloo")
        try:
            results[name] = ("ok", fn(rank, group))
        except Exception:  # reported by the test that reads it
            results[name] = ("error", traceback.format_exc())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_job()


def leave_job(group=None) -> None:
    """The end of a rank job: a barrier, then the group's teardown. Without the barrier, torch
    2.6's gloo teardown hung now and then (2 runs in 15) in the rank that finished first."""
    dist.barrier(group=group)
    dist.destroy_process_group()


class _NoneGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def needs_none_grads() -> None:
    """Skips the calling test where torch's compiled autograd itself fails on a plain
    autograd.Function that returns None for an input requiring grad (torch 2.6)."""
    out = _NoneGrad.apply(torch.ones(2, requires_grad=True) * 2, torch.nn.Parameter(torch.ones(2)))
    try:
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
            out.sum().backward()
    except Exception as e:  # noqa: BLE001 - any failure is torch's answer
        pytest.skip(
            f"torch {torch.__version__}'s compiled autograd fails on a plain autograd.Function that "
            f"returns None for an input requiring grad ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )


def results_of(ranks, name: str):
    """What every rank recorded for scenario ``name`` as ("ok", value) or ("error", traceback):
    the values, after asserting that no rank failed."""
    out = []
    for r, res in enumerate(ranks):
        status, value = res[name]
        assert status == "ok", f"rank {r}, {name}:\n{value}"
        out.append(value)
    return out


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside the block, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def conversions_replace_parameters():
    """Inside, ``.to()`` / ``.double()`` put new Parameter objects in place (as
    ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` makes them do) instead of
    changing ``.data``; the previous setting is restored on exit."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)


def accumulator_hooks(params, fired: list) -> list:
    """Append each parameter to ``fired`` when its gradient accumulator runs: where DDP's reducer
    learns that a gradient is ready, which fires for an undefined gradient too (post-accumulate
    hooks do not on older torch). Keep the returned accumulators alive while it matters."""
    held = []
    for p in params:
        acc = p.view_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda grad_inputs, grad_outputs, p=p: fired.append(p))
        held.append(acc)
    return held


def rss() -> int:
    """Resident set size of this process in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def training_state(model) -> dict:
    """name -> (parameter, gradient or None), copied; DTensors (FSDP2) as full tensors (a
    collective: every rank calls it in the same order)."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return {
        k: (full(p.detach()).clone(), None if p.grad is None else full(p.grad.detach()).clone())
        for k, p in model.named_parameters()
    }


def state_diff(a: dict, b: dict):
    """(largest difference between the parameters and gradients of two training states, names
    whose gradient is None in one and not the other)."""
    worst, none_mismatch = 0.0, []
    for k, (p, g) in a.items():
        q, h = b[k]
        worst = max(worst, float((p - q).abs().max()))
        if (g is None) != (h is None):
            none_mismatch.append(k)
        elif g is not None:
            worst = max(worst, float((g - h).abs().max()))
    return worst, none_mismatch


class ReferenceResidual(torch.nn.Module):
    """The code ResidualDropPath replaces, drawing as it does (host Bernoulli draws from
    ``generator``, per row or per batch): ``dense=True``: timm's ``x + drop_path(branch(x))``
    (every row through the branch, dropped ones times 0: zero gradients when all are dropped);
    ``dense=False``: the block that skips the dropped rows' branch (``x + branch(x) / keep_prob``
    on the kept rows; no gradient at all when none is kept)."""

    def __init__(self, branch, drop_prob, mode, generator, dense):
        super().__init__()
        self.branch, self.drop_prob, self.mode, self.generator, self.dense = branch, drop_prob, mode, generator, dense

    def forward(self, x):
        keep = 1.0 - self.drop_prob
        mask = torch.empty(x.shape[0] if self.mode == "row" else 1).bernoulli_(keep, generator=self.generator)
        if self.dense:
            scale = (mask.to(x.dtype) * (1 / keep)).reshape((-1,) + (1,) * (x.dim() - 1))
            return x + self.branch(x) * scale
        rows = mask.nonzero().flatten() if self.mode == "row" else torch.arange(x.shape[0] if mask[0] else 0)
        if rows.numel() == 0:
            return x
        if rows.numel() == x.shape[0]:
            return x + self.branch(x) * (1 / keep)
        return x.index_add(0, rows, self.branch(x.index_select(0, rows)) * (1 / keep))


def autograd_node_names(out: torch.Tensor) -> set:
    """Class names of the autograd nodes in the graph behind ``out`` (which form of a routing
    Function ran: ``CombineClassicBackward`` in eager mode, ``CombineBackward`` otherwise)."""
    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


def assert_same_grads(got: dict, want: dict, none_is_zero: bool = False, **tol) -> None:
    """Two {name: gradient or None} dicts agree (undefined where the other is undefined, unless
    ``none_is_zero``: torch.func returns zeros where autograd leaves a gradient undefined)."""
    assert got.keys() == want.keys()
    for k in want:
        g, w = got[k], want[k]
        if none_is_zero:
            g = torch.zeros_like(w if g is None else g) if g is None and w is not None else g
            w = torch.zeros_like(g) if w is None and g is not None else w
        assert (g is None) == (w is None), f"{k}: defined in one run only"
        if w is not None:
            torch.testing.assert_close(g, w, msg=lambda m: f"{k}: {m}", **tol)


class Counting:
    """A torch.compile backend over ``inner`` (aot_eager by default) that counts the graphs it
    compiles and the calls of them, and keeps the text of every graph (``has``: whether one of
    them names ``name``, an op such as ``cond`` or ``maskedbranch.plan``) and its data-dependent
    sizes (``unbacked``: one set of symbols per graph)."""

    def __init__(self, inner: str = "aot_eager"):
        self.compiled, self.calls, self.inner, self.code, self.unbacked = 0, 0, inner, [], []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        self.compiled += 1
        self.code.append(str(gm.graph))
        def sizes(v) -> set:  # example values also hold other objects (torch 2.6: autograd contexts)
            if isinstance(v, (list, tuple)):
                return set().union(*(sizes(e) for e in v))
            return set(free_unbacked_symbols(v)) if isinstance(v, (torch.Tensor, torch.SymInt)) else set()

        self.unbacked.append(set().union(*(sizes(n.meta.get("example_value")) for n in gm.graph.nodes)))
        compiled = lookup_backend(self.inner)(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run

    def has(self, name: str) -> bool:
        return any(name in code for code in self.code)
