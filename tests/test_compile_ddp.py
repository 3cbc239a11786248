"""torch.compile under DDP, 2 gloo ranks, ``find_unused_parameters=False``: a routed model whose
ranks route differently every step trains as the if/else model under
``DistributedDataParallel(find_unused_parameters=True)`` in eager mode (parameters and
gradients, None included, after every step), compiled either way round (``torch.compile`` of
the DDP model, DDP's DDPOptimizer splitting the graph; or DDP around a compiled model), and the
graphs stop growing after the first steps (the routing is data). With a Python int path (each
rank its own choice, -1 included) the choice is inlined, a graph per choice as for if/else: the
wrapper ties the choices not taken, which are not in that graph.

The graphs are counted with a backend over aot_eager. DDP cannot be compiled with fullgraph=True,
so the two capture flags are set, as docs/guides/compile.md tells users to.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import maskedbranch as mb

from harness import Counting, results_of, run_ranks, run_scenarios, state_diff, training_state

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")]

WORLD, N, D, ROWS, STEPS = 2, 3, 6, 8, 8


def mlp():
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, D))


class Net(nn.Module):
    """An ids-gated layer, an int-path layer (a 0-d tensor) and a batch-mode drop path (auto
    setting: if/else semantics); the if/else model routes in Python. One branch of the first
    layer never runs."""

    def __init__(self, masked):
        super().__init__()
        torch.manual_seed(4)
        self.masked = masked
        self.pre = nn.Linear(4, D)
        make = (lambda: mb.MaskedBranch([mlp() for _ in range(N)])) if masked else (lambda: nn.ModuleList(mlp() for _ in range(N)))
        self.a, self.b = make(), make()
        self.c = mb.ResidualDropPath(mlp(), 0.5, mode="batch", materialize_grads=None) if masked else nn.Module()
        if not masked:
            self.c.branch = mlp()  # the same state_dict keys
        self.head = nn.Linear(D, 2)

    def forward(self, x, ids, k):
        h = torch.tanh(self.pre(x))
        if self.masked:
            h = h + self.a(h, ids)
            h = h + self.b(h, k)
            h = self.c(h)  # draws from the default CPU generator, compiled or not
        else:
            y = mb.reference.masked_branch_ifelse(list(self.a), h, ids)
            h = h + (0 if y is None else y)
            h = h + (self.b[int(k)](h) if int(k) >= 0 else 0)
            if bool(torch.empty(1).bernoulli_(0.5)):
                h = h + self.c.branch(h) * 2.0
        return self.head(h)


def batch(step, rank, int_path=False):
    g = torch.Generator().manual_seed(step * 101 + rank * 13)
    x, t = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)
    ids = torch.randint(-1, N - 1, (ROWS,), generator=g)
    if int_path:  # a Python int, -1 included: inlined, a graph per choice
        return x, t, ids, (step + rank) % (N + 1) - 1
    k = torch.tensor((step + rank) % N)  # a 0-d tensor: data to the compiler
    return x, t, ids, k


def train(rank, group, order, int_path=False):
    # DDP cannot be compiled with fullgraph=True (its own forward breaks the graph), so the routing
    # needs the two capture flags to stay in the graph (docs/guides/compile.md).
    flags = torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)
    torch.compiler.reset()
    masked, ifelse = Net(True).double(), Net(False).double()
    ifelse.load_state_dict(masked.state_dict())
    backend = Counting()
    if order == "compile_ddp":
        model = torch.compile(DDP(masked, process_group=group), backend=backend)
    else:
        model = DDP(torch.compile(masked, backend=backend), process_group=group)
    reference = DDP(ifelse, process_group=group, find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01) for m in (masked, ifelse)]
    worst, none_mismatch, graphs = 0.0, [], []
    with flags:
        for step in range(STEPS):
            x, t, ids, k = batch(step, rank, int_path)
            for m, opt in zip((model, reference), opts):
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(1000 * step + rank)  # the same drop-path draw for both
                (m(x.double(), ids, k) - t.double()).square().mean().backward()
                opt.step()
            w, nm = state_diff(training_state(masked), training_state(ifelse))
            worst, none_mismatch = max(worst, w), none_mismatch + [(step, n) for n in nm]
            graphs.append(backend.compiled)
    return {"worst": worst, "none_mismatch": none_mismatch, "graphs": graphs}


SCENARIOS = {
    "compile_ddp": lambda rank, group: train(rank, group, "compile_ddp"),
    "ddp_compiled": lambda rank, group: train(rank, group, "ddp_compiled"),
    "compile_ddp, int path": lambda rank, group: train(rank, group, "compile_ddp", int_path=True),
    "ddp_compiled, int path": lambda rank, group: train(rank, group, "ddp_compiled", int_path=True),
}


def _worker(rank, world, init_file, out_dir):
    run_scenarios(rank, world, init_file, out_dir, SCENARIOS, timeout_s=180)


@pytest.fixture(scope="module")
def ranks():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    return run_ranks(_worker, WORLD, 600, "the compiled DDP job")


@pytest.mark.parametrize("order", list(SCENARIOS))
def test_compiled_ddp_trains_as_ifelse_and_stops_compiling(ranks, order):
    for r, res in enumerate(results_of(ranks, order)):
        assert res["worst"] < 1e-10 and not res["none_mismatch"], (r, res["worst"], res["none_mismatch"][:5])
        graphs = res["graphs"]
        settled = N + 1 if "int path" in order else 3  # the int path: a graph per choice, as if/else
        assert graphs[settled] == graphs[-1], f"rank {r}: graphs after each step {graphs}"
