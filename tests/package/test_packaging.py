"""Packaging: the torch-mismatch guard at import, build_info's build-time versions, and setup.py's
refusal to build without torch (build isolation). The sdist and wheel themselves are checked by
scripts/check_sdist.sh (CI)."""

import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch
from helpers import REPO_ROOT

import ckpt_offload as co
from ckpt_offload._torch_compat import mismatch

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(co.__file__)))
SOURCE_ROOT = REPO_ROOT


def run_python(code, cwd):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_build_info_reports_the_torch_it_was_built_against():
    info = co.build_info()
    # Every build made by setup.py records its torch; this one runs under the torch it was built with.
    assert info["built_with_torch"] == torch.__version__
    assert info["built_with_cuda"] == (torch.version.cuda if info["cuda_compiled"] else None)
    assert info["torch_version"] == torch.__version__


@pytest.mark.parametrize(
    "built, built_cuda, cuda_compiled, runtime, runtime_cuda",
    [
        ("2.14.1+cu130", "13.0", True, "2.14.1+cu130", "13.0"),
        # The local tag is the CUDA variant; a C++-only _C loads under any variant of its release.
        ("2.14.1+cu130", "13.0", False, "2.14.1+cpu", None),
        ("2.14.1+cu130", "13.0", False, "2.14.1", None),
        # CUDA keeps compatibility within a major version.
        ("2.11.0+cu128", "12.8", True, "2.11.0+cu126", "12.6"),
    ],
)
def test_same_release_passes(built, built_cuda, cuda_compiled, runtime, runtime_cuda):
    assert mismatch(built, built_cuda, cuda_compiled, runtime, runtime_cuda) is None


@pytest.mark.parametrize(
    "built, built_cuda, cuda_compiled, runtime, runtime_cuda, expected",
    [
        ("2.14.1+cu130", "13.0", False, "2.14.0+cu130", "13.0", "built against torch 2.14.1+cu130, but torch 2.14.0"),
        ("2.14.1", None, False, "2.11.0", None, "built against torch 2.14.1, but torch 2.11.0 is imported"),
        # Nightlies of different dates break the ABI between them.
        ("2.15.0.dev20261101+cpu", None, False, "2.15.0.dev20261102+cpu", None, "torch 2.15.0.dev20261102+cpu"),
        ("2.14.1+cu130", "13.0", True, "2.14.1+cpu", None, "is a CPU-only build"),
        ("2.14.1+cu130", "13.0", True, "2.14.1+cu128", "12.8", "(CUDA 13.0), but the imported torch 2.14.1+cu128 uses"),
    ],
)
def test_other_release_is_refused(built, built_cuda, cuda_compiled, runtime, runtime_cuda, expected):
    problem = mismatch(built, built_cuda, cuda_compiled, runtime, runtime_cuda)
    assert problem is not None and expected in problem


# Imports ckpt_offload in a fresh interpreter with the recorded build torch replaced by TORCH_VERSION,
# as if the extension had been built against another torch release.
PATCHED_IMPORT = """
import runpy, sys, types
sys.path.insert(0, {parent!r})
recorded = runpy.run_path({config!r})
fake = types.ModuleType("ckpt_offload._build_config")
fake.__dict__.update({{k: v for k, v in recorded.items() if k.isupper()}})
fake.TORCH_VERSION = {version!r}
sys.modules["ckpt_offload._build_config"] = fake
try:
    import ckpt_offload
except ImportError as e:
    print("IMPORT_ERROR:", e)
    print("C_LOADED:", "ckpt_offload._C" in sys.modules)
else:
    print("IMPORTED", ckpt_offload.build_info()["built_with_torch"])
"""


