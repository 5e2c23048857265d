"""Build ckpt_offload's native core.

A CUDAExtension when torch has CUDA and nvcc is found, a CppExtension otherwise.
CKPT_OFFLOAD_CUDA=1 forces the CUDA build (and fails with an explanation when it cannot be
done); CKPT_OFFLOAD_CUDA=0 forces the C++-only build.
"""

import glob
import os
import shutil
import site
import sys

from setuptools import find_packages, setup



def _is_toolkit(path):
    return bool(path) and os.path.exists(os.path.join(path, "bin", "nvcc")) and os.path.exists(
        os.path.join(path, "include", "cuda_runtime.h")
    )


def _locate_cuda_home():
    """Find the CUDA toolkit before torch does: torch takes dirname(dirname(which nvcc)), which is
    wrong when nvcc on PATH is a wrapper script (here /usr/local/bin/nvcc -> /usr/local)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True) + ["/opt/cuda"]
    for c in candidates:
        if _is_toolkit(c):
            os.environ["CUDA_HOME"] = c
            return


_locate_cuda_home()

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - explained to the user
    sys.exit(
        "ckpt_offload: building needs PyTorch installed first (pip install torch), and "
        "pip install --no-build-isolation . so that the build sees it."
    )

HERE = os.path.dirname(os.path.abspath(__file__))
CORE = [
    "csrc/core/host_pool.cpp",
    "csrc/core/cpu_stream.cpp",
    "csrc/core/copy_engine.cpp",
    "csrc/core/profiler.cpp",
    "csrc/core/crc32c.cpp",
    "csrc/core/file_tier.cpp",
    "csrc/core/spill.cpp",
]
TORCH_LAYER = [
    "csrc/torch/runtime.cpp",
    "csrc/torch/saved_tensor.cpp",
    "csrc/torch/profiling.cpp",
    "csrc/torch/bindings.cpp",
    "csrc/torch/spill_bindings.cpp",
]
CUDA_SOURCES = ["csrc/core/cuda_stream.cu"]
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
# Headers that torch's CUDA headers include and that a bare toolkit (or a pip-only machine)
# may lack; pip's nvidia-* packages ship them.
LIBRARY_HEADERS = ["cusparse.h", "cublas_v2.h", "cusolverDn.h", "curand.h", "cufft.h"]


def _fail(msg):
    sys.exit("ckpt_offload: CUDA build impossible: " + msg)


def want_cuda():
    forced = os.environ.get("CKPT_OFFLOAD_CUDA")
    if forced not in (None, "", "0", "1"):
        sys.exit(f"ckpt_offload: CKPT_OFFLOAD_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False
    problems = []
    if torch.version.cuda is None:
        problems.append(f"the installed torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)")
    home = cpp_extension.CUDA_HOME
    if not home:
        problems.append("no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
    elif not _is_toolkit(home):
        problems.append(f"CUDA_HOME={home} has no bin/nvcc or include/cuda_runtime.h")
    if problems:
        if forced == "1":
            _fail("; ".join(problems) + ". Unset CKPT_OFFLOAD_CUDA (or set it to 0) to build the C++-only core.")
        print("ckpt_offload: building the C++-only core: " + "; ".join(problems), file=sys.stderr)
        return False
    return True


def pip_nvidia_include_dirs():
    """include/ folders of pip's nvidia packages (nvidia/cu13/include, nvidia/*/include)."""
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    roots.append(os.path.dirname(os.path.dirname(torch.__file__)))
    found = []
    for root in roots:
        for d in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include"))):
            if d not in found:
                found.append(d)
    return found


def extra_cuda_include_flags():
    """-idirafter flags for library headers the toolkit lacks (the toolkit's own headers win)."""
    toolkit_inc = os.path.join(cpp_extension.CUDA_HOME, "include")
    missing = [h for h in LIBRARY_HEADERS if not os.path.exists(os.path.join(toolkit_inc, h))]
    if not missing:
        return []
    flags, still_missing = [], set(missing)
    for d in pip_nvidia_include_dirs():
        has = [h for h in missing if os.path.exists(os.path.join(d, h))]
        if has:
            flags += ["-idirafter", d]
            still_missing -= set(has)
    if still_missing:
        print(
            "ckpt_offload: warning: the CUDA toolkit at %s lacks %s and no pip nvidia package provides them; "
            "if the build fails on a missing header, pip install the matching nvidia-* package (or a full "
            "toolkit)." % (cpp_extension.CUDA_HOME, ", ".join(sorted(still_missing))),
            file=sys.stderr,
        )
    return flags


def extension():
    # No -std flag: torch's cpp_extension picks the standard its headers need (C++20 for 2.10+).
    cxx = ["-O2", "-fvisibility=hidden"]
    if want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        cxx += ["-DCKPT_OFFLOAD_WITH_CUDA"] + extra_cuda_include_flags()
        return cpp_extension.CUDAExtension(
            "ckpt_offload._C",
            CORE + TORCH_LAYER + CUDA_SOURCES,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O2", "-DCKPT_OFFLOAD_WITH_CUDA"]},
        )
    return cpp_extension.CppExtension("ckpt_offload._C", CORE + TORCH_LAYER, extra_compile_args={"cxx": cxx})


class BuildExt(cpp_extension.BuildExtension):
    def build_extensions(self):
        try:
            super().build_extensions()
        except Exception as e:  # explain a failed CUDA build instead of only dumping compiler output
            if any(s.endswith(".cu") for ext in self.extensions for s in ext.sources):
                print(
                    "\nckpt_offload: the CUDA build failed (%s). Check that nvcc (%s) matches torch's CUDA %s "
                    "and that your gcc is supported by that nvcc; TORCH_CUDA_ARCH_LIST=%r. Set "
                    "CKPT_OFFLOAD_CUDA=0 to build the C++-only core instead."
                    % (e, cpp_extension.CUDA_HOME, torch.version.cuda, os.environ.get("TORCH_CUDA_ARCH_LIST")),
                    file=sys.stderr,
                )
            raise


setup(
    name="ckpt_offload",
    version="0.1.0",
    description="Activation offloading to a pinned host-memory pool and gradient checkpointing for PyTorch",
    packages=find_packages(include=["ckpt_offload", "ckpt_offload.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    zip_safe=False,
)
