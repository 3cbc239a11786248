"""maskedbranch.doctor, the command line: ``python -m maskedbranch.doctor MODULE:FACTORY``, in
fresh processes that import the package under test, and in this process through ``main``."""
import os
import shlex
import subprocess
import sys
import textwrap

import pytest

import maskedbranch
from maskedbranch import doctor

HERE = os.path.dirname(os.path.abspath(__file__))  # doctor_fixtures.py, for the subprocesses
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(maskedbranch.__file__)))


def run_cli(*args, cwd=HERE):
    """``python -m maskedbranch.doctor`` in a fresh process, importing the package under test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PACKAGE_ROOT, HERE]))
    return subprocess.run([sys.executable, "-m", "maskedbranch.doctor", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_runs_factories_that_use_inputs():
    """``python -m maskedbranch.doctor mod:factory`` with a factory that builds its inputs with
    maskedbranch.doctor.Inputs: the class the command line checks for, though it runs as __main__."""
    run = run_cli("doctor_fixtures:keyword_inputs", "--ranks", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 simulated ranks" in run.stdout and "Verdict: safe" in run.stdout
    assert "choices.2" in run.stdout and "not sampled" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr and "RuntimeWarning" not in run.stderr  # runpy


def test_the_example_in_the_help_works(capsys, tmp_path):
    with pytest.raises(SystemExit):
        doctor.main(["--help"])
    help_text = capsys.readouterr().out
    lines = help_text.splitlines()
    start = lines.index("Example, check.py:") + 1
    end = next(i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith("    "))
    (tmp_path / "check.py").write_text(textwrap.dedent("\n".join(lines[start:end])))
    command = shlex.split(lines[end])
    assert command[:3] == ["python", "-m", "maskedbranch.doctor"]
    said = " ".join(help_text.split())
    assert "exits with status 0 (safe) and lists choices 2 and 3, which neither rank drew, as not sampled" in said
    assert "status 1: choices 0 and 1 are divergent, and 2 and 3 are routing choices not sampled" in said
    run = run_cli(*command[3:], cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [ln.split()[:4] for ln in run.stdout.splitlines() if "not sampled" in ln][:2] == [
        ["choices.2", "2", "~~", "not"], ["choices.3", "2", "~~", "not"]]
    assert "UNUSED" not in run.stdout
    # The variant the help describes: nn.ModuleList and self.choices[choice](...)
    code = (tmp_path / "check.py").read_text()
    plain = code.replace("maskedbranch.MaskedBranch(", "nn.ModuleList(").replace(
        "self.choices(self.stem(x), choice)", "self.choices[choice](self.stem(x))")
    assert plain.count("nn.ModuleList(") == 1 and "self.choices[choice]" in plain
    (tmp_path / "check_plain.py").write_text(plain)
    code, out, _ = cli(capsys, f"{tmp_path / 'check_plain.py'}:factory", *command[4:])
    rows = [ln.split()[:4] for ln in out.splitlines() if ln.startswith("  choices.")]
    assert code == 1 and rows == [["choices.0", "2", "+-", "DIVERGENT:"], ["choices.1", "2", "-+", "DIVERGENT:"],
                                  ["choices.2", "2", "--", "NOT"], ["choices.3", "2", "--", "NOT"]], out
    assert out.count("NOT SAMPLED (plain Python routing)") == 2
    assert "UNUSED" not in out


def cli(capsys, *args):
    code = doctor.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_usage_errors(capsys):
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
    assert code == 1 and "extra" in out and "UNUSED on every rank" in out and "3 simulated ranks" in out
    code, out, _ = cli(capsys, "doctor_fixtures:reference")
    assert code == 1 and "DIVERGENT" in out and "layer1" in out
    code, out, err = cli(capsys, "doctor_fixtures:not_a_model")
    assert code == 2 and "the factory returned int" in err and out == ""
    code, out, _ = cli(capsys, "doctor_fixtures:broken", "--ranks", "1")
    assert code == 3 and "failed in the forward" in out
    code, out, _ = cli(capsys, "doctor_fixtures:layer_drop", "--ranks", "1", "--eval")
    assert code == 0 and "eval mode" in out
    code, out, _ = cli(capsys, "doctor_fixtures:masked_reference")
    assert code == 0 and "Verdict: safe" in out
    code, out, _ = cli(capsys, "doctor_fixtures:not_called", "--ranks", "2")
    assert code == 0 and "NOT CALLED, no gradient (DDP leaves its parameters to maskedbranch)" in out

    script = tmp_path / "my_model.py"
    script.write_text(textwrap.dedent(
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
    ))
    code, out, _ = cli(capsys, f"{script}:build", "--all")
    assert code == 1 and "2 simulated ranks" in out
    assert "  a       2       +-     DIVERGENT: not in the graph on rank 1" in out
    assert "  b       2       -+     DIVERGENT: not in the graph on rank 0" in out


def test_cli_routed_and_plain_experts(capsys):
    """Experts routed by the functional masked_branch are safe (the one no rank picked is not
    sampled); the same experts called by a Python loop are routing choices, never 'unused'."""
    code, out, _ = cli(capsys, "doctor_fixtures:functional_experts", "--ranks", "2")
    assert code == 0 and "Verdict: safe" in out, out
    assert "not sampled: masked_branch routed no row to it on any rank" in out and "UNUSED" not in out
    code, out, _ = cli(capsys, "doctor_fixtures:plain_experts", "--ranks", "2")
    assert code == 1, out
    rows = [ln.split()[:4] for ln in out.splitlines() if ln.startswith("  experts.")]
    assert rows == [["experts.2", "2", "--", "NOT"], ["experts.3", "2", "--", "NOT"]], out
    said = " ".join(out.split())
    assert "NOT SAMPLED (plain Python routing): other experts in experts are used" in said
    assert "UNUSED" not in out and "requires_grad_(False)" not in out and "remove them" not in out
