"""Build maskedbranch._C: C++ CPU kernels always, CUDA kernels when a CUDA build of torch and
nvcc are present (or FORCE_CUDA=1). Honours TORCH_CUDA_ARCH_LIST and MAX_JOBS."""
import glob
import os
import shutil
import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit(
        "maskedbranch: torch is not installed. Install torch first (for example "
        "`pip install torch`), then build with `pip install --no-build-isolation .`"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0+PTX"  # used when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset


def find_cuda_home():
    """The real toolkit folder: nvcc on PATH may be a wrapper script outside it."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if candidate and os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    nvcc = shutil.which("nvcc")
    if nvcc:
        with open(nvcc, "rb") as f:
            head = f.read(4096)
        if head.startswith(b"#!"):  # a wrapper: look for the path it executes
            for token in head.decode(errors="ignore").split():
                if token.endswith("/bin/nvcc") and os.path.exists(token):
                    return os.path.dirname(os.path.dirname(token))
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    for candidate in sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    return None


def cuda_decision(cuda_home):
    """(build the CUDA kernels?, the reason), the reason as the build log prints it."""
    if os.environ.get("FORCE_CUDA", "0") == "1":
        if cuda_home is None:
            sys.exit("maskedbranch: FORCE_CUDA=1 but no CUDA toolkit was found: put nvcc on PATH or set CUDA_HOME")
        return True, "FORCE_CUDA=1"
    if os.environ.get("MASKEDBRANCH_CPU_ONLY", "0") == "1":
        return False, "MASKEDBRANCH_CPU_ONLY=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    if cuda_home is None:
        return False, (f"no CUDA toolkit found for torch {torch.__version__} (CUDA {torch.version.cuda}): "
                       "nvcc is not on PATH and neither CUDA_HOME nor CUDA_PATH names a toolkit")
    return True, f"torch is a CUDA build and {cuda_home} has nvcc"


def torch_nvidia_includes():
    """cuBLAS/cuSPARSE headers that ATen/cuda/CUDAContext.h includes ship in torch's nvidia
    wheels when the toolkit lacks them."""
    found = []
    for site in sys.path:
        for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
            found += sorted(glob.glob(os.path.join(site, pattern)))
    return [d for d in dict.fromkeys(found) if os.path.isdir(d)]


def openmp_flags():
    """ATen's parallel_for is a header template. Under torch's OpenMP backend (Linux and Windows
    wheels) it runs in parallel only in code compiled with OpenMP; without the flag every CPU
    kernel runs on one thread. Nothing is linked: the runtime is the one torch already loaded."""
    info = torch.__config__.parallel_info()
    if sys.platform == "darwin" or "backend: OpenMP" not in info or "OpenMP not found" in info:
        return []
    return ["/openmp"] if sys.platform == "win32" else ["-fopenmp"]


def extension():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # No -std flag: cpp_extension adds the standard the installed torch needs (C++17 up to
    # torch 2.13, C++20 from 2.14).
    cxx_flags = ["-O3"] + openmp_flags()
    cuda_home = find_cuda_home()
    with_cuda, reason = cuda_decision(cuda_home)
    if not with_cuda:
        print(f"maskedbranch: building CPU kernels only ({reason})")
        return cpp_extension.CppExtension(
            "maskedbranch._C", sources, extra_compile_args={"cxx": cxx_flags}, py_limited_api=False
        )
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "those of the visible GPUs")
    print(f"maskedbranch: building CPU and CUDA kernels ({reason}; CUDA {torch.version.cuda}, archs {archs})")
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    return cpp_extension.CUDAExtension(
        "maskedbranch._C",
        sources,
        include_dirs=torch_nvidia_includes(),
        define_macros=[("MASKEDBRANCH_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
