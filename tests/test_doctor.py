"""maskedbranch.doctor: the unused-parameter finder (library and command line)."""
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import maskedbranch
from maskedbranch import doctor
from maskedbranch.doctor import Inputs, find_divergent_parameters, find_unused_parameters

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the factories module, also for the in-process command-line tests
    sys.path.insert(0, HERE)

import doctor_fixtures as fx  # noqa: E402
HAS_MASKED_BRANCH = hasattr(maskedbranch, "MaskedBranch")
HAS_RESIDUAL_DROP_PATH = hasattr(maskedbranch, "ResidualDropPath")


def reference_inputs():
    return [(torch.ones(r + 1, 1),) for r in range(4)]


def half_square(out):
    return (0.5 * out**2).sum()


def states(report):
    return {p.name: "".join(p.ranks) for p in report.parameters}


# ----------------------------------------------------------------------------------------------
# Library


def test_reference_if_else_is_divergent():
    report = find_divergent_parameters(fx.IfElse(), reference_inputs(), loss_fn=half_square)
    assert report.divergent == ["layer1.weight", "layer2.weight"]
    assert report.unused == []
    assert not report.safe and report.breaks_ddp and report.exit_code == 1
    by_name = {p.name: p for p in report.parameters}
    assert by_name["layer1.weight"].used_on == [1, 3]  # odd ranks feed an even batch
    assert by_name["layer2.weight"].used_on == [0, 2]
    assert states(report) == {"layer1.weight": "-+-+", "layer2.weight": "+-+-"}
    text = str(report)
    assert "layer1.weight" in text and "layer2.weight" in text
    assert "DIVERGENT" in text and "NOT safe for DDP with find_unused_parameters=False" in text
    assert "MaskedBranch" in text and "find_unused_parameters=True" in text


def test_single_input_lists_the_branch_not_taken():
    report = find_unused_parameters(fx.IfElse(), torch.ones(2, 1))
    assert report.num_ranks == 1
    assert report.unused == ["layer2.weight"] and report.divergent == []
    assert "UNUSED" in str(report) and not report.safe


def test_always_unused_parameter_is_flagged_on_every_rank():
    inputs = [(torch.randn(r + 1, 4),) for r in range(3)]
    report = find_divergent_parameters(fx.WithUnusedHead(), inputs)
    assert report.unused == ["extra.weight", "extra.bias"]
    assert report.divergent == []
    assert "UNUSED on every rank" in str(report)
    assert "requires_grad_(False)" in str(report)


def test_model_using_everything_is_safe():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)  # frozen: DDP ignores it
    report = find_divergent_parameters(model, [(torch.randn(3, 4),)] * 2)
    assert report.safe and report.exit_code == 0
    assert [p.name for p in report.parameters] == ["0.weight", "2.weight", "2.bias"]
    assert report.frozen == ["0.bias"]
    text = str(report)
    assert "Verdict: safe for DDP with find_unused_parameters=False" in text
    assert "1 frozen" in text
    assert all(p.ranks == ("+", "+") for p in report.parameters)


def test_zero_and_anchored_gradients_are_in_the_graph():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.live = nn.Linear(2, 2)
            self.times_zero = nn.Linear(2, 2)
            self.anchored = nn.Linear(2, 2)
            self.materialized = nn.Linear(2, 2)

        def forward(self, x):
            y = self.live(x) + 0 * self.times_zero(x)
            y = maskedbranch.anchor(y, list(self.anchored.parameters()))
            return maskedbranch.anchor(y, list(self.materialized.parameters()), materialize=True)

    report = find_unused_parameters(M(), torch.randn(3, 2))
    assert report.safe
    got = states(report)
    assert got["live.weight"] == "+" and got["times_zero.weight"] == "0"
    assert got["anchored.weight"] == "~" and got["materialized.weight"] == "0"


