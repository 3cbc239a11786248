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


def want_cuda(cuda_home):
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    if os.environ.get("MASKEDBRANCH_CPU_ONLY", "0") == "1":
        return False
    return torch.version.cuda is not None and cuda_home is not None


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
    if not want_cuda(cuda_home):
        print("maskedbranch: building CPU kernels only (no CUDA build of torch or no nvcc found)")
        return cpp_extension.CppExtension(
            "maskedbranch._C", sources, extra_compile_args={"cxx": cxx_flags}, py_limited_api=False
        )
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "those of the visible GPUs")
    print(f"maskedbranch: building CPU and CUDA kernels (CUDA {torch.version.cuda}, "
          f"toolkit {cuda_home}, archs {archs})")
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