def patched_import(version, tmp_path):
    config = os.path.join(PACKAGE_PARENT, "ckpt_offload", "_build_config.py")
    code = PATCHED_IMPORT.format(parent=PACKAGE_PARENT, config=config, version=version)
    r = run_python(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_import_under_another_torch_release_names_both_versions(tmp_path):
    out = patched_import("2.0.0+cu118", tmp_path)
    assert "IMPORT_ERROR: ckpt_offload's native extension does not match the installed torch" in out, out
    assert f"built against torch 2.0.0+cu118, but torch {torch.__version__} is imported" in out, out
    # The rebuild command for this kind of install (in place in a checkout, or pip).
    assert "build_ext --inplace" in out or "pip install --no-build-isolation --no-cache-dir" in out, out
    # Refused before the extension was loaded (under a real mismatch loading it can fail by itself).
    assert "C_LOADED: False" in out, out


def test_import_under_the_same_release_with_another_local_tag(tmp_path):
    # Control for the test above: the same harness imports fine when only the local tag differs.
    base = torch.__version__.split("+")[0]
    cuda_compiled = co.build_info()["cuda_compiled"]
    if cuda_compiled:
        pytest.skip("a CUDA-built _C also compares the CUDA version; the rules are covered above")
    out = patched_import(base + "+cpu", tmp_path)
    assert out.strip() == f"IMPORTED {base}+cpu", out


def test_build_requirements_leave_torch_out():
    """Build isolation would install a torch other than the user's and compile against it."""
    path = os.path.join(SOURCE_ROOT, "pyproject.toml")
    if not os.path.exists(path):
        pytest.skip("no source tree next to the tests")
    with open(path, "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    assert not [r for r in requires if r.split("<")[0].split(">")[0].split("=")[0].strip() == "torch"], requires


def test_setup_without_torch_stops_with_one_clear_message(tmp_path):
    """What a plain `pip install .` (an isolated build environment, no torch) ends with."""
    setup_py = os.path.join(SOURCE_ROOT, "setup.py")
    if not os.path.exists(setup_py):
        pytest.skip("no source tree next to the tests")
    # sys.modules["torch"] = None makes `import torch` raise ImportError, as without torch.
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None\n"
        f"sys.argv = [{setup_py!r}, '--version']\n"
        f"runpy.run_path({setup_py!r}, run_name='__main__')\n"
    )
    r = run_python(code, cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "ckpt_offload: the build needs PyTorch" in r.stderr, r.stderr
    assert "pip install --no-build-isolation ." in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_setup_refuses_a_torch_older_than_the_oldest_checked(tmp_path):
    """pip would otherwise upgrade torch (install_requires) after compiling against the old one."""
    setup_py = os.path.join(SOURCE_ROOT, "setup.py")
    if not os.path.exists(setup_py):
        pytest.skip("no source tree next to the tests")
    # A stand-in torch 2.10.0: setup.py must stop at its version, before using anything else of it.
    code = (
        "import runpy, sys, types\n"
        "torch = types.ModuleType('torch'); torch.__version__ = '2.10.0+cu128'\n"
        "torch.utils = types.ModuleType('torch.utils')\n"
        "torch.utils.cpp_extension = types.ModuleType('torch.utils.cpp_extension')\n"
        "sys.modules.update({'torch': torch, 'torch.utils': torch.utils,\n"
        "                    'torch.utils.cpp_extension': torch.utils.cpp_extension})\n"
        f"sys.argv = [{setup_py!r}, '--version']\n"
        f"runpy.run_path({setup_py!r}, run_name='__main__')\n"
    )
    r = run_python(code, cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "ckpt_offload: torch 2.10.0+cu128 is older than the oldest supported torch (2.11)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


# --- scripts/check_dist.py (what CI's scripts/check_sdist.sh asserts about the sdist and wheel) ---


def load_check_dist():
    path = os.path.join(SOURCE_ROOT, "scripts", "check_dist.py")
    if not os.path.exists(path):
        pytest.skip("no source tree next to the tests")
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_dist", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_sdist(path, names, prefix):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(prefix + name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))


def test_sdist_check_names_a_missing_header_and_a_shipped_build_output(tmp_path):
    check_dist = load_check_dist()
    prefix = f"ckpt_offload-{check_dist.version()}/"
    files = check_dist.source_files()
    assert "csrc/core/host_pool.h" in files and "LICENSE" in files
    complete = tmp_path / "complete.tar.gz"
    write_sdist(complete, files + ["PKG-INFO"], prefix)
    assert check_dist.check_sdist(str(complete)) == []
    # What the sdist of the issue looked like: sources without their headers; and a stale build.
    broken = tmp_path / "broken.tar.gz"
    shipped = [f for f in files if f != "csrc/core/host_pool.h"] + ["PKG-INFO", "ckpt_offload/_C.cpython-311.so"]
    write_sdist(broken, shipped, prefix)
    problems = check_dist.check_sdist(str(broken))
    assert problems == [
        "csrc/core/host_pool.h: in the repository but not in the sdist (MANIFEST.in)",
        "ckpt_offload/_C.cpython-311.so: a build output in the sdist",
    ]


def write_wheel(path, names, metadata):
    import zipfile

    with zipfile.ZipFile(path, "w") as whl:
        for name in names:
            whl.writestr(name, metadata if name.endswith("/METADATA") else "x")


def test_wheel_check_refuses_tests_and_a_missing_marker(tmp_path):
    check_dist = load_check_dist()
    ver = check_dist.version()
    info = f"ckpt_offload-{ver}.dist-info/"
    package = [f for f in check_dist.source_files() if f.startswith("ckpt_offload/")]
    good = package + ["ckpt_offload/_build_config.py", "ckpt_offload/_C.cpython-311-x86_64-linux-gnu.so"]
    good += [info + "METADATA", info + "licenses/LICENSE"]
    metadata = (
        f"Metadata-Version: 2.4\nName: ckpt_offload\nVersion: {ver}\nLicense-Expression: BSD-3-Clause\n"
        "Requires-Python: >=3.11\nRequires-Dist: torch>=2.11\n\n# ckpt_offload\n"
    )
    write_wheel(tmp_path / "good.whl", good, metadata)
    assert check_dist.check_wheel(str(tmp_path / "good.whl")) == []
    bad = [n for n in good if n != "ckpt_offload/py.typed"] + ["tests/api/test_api.py"]
    write_wheel(tmp_path / "bad.whl", bad, metadata.replace(">=3.11", ">=3.9"))
    problems = check_dist.check_wheel(str(tmp_path / "bad.whl"))
    assert (
        "tests/api/test_api.py: not part of the package (tests, benchmarks and scripts stay in the sdist)" in problems
    )
    assert "ckpt_offload/py.typed: missing from the wheel" in problems
    assert "METADATA Requires-Python: '>=3.9', expected '>=3.11'" in problems


def test_no_two_sources_build_to_one_object_file():
    # torch's ninja build names an object after its source's stem: csrc/core/x.cpp and
    # csrc/core/x.cu would both write csrc/core/x.o, and the CUDA build fails ("multiple rules
    # generate"), which a C++-only build never shows. setup.py refuses it; this keeps it so.
    import glob

    sources = [
        p
        for pattern in (
            "csrc/core/*.cpp",
            "csrc/core/*.cu",
            "csrc/torch/*.cpp",
            "csrc/torch/cuda/*.cpp",
            "csrc/torch/cpu/*.cpp",
        )
        for p in glob.glob(os.path.join(SOURCE_ROOT, pattern))
    ]
    assert sources
    stems = [os.path.splitext(p)[0] for p in sources]
    assert sorted({s for s in stems if stems.count(s) > 1}) == []


def test_each_build_compiles_its_own_device_side():
    # The torch layer's CUDA code lives in csrc/torch/cuda/, compiled by the CUDA build only; the
    # C++-only build compiles the CPU fallbacks of csrc/torch/cpu/ instead, one for each file there
    # (a missing fallback would be an undefined symbol that only the other build shows).
    build_env = _build_env()
    cuda, cpu = build_env.torch_layer_sources(True), build_env.torch_layer_sources(False)
    shared = [p for p in cuda if p.count("/") == 2]
    assert shared and shared == [p for p in cpu if p.count("/") == 2]
    cuda_side = [os.path.basename(p) for p in cuda if p.startswith("csrc/torch/cuda/")]
    cpu_side = [os.path.basename(p) for p in cpu if p.startswith("csrc/torch/cpu/")]
    assert "runtime.cpp" in cuda_side and cuda_side == cpu_side
    assert len(cuda) == len(shared) + len(cuda_side) and len(cpu) == len(shared) + len(cpu_side)


def test_one_cpp_standard_for_the_extension_and_the_core():
    # csrc/core is built on its own (CMakeLists.txt, under sanitizers) and inside the extension
    # (setup.py): one standard for both, build_env.py's, which torch's headers need.
    build_env = _build_env()
    with open(os.path.join(SOURCE_ROOT, "CMakeLists.txt")) as f:
        cmake = f.read()
    assert re.findall(r"set\(CMAKE_(?:CXX|CUDA)_STANDARD (\d+)\)", cmake) == [str(build_env.CXX_STANDARD)] * 2
    assert build_env.STD_FLAG == f"-std=c++{build_env.CXX_STANDARD}"
    with open(os.path.join(SOURCE_ROOT, "setup.py")) as f:
        setup = f.read()
    assert 'cxx = ["-O2", "-fvisibility=hidden", STD_FLAG]' in setup  # the C++ files' flags
    assert '"nvcc": ["-O2", "-DCKPT_OFFLOAD_WITH_CUDA", STD_FLAG]' in setup  # the CUDA files'
    assert build_env.STD_FLAG in build_env.torch_compile_flags(False)  # scripts/check_torch_headers.sh's


def test_torch_layer_outside_cuda_folder_has_no_cuda_code():
    # What only the CUDA build compiles is chosen by folder, not by #ifdef: the shared files of
    # csrc/torch/ reach CUDA through csrc/torch/device_runtime.h only.
    import glob

    paths = (
        glob.glob(os.path.join(SOURCE_ROOT, "csrc/torch/*.cpp"))
        + glob.glob(os.path.join(SOURCE_ROOT, "csrc/torch/*.h"))
        + glob.glob(os.path.join(SOURCE_ROOT, "csrc/torch/cpu/*"))
    )
    assert paths
    offenders = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for needle in ("CKPT_OFFLOAD_WITH_CUDA", "<c10/cuda/", "<cuda_runtime", "cuda_stream.h"):
            if needle in text:
                offenders.append(f"{os.path.relpath(path, SOURCE_ROOT)}: {needle}")
    assert offenders == []


def test_extension_sources_use_no_iostreams():
    # Note [No iostreams in the extension] (csrc/core/text.h): an ostringstream of ours is partly
    # built by the libstdc++ copies torch's libraries export; messages are built from strings.
    import glob
    import re

    paths = [
        p
        for p in glob.glob(os.path.join(SOURCE_ROOT, "csrc/**/*"), recursive=True)
        if p.endswith((".cpp", ".h", ".cu")) and os.path.basename(p) != "text.h"
    ]
    assert len(paths) > 20
    pattern = re.compile(
        r"#include\s*<(sstream|fstream|iostream|istream|ostream)>|std::(o|i)?(string|f)?stream\b"
        r"|std::(cout|cerr|clog)\b|\bc10::str\("
    )
    offenders = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line.split("//")[0]):
                    offenders.append(f"{os.path.relpath(path, SOURCE_ROOT)}:{n}: {line.strip()}")
    assert offenders == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's dynamic linker (LD_DEBUG)")
def test_extension_binds_libstdcxx_symbols_to_libstdcxx(tmp_path):
    # setup.py links libstdc++ first, so the extension's libstdc++ references are versioned and do
    # not bind to the copies of libstdc++'s newer pieces that torch's libraries export (Note [No
    # iostreams in the extension]). The dynamic linker reports every binding it makes.
    so = co._C.__file__
    trace = tmp_path / "bindings"
    env = dict(os.environ, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(trace))
    done = subprocess.run(
        [sys.executable, "-c", "import ckpt_offload"],
        cwd=PACKAGE_PARENT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = [
        line
        for f in tmp_path.glob("bindings*")
        for line in f.read_text(errors="replace").splitlines()
        if f"binding file {so} " in line
    ]
    assert lines, "LD_DEBUG reported no binding of the extension"
    to_torch = [
        line.split("symbol ")[-1]
        for line in lines
        if "/torch/lib/" in line and re.search(r"symbol `_Z(N|NK|NKR|T[VIT]N)?St|symbol `_ZSt", line)
    ]
    assert to_torch == []


def _build_env():
    sys.path.insert(0, os.path.join(SOURCE_ROOT, "scripts"))
    try:
        import build_env
    finally:
        sys.path.pop(0)
    return build_env


@pytest.mark.parametrize(
    "forced, problems, gpu, cuda, says",
    [
        # The default: CUDA only where it can be built and a GPU can run it.
        (None, [], "torch.cuda.is_available()", True, "building the CUDA engine"),
        ("", [], "nvidia-smi -L", True, "building the CUDA engine"),
        (None, [], None, False, "CKPT_OFFLOAD_CUDA=1"),  # no GPU: C++-only, and how to force CUDA
        (None, ["no CUDA toolkit found"], "nvidia-smi -L", False, "no CUDA toolkit found"),
        # Forcing works both ways, GPU or not.
        ("1", [], None, True, "CKPT_OFFLOAD_CUDA=1"),
        ("0", [], "torch.cuda.is_available()", False, "C++-only"),
    ],
)
def test_setup_builds_cuda_only_where_a_gpu_can_run_it(forced, problems, gpu, cuda, says):
    got, line, error = _build_env().decide_cuda(forced, problems, gpu)
    assert error is None and got is cuda and says in line, (got, line)


def test_setup_forcing_cuda_that_cannot_be_built_or_a_bad_value_is_an_error():
    decide = _build_env().decide_cuda
    cuda, line, error = decide("1", ["no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)"], None)
    assert not cuda and "CUDA build impossible: no CUDA toolkit found" in error and "CKPT_OFFLOAD_CUDA" in error
    cuda, _, error = decide("yes", [], "nvidia-smi -L")
    assert not cuda and error == "ckpt_offload: CKPT_OFFLOAD_CUDA must be 0 or 1, got 'yes'"


class _NoCudaTorch:
    class version:
        cuda = None


def test_usable_gpu_asks_nvidia_smi_when_torch_cannot_see_one(tmp_path, monkeypatch):
    build_env = _build_env()
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert build_env.usable_gpu(_NoCudaTorch) == "nvidia-smi -L"
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    assert build_env.usable_gpu(_NoCudaTorch) is None


def test_setup_without_a_gpu_defaults_to_the_cpp_engine_and_says_how_to_force_cuda(tmp_path):
    build_env = _build_env()
    if build_env.usable_gpu(torch):
        pytest.skip("a GPU is here: the default builds the CUDA engine")
    env = {k: v for k, v in os.environ.items() if k != "CKPT_OFFLOAD_CUDA"}
    r = subprocess.run(
        [sys.executable, os.path.join(SOURCE_ROOT, "setup.py"), "--name"],
        cwd=SOURCE_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    # Either the toolchain is missing (C++-only for that reason) or the GPU is: both say C++-only.
    assert "C++-only" in r.stderr, r.stderr
    if torch.version.cuda is not None and build_env.is_toolkit(os.environ.get("CUDA_HOME", "/usr/local/cuda")):
        assert build_env.NO_GPU_MESSAGE in r.stderr, r.stderr