def test_model_state_is_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2), nn.Linear(2, 2))
    model.eval()
    model[2].train()  # a per-module flag must survive too
    grad0 = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = grad0
    assert model[3].weight.grad is None
    stats = {k: v.clone() for k, v in model[1].state_dict().items()}
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    inputs = [(torch.randn(5, 4) * 3 + 1,)] * 2
    rng = torch.get_rng_state()

    report = find_divergent_parameters(model, inputs)

    assert report.safe and report.training
    assert model[0].weight.grad is grad0 and torch.equal(grad0, torch.full_like(grad0, 7.0))
    assert model[3].weight.grad is None and model[0].bias.grad is None and model[4].weight.grad is None
    assert [m.training for m in model] == [False, False, True, False, False]
    for k, v in model[1].state_dict().items():
        assert torch.equal(v, stats[k]), k  # running stats and num_batches_tracked restored
    for k, v in model.named_parameters():
        assert torch.equal(v, params[k])
    assert torch.equal(torch.get_rng_state(), rng)


def test_eval_mode_and_training_flag():
    model = fx.RandomLayerDrop()
    report = find_divergent_parameters(model, [(torch.randn(2, 4),)] * 3, train=False)
    assert report.safe and not report.training and "eval mode" in str(report)
    assert model.training  # restored


def test_random_routing_per_rank_is_seeded():
    model = fx.RandomLayerDrop(depth=6)
    inputs = [(torch.randn(2, 4),)] * 4
    first = find_divergent_parameters(model, inputs, seed=1)
    again = find_divergent_parameters(model, inputs, seed=1)
    assert states(first) == states(again)
    assert first.divergent  # with these seeds, the blocks that run differ between ranks
    assert not first.safe


def test_callable_inputs_get_the_rank():
    seen = []

    def make(rank):
        seen.append(rank)
        return torch.ones(rank + 1, 1)

    report = find_divergent_parameters(fx.IfElse(), [make] * 4)
    assert seen == [0, 1, 2, 3]
    assert report.divergent == ["layer1.weight", "layer2.weight"]
    # a callable without arguments, and Inputs with keyword arguments
    report = find_divergent_parameters(fx.IfElse(), [lambda: (torch.ones(2, 1),), Inputs(x=torch.ones(2, 1))])
    assert report.unused == ["layer2.weight"]


def test_structured_outputs_and_detached_heads():
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: dict
        step: int = 0

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)
            self.c = nn.Linear(2, 2)
            self.d = nn.Linear(2, 2)

        def forward(self, x):
            ids = torch.arange(3)  # integer tensors are skipped
            return Out(self.a(x), {"pair": (self.b(x), ids), "frozen": self.c(x).detach()}), [self.d(x)]

    report = find_unused_parameters(M(), torch.randn(3, 2))
    assert report.unused == ["c.weight", "c.bias"]
    # a loss function that reads one output only
    report = find_unused_parameters(M(), torch.randn(3, 2), loss_fn=lambda out: out[0].logits.pow(2).sum())
    assert report.unused == ["b.weight", "b.bias", "c.weight", "c.bias", "d.weight", "d.bias"]


def test_output_without_grad_is_explained():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def forward(self, x):
            with torch.no_grad():
                return self.layer(x)

    report = find_unused_parameters(M(), torch.randn(3, 2))
    assert report.unused == ["layer.weight", "layer.bias"]
    assert "requires grad" in str(report)


def test_tied_parameters_are_reported_once_with_aliases():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    report = find_unused_parameters(Tied(), torch.tensor([1, 2]))
    assert [(p.name, p.aliases) for p in report.parameters] == [("embed.weight", ("head.weight",))]
    assert report.safe and "(= head.weight)" in str(report)


