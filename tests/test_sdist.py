"""The source distribution builds: it holds every file the compiled sources include.

setuptools puts only the sources listed in the extension into an sdist; headers need MANIFEST.in.
A missing header shows only when someone builds from the sdist (`pip install maskedbranch` where
no wheel fits), so this test builds the sdist and resolves every `#include "..."` inside it.
"""
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCE_SUFFIXES = {".cpp", ".cu", ".h", ".cuh"}

pytestmark = pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="needs the source tree")


@pytest.fixture(scope="module")
def sdist_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdist")
    # egg_info --egg-base keeps the build's metadata out of the source tree.
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(out),
                    "sdist", "--dist-dir", str(out)], cwd=ROOT, check=True, capture_output=True)
    (archive,) = out.glob("maskedbranch-*.tar.gz")
    with tarfile.open(archive) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile() and "/" in m.name}
        return {name: tar.extractfile(m).read().decode("utf-8", "replace") for name, m in members.items()
                if Path(name).suffix in SOURCE_SUFFIXES or name == "CMakeLists.txt"}


def test_sdist_holds_every_source_file_of_the_tree(sdist_files):
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*") if p.suffix in SOURCE_SUFFIXES}
    assert tree, "no sources found under csrc/"
    assert sorted(tree - set(sdist_files)) == []
    assert "CMakeLists.txt" in sdist_files and "tests/cpp/test_ops.cpp" in sdist_files


def test_every_quoted_include_resolves_inside_the_sdist(sdist_files):
    unresolved = []
    for name, text in sdist_files.items():
        folder = Path(name).parent
        for header in INCLUDE.findall(text):
            # The builds add no include folder of their own: a quoted include resolves beside its file.
            if os.path.normpath(folder / header) not in sdist_files:
                unresolved.append(f"{name}: {header}")
    assert unresolved == []
