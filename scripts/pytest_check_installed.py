"""pytest plugin used by scripts/test.sh (`-p pytest_check_installed`).

The test runs must exercise the build installed into the virtual environment, not the source
tree's maskedbranch/ package (which has no compiled _C, or one from another environment).
After collection this prints where maskedbranch was imported from and stops the session unless
it lies in the environment's site-packages (or, when MASKEDBRANCH_EXPECT_FROM names a folder, in
that folder: the in-place build of `scripts/test.sh --quick`) and, when
MASKEDBRANCH_EXPECT_WITH_CUDA is set, was built with (1) or without (0) CUDA kernels.
"""
import os
import sysconfig

import pytest


def _site_dirs():
    paths = sysconfig.get_paths()
    return {os.path.realpath(paths[key]) for key in ("purelib", "platlib")}


def pytest_collection_finish(session):
    import maskedbranch

    with_cuda = int(maskedbranch.WITH_CUDA)
    where = os.path.realpath(os.path.dirname(maskedbranch.__file__))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = f"maskedbranch from {where} (WITH_CUDA={with_cuda})"
    if reporter is not None:
        reporter.write_line(line)
    expect_from = os.environ.get("MASKEDBRANCH_EXPECT_FROM")
    if expect_from:
        if os.path.dirname(where) != os.path.realpath(expect_from):
            pytest.exit(f"{line}: not the build of {expect_from}", returncode=3)
    elif os.path.dirname(where) not in _site_dirs():
        pytest.exit(f"{line}: not the installed build (expected it under {sorted(_site_dirs())})", returncode=3)
    want = os.environ.get("MASKEDBRANCH_EXPECT_WITH_CUDA")
    if want is not None and int(want) != with_cuda:
        pytest.exit(f"{line}: expected WITH_CUDA={want}", returncode=3)