def test_forward_that_raises_is_reported():
    report = find_divergent_parameters(fx.Broken(), [(torch.randn(2, 4),)] * 2)
    assert not report.safe and report.exit_code == 3
    assert [(f.rank, f.stage) for f in report.failures] == [(0, "forward"), (1, "forward")]
    text = str(report)
    assert "Ranks 0, 1 failed in the forward: RuntimeError" in text
    assert "a shape bug" in text  # the user's line in the traceback
    assert "doctor.py" not in text  # our own frames are trimmed
    assert "incomplete" in text


def test_some_ranks_fail_the_others_are_judged():
    def make(rank):
        if rank == 1:
            raise ValueError("no data for rank 1")
        return torch.ones(rank + 1, 1)

    report = find_divergent_parameters(fx.IfElse(), [make] * 3)
    assert [(f.rank, f.stage) for f in report.failures] == [(1, "inputs")]
    assert states(report) == {"layer1.weight": "-!-", "layer2.weight": "+!+"}
    assert report.unused == ["layer1.weight"] and report.exit_code == 3
    assert "no data for rank 1" in str(report) and "NOT safe" in str(report)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        find_divergent_parameters(lambda x: x, [(torch.ones(1),)])
    with pytest.raises(TypeError, match="inputs_per_rank"):
        find_divergent_parameters(fx.IfElse(), torch.ones(2, 1))
    with pytest.raises(ValueError, match="at least one"):
        find_divergent_parameters(fx.IfElse(), [])
    with pytest.raises(TypeError, match="loss_fn"):
        find_divergent_parameters(fx.IfElse(), [(torch.ones(2, 1),)], loss_fn=3)


def test_exported_from_the_package():
    assert maskedbranch.find_unused_parameters is find_unused_parameters
    assert maskedbranch.find_divergent_parameters is find_divergent_parameters
    assert {"find_unused_parameters", "find_divergent_parameters"} <= set(maskedbranch.__all__)


@pytest.mark.skipif(not HAS_MASKED_BRANCH, reason="maskedbranch.MaskedBranch is not available yet")
def test_if_else_rewritten_with_masked_branch_is_safe():
    report = find_divergent_parameters(fx.MaskedIfElse(), reference_inputs(), loss_fn=half_square)
    assert report.safe, str(report)
    # the branch that did not run is anchored: in the graph, gradient undefined
    assert states(report) == {"layers.branches.0.weight": "~+~+", "layers.branches.1.weight": "+~+~"}


@pytest.mark.skipif(not HAS_RESIDUAL_DROP_PATH, reason="maskedbranch.ResidualDropPath is not available yet")
def test_layer_drop_with_residual_drop_path_is_safe():
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                maskedbranch.ResidualDropPath(nn.Linear(4, 4), drop_prob=0.5, mode="batch") for _ in range(6)
            )

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    inputs = [(torch.randn(2, 4),)] * 4
    assert not find_divergent_parameters(fx.RandomLayerDrop(depth=6), inputs, seed=1).safe
    report = find_divergent_parameters(Blocks(), inputs, seed=1)
    assert report.safe, str(report)
    assert any("~" in p.ranks or "0" in p.ranks for p in report.parameters)  # some blocks were dropped


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)
def test_verdict_agrees_with_ddp(tmp_path):
    """One rank of real DDP (gloo, in this process): the second iteration raises exactly when the
    doctor finds parameters not in the graph."""
    import torch.distributed as dist

    x4, x1 = torch.randn(3, 4), torch.ones(2, 1)
    cases = [  # (model factory, input, what the doctor should say)
        (fx.WithUnusedHead, x4, False),
        (fx.IfElse, x1, False),
        (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), x4, True),
    ]
    if HAS_MASKED_BRANCH:
        cases.append((fx.MaskedIfElse, x1, True))
        cases.append((lambda: _Gated(maskedbranch.MaskedBranch([nn.Linear(4, 4), nn.Linear(4, 4)])), x4, True))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for make, x, expected in cases:
            torch.manual_seed(0)
            assert find_unused_parameters(make(), x).safe == expected, make
            ddp = nn.parallel.DistributedDataParallel(make())
            try:
                for _ in range(2):
                    ddp(x).sum().backward()
                ddp_ok = True
            except RuntimeError as e:
                assert "Expected to have finished reduction" in str(e)
                ddp_ok = False
            assert ddp_ok == expected, make
    finally:
        dist.destroy_process_group()


