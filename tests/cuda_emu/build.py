"""Builds the test library that runs the CUDA kernels of csrc/cuda on the host.

    python tests/cuda_emu/build.py [--out DIR] [--cflags "..."] [--ldflags "..."]

The library (maskedbranch_cuda_emu*.so in DIR, default build/cuda_emu/torch-<version> of the
repository: it loads only into the torch it was built against) holds
csrc/cuda/*.cu compiled by the host compiler against cuda_emulation.h, the emulation runtime, and
ops under the namespace maskedbranch_cuda_emu (emulated_ops.cpp). Load it with
torch.ops.load_library next to the maskedbranch package; tests/emu_hooks.py does, from
MASKEDBRANCH_CUDA_EMU_LIB or the default folder. scripts/sanitize.sh builds it with ASan and
UBSan through --cflags / --ldflags. Prints the library's path last. Needs torch and ninja.

The tests need the maskedbranch package (its CPU kernels and reference) importable, for example
an in-place build: cd "$(mktemp -d)" && PYTHONPATH=$REPO python -m pytest $REPO/tests/cuda_emu
(MASKEDBRANCH_CUDA_EMU_SCHEDULES, default "shuffled,forward,reverse", lists the schedules every kernel
test runs under; "parallel" is the fourth).
"""
import argparse
import glob
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NAME = "maskedbranch_cuda_emu"
SOURCES = ["cuda_emulation.cpp", "cuda_emulation_device.cpp", "emulated_ops.cpp", "emulated_plan.cpp",
           "emulated_gather.cpp", "emulated_combine.cpp", "emulated_pick.cpp", "selftest_kernels.cpp"]
# No FMA contraction: the kernels' products must round as __fmul_rn does on the device.
# No strict aliasing: the kernels read rows through 16-byte vector structs, as CUDA allows.
FLAGS = ["-O2", "-g", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas"]


def default_folder(torch_version):
    return os.path.join(ROOT, "build", "cuda_emu", f"torch-{torch_version}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="build folder (default build/cuda_emu/torch-<version>)")
    parser.add_argument("--cflags", default="", help="extra compiler flags (e.g. sanitizers)")
    parser.add_argument("--ldflags", default="", help="extra linker flags")
    args = parser.parse_args()

    import setuptools
    import torch
    from torch.utils import cpp_extension

    out = os.path.abspath(args.out or default_folder(torch.__version__))
    os.makedirs(out, exist_ok=True)
    ext = cpp_extension.CppExtension(
        NAME,
        [os.path.join(HERE, s) for s in SOURCES],
        include_dirs=[HERE],
        define_macros=[("MASKEDBRANCH_CUDA_EMULATION", "1")],
        extra_compile_args={"cxx": FLAGS + shlex.split(args.cflags)},
        extra_link_args=["-pthread"] + shlex.split(args.ldflags),
        py_limited_api=False,
    )
    os.chdir(out)  # setuptools writes nothing into the source tree
    setuptools.setup(
        name=NAME,
        ext_modules=[ext],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
        script_args=["-q", "build_ext", "--build-temp", os.path.join(out, "temp"), "--build-lib", out],
    )
    (lib,) = glob.glob(os.path.join(out, NAME + "*.so"))
    print(lib)


if __name__ == "__main__":
    sys.exit(main())
