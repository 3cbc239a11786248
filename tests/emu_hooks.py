"""Schedules and the kernel count of the host emulation tests (tests/cuda_emu), loaded by
tests/conftest.py: one conftest for the whole suite (two files named conftest.py would clash
in pytest's import mode of the test command). Nothing here touches tests outside tests/cuda_emu.

Every kernel test runs once per schedule of emu_support.SUITE_SCHEDULES (test_emu_layer.py, and
the tests that compare schedules themselves, choose their own). With
MASKEDBRANCH_CUDA_EMU_COVERAGE=1 (set by scripts/sanitize.sh, which runs the whole folder), the
session fails unless every `__global__` function of csrc/cuda, and every instantiation of one that
the compiled launch code can start, ran at least once; the count is printed either way."""
import os
import re
import sys

import pytest

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu")
CUDA_SOURCES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "csrc", "cuda")


def in_emulation_tests(path) -> bool:
    return os.path.dirname(os.path.abspath(str(path))) == HERE
GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(")


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__
    if not in_emulation_tests(metafunc.module.__file__):
        return
    if "suite_schedule" in metafunc.fixturenames and module != "test_emu_layer" \
            and "schedule" not in metafunc.function.__name__:
        import emu_support
        metafunc.parametrize("suite_schedule", emu_support.SUITE_SCHEDULES, indirect=True)


@pytest.fixture(autouse=True)
def suite_schedule(request):
    if not in_emulation_tests(request.node.fspath):
        return None
    import emu_support
    name = getattr(request, "param", "shuffled")
    emu_support.use_schedule(name)
    return name


def global_functions():
    names = set()
    for name in sorted(os.listdir(CUDA_SOURCES)):
        if name.endswith((".cu", ".cuh")):
            with open(os.path.join(CUDA_SOURCES, name)) as f:
                names.update(GLOBAL.findall(f.read()))
    return names


def base_name(instantiation):
    """maskedbranch::cuda::{anonymous}::live_kernel<bool, false, int> -> live_kernel"""
    return re.match(r"[\w:{}]*?(\w+)(<|$)", instantiation).group(1)


def coverage():
    emu_support = sys.modules.get("emu_support")
    if emu_support is None:
        return None
    rows = [line.split("\t") for line in emu_support.emu.kernels()]
    launched = {name: int(launches) for name, launches, _, _ in rows if name.startswith("maskedbranch::")}
    functions = global_functions()
    ran = {base_name(name) for name, n in launched.items() if n > 0}
    return {
        "functions": functions,
        "functions_missing": sorted(functions - ran),
        "instantiations": launched,
        "instantiations_missing": sorted(name for name, n in launched.items() if n == 0),
    }


def pytest_sessionfinish(session, exitstatus):
    c = coverage()
    if c is None:
        return
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [
        f"CUDA kernels on the host: {len(c['functions']) - len(c['functions_missing'])} of "
        f"{len(c['functions'])} __global__ functions of csrc/cuda ran, "
        f"{len(c['instantiations']) - len(c['instantiations_missing'])} of {len(c['instantiations'])} "
        "instantiations the launch code can start",
    ]
    enforced = os.environ.get("MASKEDBRANCH_CUDA_EMU_COVERAGE") == "1"
    if enforced:
        lines += [f"  never ran: {name}" for name in c["functions_missing"] + c["instantiations_missing"]]
    if report is not None:
        report.write_line("")
        for line in lines:
            report.write_line(line)
    if enforced and (c["functions_missing"] or c["instantiations_missing"]):
        session.exitstatus = 1
