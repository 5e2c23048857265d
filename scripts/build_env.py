"""Where the CUDA toolkit and the headers ckpt_offload compiles against are, and which sources
each build compiles.

Shared by setup.py (the build) and scripts/check_torch_headers.sh (the compile check against
other torch releases' headers), so both see the same include directories and sources.
Import order matters: call locate_cuda_home() before importing torch.utils.cpp_extension,
which reads CUDA_HOME once, at import.
"""

import glob
import os
import shutil
import site
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The one C++ standard of every C++ and CUDA file: the extension's (setup.py), the compile check's
# (torch_compile_flags) and the core's native build (CMakeLists.txt's CMAKE_CXX_STANDARD and
# CMAKE_CUDA_STANDARD; tests/package/test_packaging.py checks they agree). C++20, because torch's
# headers require it from 2.10 on (ATen/ATen.h refuses an older standard), and the core builds
# with the extension.
CXX_STANDARD = 20
STD_FLAG = f"-std=c++{CXX_STANDARD}"

# Headers that torch's CUDA headers include and that a bare toolkit (or a pip-only machine)
# may lack; pip's nvidia-* packages ship them.
LIBRARY_HEADERS = ["cusparse.h", "cublas_v2.h", "cusolverDn.h", "curand.h", "cufft.h"]


def is_toolkit(path):
    return (
        bool(path)
        and os.path.exists(os.path.join(path, "bin", "nvcc"))
        and os.path.exists(os.path.join(path, "include", "cuda_runtime.h"))
    )


def locate_cuda_home():
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
        if is_toolkit(c):
            os.environ["CUDA_HOME"] = c
            return


def pip_nvidia_include_dirs(torch):
    """include/ folders of pip's nvidia packages (nvidia/cu13/include, nvidia/*/include)."""
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    roots.append(os.path.dirname(os.path.dirname(torch.__file__)))
    found = []
    for root in roots:
        for d in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include"))):
            if d not in found:
                found.append(d)
    return found


def extra_cuda_include_flags(cuda_home, torch):
    """-idirafter flags for library headers the toolkit lacks (the toolkit's own headers win)."""
    toolkit_inc = os.path.join(cuda_home, "include")
    missing = [h for h in LIBRARY_HEADERS if not os.path.exists(os.path.join(toolkit_inc, h))]
    if not missing:
        return []
    flags, still_missing = [], set(missing)
    for d in pip_nvidia_include_dirs(torch):
        has = [h for h in missing if os.path.exists(os.path.join(d, h))]
        if has:
            flags += ["-idirafter", d]
            still_missing -= set(has)
    if still_missing:
        print(
            "ckpt_offload: warning: the CUDA toolkit at %s lacks %s and no pip nvidia package provides them; "
            "if the build fails on a missing header, pip install the matching nvidia-* package (or a full "
            "toolkit)." % (cuda_home, ", ".join(sorted(still_missing))),
            file=sys.stderr,
        )
    return flags


def torch_compile_flags(with_cuda, torch_include_root=None):
    """g++ flags that compile a torch-layer file as setup.py's build does (defines, include dirs,
    Python headers, the C++ standard). With `torch_include_root`, torch's own include dirs point
    at that folder instead (another release's torch/include)."""
    import sysconfig

    locate_cuda_home()
    import torch
    from torch.utils import cpp_extension

    installed_root = cpp_extension.include_paths()[0]
    flags = []
    for d in cpp_extension.include_paths():
        if torch_include_root:
            d = torch_include_root + d[len(installed_root) :]
        flags.append("-I" + d)
    # As setup.py compiles (-fvisibility=hidden: pybind11 warns about class visibility without it).
    flags += [
        "-I" + sysconfig.get_paths()["include"],
        STD_FLAG,
        "-fvisibility=hidden",
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]
    if with_cuda:
        home = cpp_extension.CUDA_HOME
        if not home or not is_toolkit(home):
            raise SystemExit("check_torch_headers: no CUDA toolkit found for the CUDA variant (set CUDA_HOME)")
        flags += ["-DCKPT_OFFLOAD_WITH_CUDA", "-I" + os.path.join(home, "include")]
        flags += extra_cuda_include_flags(home, torch)
    return flags