class _Gated(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x, 1)  # branch 0 never runs, but is anchored


# ----------------------------------------------------------------------------------------------
# Command line


def run_cli(*args, cwd=HERE):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "maskedbranch.doctor", *args],
        cwd=cwd,  # not the repository root: import the installed maskedbranch, as the tests do
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_exit_codes_and_output():
    bad = run_cli("doctor_fixtures:reference")
    assert bad.returncode == 1, bad.stderr
    assert "layer1.weight" in bad.stdout and "layer2.weight" in bad.stdout
    assert "DIVERGENT" in bad.stdout and "NOT safe" in bad.stdout
    assert "RuntimeWarning" not in bad.stderr  # no double import by runpy

    good = run_cli("doctor_fixtures:all_used", "--ranks", "2")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "2 simulated ranks" in good.stdout and "Verdict: safe" in good.stdout

    usage = run_cli("doctor_fixtures:not_a_model")
    assert usage.returncode == 2
    assert "the factory returned int" in usage.stderr and usage.stdout == ""


def cli(capsys, *args):
    code = doctor.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_usage_errors(capsys, tmp_path):
    assert cli(capsys, "no_colon")[0] == 2
    code, _, err = cli(capsys, "no_such_module_xyz:factory")
    assert code == 2 and "cannot import 'no_such_module_xyz'" in err
    code, _, err = cli(capsys, "doctor_fixtures:nope")
    assert code == 2 and "no attribute 'nope'" in err
    code, _, err = cli(capsys, "doctor_fixtures:reference", "--ranks", "3")
    assert code == 2 and "--ranks 3 disagrees" in err
    code, _, err = cli(capsys, "doctor_fixtures:IfElse")  # a model class, not a factory
    assert code == 2 and "the factory returned IfElse" in err
    with pytest.raises(SystemExit) as exc:
        doctor.main(["doctor_fixtures:all_used", "--ranks", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "inputs_per_rank" in help_text and "make_inputs" in help_text and "Exit status" in help_text


def test_cli_make_inputs_per_rank_and_file_targets(capsys, tmp_path):
    code, out, _ = cli(capsys, "doctor_fixtures:unused_head", "--ranks", "3")
    assert code == 1 and "extra.weight" in out and "UNUSED on every rank" in out
    assert "3 simulated ranks" in out
    code, out, _ = cli(capsys, "doctor_fixtures:broken", "--ranks", "1")
    assert code == 3 and "failed in the forward" in out
    code, out, _ = cli(capsys, "doctor_fixtures:layer_drop", "--ranks", "1", "--eval")
    assert code == 0 and "eval mode" in out

    script = tmp_path / "my_model.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Skip(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.a = nn.Linear(2, 2)
                    self.b = nn.Linear(2, 2)

                def forward(self, x, use_b=False):
                    return self.b(x) if use_b else self.a(x)

            def build():
                from maskedbranch.doctor import Inputs
                x = torch.randn(3, 2)
                return {"model": Skip(), "inputs_per_rank": [Inputs(x), Inputs(x, use_b=True)]}
            """
        )
    )
    code, out, _ = cli(capsys, f"{script}:build")
    assert code == 1
    assert "a.weight" in out and "b.bias" in out and "DIVERGENT" in out and "2 simulated ranks" in out


@pytest.mark.skipif(not HAS_MASKED_BRANCH, reason="maskedbranch.MaskedBranch is not available yet")
def test_cli_masked_branch_reference_is_safe(capsys):
    code, out, _ = cli(capsys, "doctor_fixtures:masked_reference")
    assert code == 0 and "Verdict: safe" in out
