"""Build ckpt_offload's native core.

A CUDAExtension when torch has CUDA and nvcc is found, a CppExtension otherwise.
CKPT_OFFLOAD_CUDA=1 forces the CUDA build (and fails with an explanation when it cannot be
done); CKPT_OFFLOAD_CUDA=0 forces the C++-only build.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The toolkit and include-dir discovery is shared with scripts/check_torch_headers.sh.
sys.path.insert(0, os.path.join(HERE, "scripts"))
from build_env import (  # noqa: E402
    extra_cuda_include_flags,
    is_toolkit as _is_toolkit,
    locate_cuda_home as _locate_cuda_home,
)

_locate_cuda_home()

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - explained to the user
    sys.exit(
        "ckpt_offload: building needs PyTorch installed first (pip install torch), and "
        "pip install --no-build-isolation . so that the build sees it."
    )


def _sources(pattern):
    # Every source of a folder, so a new file cannot be in the wheel but missing from
    # CMakeLists.txt's sanitizer build (which globs the same folders), or the reverse.
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


CORE = _sources("csrc/core/*.cpp")
TORCH_LAYER = _sources("csrc/torch/*.cpp")
CUDA_SOURCES = _sources("csrc/core/*.cu")
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
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


def extension():
    # No -std flag: torch's cpp_extension picks the standard its headers need (C++20 for 2.10+).
    cxx = ["-O2", "-fvisibility=hidden"]
    if want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        cxx += ["-DCKPT_OFFLOAD_WITH_CUDA"] + extra_cuda_include_flags(cpp_extension.CUDA_HOME, torch)
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