def sources(pattern):
    """Every source of a folder, relative to the source root and sorted: a new file cannot be in
    the wheel but missing from CMakeLists.txt's sanitizer build (which globs the same folders)."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def torch_layer_sources(with_cuda):
    """The torch layer's sources for one build, as pytorch's extension-cpp example picks them:
    csrc/torch/*.cpp, plus the device side (csrc/torch/device_runtime.h) of that build --
    csrc/torch/cuda/*.cpp for the CUDA build, the CPU fallbacks csrc/torch/cpu/*.cpp for the
    C++-only one."""
    return sources("csrc/torch/*.cpp") + sources("csrc/torch/cuda/*.cpp" if with_cuda else "csrc/torch/cpu/*.cpp")


if __name__ == "__main__":
    # python scripts/build_env.py [--cuda] [--torch-include ROOT]: prints the flags, one per line.
    # python scripts/build_env.py --sources [--cuda]: the torch layer's sources of that build.
    args = sys.argv[1:]
    if "--sources" in args:
        print("\n".join(torch_layer_sources("--cuda" in args)))
        sys.exit(0)
    root = args[args.index("--torch-include") + 1] if "--torch-include" in args else None
    print("\n".join(torch_compile_flags("--cuda" in args, root)))


def usable_gpu(torch):
    """What shows a GPU this machine's build could run on, or None: torch sees one
    (torch.cuda.is_available()), or nvidia-smi lists one (a driver is there, even when this torch
    cannot use it)."""
    try:
        if torch.version.cuda is not None and torch.cuda.is_available():
            return "torch.cuda.is_available()"
    except Exception:  # a broken driver is "no usable GPU", not a failed build
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        if any(line.startswith("GPU ") for line in out.splitlines()):
            return "nvidia-smi -L"
    return None


NO_GPU_MESSAGE = (
    "ckpt_offload: no usable GPU here (torch.cuda.is_available() is False and nvidia-smi lists none): "
    "building the C++-only engine, which runs everything on CPU tensors and builds in a fraction of "
    "the CUDA engine's time. To build the CUDA engine anyway (e.g. a wheel for a GPU machine), set "
    "CKPT_OFFLOAD_CUDA=1."
)


def decide_cuda(forced, problems, gpu):
    """setup.py's choice: (build the CUDA engine?, a line to print or None, an error or None).

    forced: CKPT_OFFLOAD_CUDA ("0", "1", or None/"" for the default); problems: what stops a CUDA
    build (a CPU-only torch, no toolkit); gpu: usable_gpu()'s answer. The default builds CUDA only
    where it can be built and a GPU could run it."""
    if forced not in (None, "", "0", "1"):
        return False, None, f"ckpt_offload: CKPT_OFFLOAD_CUDA must be 0 or 1, got {forced!r}"
    if forced == "0":
        return False, "ckpt_offload: CKPT_OFFLOAD_CUDA=0: building the C++-only engine", None
    if forced == "1":
        if problems:
            return (
                False,
                None,
                (
                    "ckpt_offload: CUDA build impossible: "
                    + "; ".join(problems)
                    + ". Unset CKPT_OFFLOAD_CUDA (or set it to 0) to build the C++-only core."
                ),
            )
        return True, "ckpt_offload: CKPT_OFFLOAD_CUDA=1: building the CUDA engine", None
    if problems:
        return False, "ckpt_offload: building the C++-only core: " + "; ".join(problems), None
    if not gpu:
        return False, NO_GPU_MESSAGE, None
    return (
        True,
        (f"ckpt_offload: building the CUDA engine (GPU found by {gpu}; CKPT_OFFLOAD_CUDA=0 builds the C++-only one)"),
        None,
    )
