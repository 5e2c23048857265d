"""Build ckpt_offload's native core.

A CUDAExtension when torch has CUDA, nvcc is found and a GPU is there to run it
(torch.cuda.is_available(), or nvidia-smi lists one); a CppExtension otherwise, which builds
several times faster. CKPT_OFFLOAD_CUDA=1 forces the CUDA build (and fails with an explanation
when it cannot be done), e.g. for a wheel meant for another machine; CKPT_OFFLOAD_CUDA=0 forces
the C++-only build.
"""

import os
import shutil
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The toolkit and include-dir discovery is shared with scripts/check_torch_headers.sh.
sys.path.insert(0, os.path.join(HERE, "scripts"))
from build_env import (  # noqa: E402
    STD_FLAG,
    decide_cuda as _decide_cuda,
    extra_cuda_include_flags,
    is_toolkit as _is_toolkit,
    locate_cuda_home as _locate_cuda_home,
    sources as _sources,
    torch_layer_sources,
    usable_gpu as _usable_gpu,
)

_locate_cuda_home()

# Build isolation, on purpose: torch is NOT in pyproject.toml's [build-system] requires. The
# extension links against the torch it is compiled with, so it must be compiled with the torch the
# user runs; an isolated build would download another (gigabytes) and produce an extension that
# fails to load next to the user's torch. Without torch in the build environment, stop here with
# one message (a plain `pip install .` lands here).
NO_TORCH_MESSAGE = (
    "ckpt_offload: the build needs PyTorch, and compiles against the torch you run. Install torch first "
    "(pip install torch), then build without build isolation: pip install --no-build-isolation . "
    "(or pip install --no-build-isolation ckpt_offload-<version>.tar.gz). A plain `pip install .` builds in an "
    "isolated environment that cannot see your torch."
)
# The oldest torch a CI check compiles against (README: supported torch versions). Refusing older
# ones at build time also keeps pip from upgrading torch (install_requires) after compiling
# against the old one.
MIN_TORCH = (2, 11)

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - explained to the user; tests/package/test_packaging.py runs it
    sys.exit(NO_TORCH_MESSAGE)

if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
    sys.exit(
        "ckpt_offload: torch %s is older than the oldest supported torch (%d.%d); install torch>=%d.%d first, "
        "then build with pip install --no-build-isolation ." % ((torch.__version__,) + MIN_TORCH + MIN_TORCH)
    )


CORE = _sources("csrc/core/*.cpp")
# The torch layer and its device side, picked the way pytorch's extension-cpp example picks
# sources: the CUDA build adds csrc/torch/cuda/, the C++-only build the CPU fallbacks of
# csrc/torch/cpu/ (csrc/torch/device_runtime.h; scripts/build_env.py lists them).
TORCH_LAYER_CUDA = torch_layer_sources(with_cuda=True)
TORCH_LAYER_CPU = torch_layer_sources(with_cuda=False)
CUDA_SOURCES = _sources("csrc/core/*.cu")
# torch's ninja build names each object after its source's stem (csrc/core/x.cpp and
# csrc/core/x.cu would both be build/.../csrc/core/x.o: "multiple rules generate"), so two sources
# of one folder must not share a stem.
_stems = [os.path.splitext(p)[0] for p in CORE + sorted(set(TORCH_LAYER_CUDA + TORCH_LAYER_CPU)) + CUDA_SOURCES]
_clash = sorted({s for s in _stems if _stems.count(s) > 1})
if _clash:
    sys.exit(
        "ckpt_offload: sources that would build to the same object file: "
        + ", ".join(f"{s}.*" for s in _clash)
        + "; rename one of each (e.g. x_kernels.cu next to x.cpp)"
    )
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"


def want_cuda():
    forced = os.environ.get("CKPT_OFFLOAD_CUDA")
    problems = []
    if forced != "0":
        if torch.version.cuda is None:
            problems.append(
                f"the installed torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
            )
        home = cpp_extension.CUDA_HOME
        if not home:
            problems.append("no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
        elif not _is_toolkit(home):
            problems.append(f"CUDA_HOME={home} has no bin/nvcc or include/cuda_runtime.h")
    # A GPU is looked for only when it decides: forced builds and impossible ones do not need it.
    gpu = _usable_gpu(torch) if forced in (None, "") and not problems else None
    cuda, line, error = _decide_cuda(forced, problems, gpu)
    if error:
        sys.exit(error)
    print(line, file=sys.stderr)
    return cuda


def extension():
    # The one standard of every C++ and CUDA file (scripts/build_env.py: C++20, what torch's headers
    # need from 2.10 on), said here rather than left to torch's default.
    cxx = ["-O2", "-fvisibility=hidden", STD_FLAG]
    # libstdc++ first among the libraries the extension needs (torch's builder appends c10 and
    # torch after these): the extension's references to libstdc++ are then versioned and bind to
    # libstdc++ itself, not to the copies of its newer pieces that libc10 and libtorch_cpu export
    # (Note [No iostreams in the extension], csrc/core/text.h).
    libraries = ["stdc++"]
    if want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        cxx += ["-DCKPT_OFFLOAD_WITH_CUDA"] + extra_cuda_include_flags(cpp_extension.CUDA_HOME, torch)
        return cpp_extension.CUDAExtension(
            "ckpt_offload._C",
            CORE + TORCH_LAYER_CUDA + CUDA_SOURCES,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O2", "-DCKPT_OFFLOAD_WITH_CUDA", STD_FLAG]},
            libraries=libraries,
        )
    return cpp_extension.CppExtension(
        "ckpt_offload._C", CORE + TORCH_LAYER_CPU, extra_compile_args={"cxx": cxx}, libraries=libraries
    )


BUILD_CONFIG = "_build_config.py"


def build_config_text(ext):
    """ckpt_offload/_build_config.py: the torch (and CUDA) this build compiles against. The package
    reads it before loading _C, so that a torch mismatch is an ImportError naming both versions
    instead of an undefined-symbol error from the loader (ckpt_offload/_torch_compat.py)."""
    cuda_compiled = any(s.endswith(".cu") for s in ext.sources)
    return (
        "# Written by setup.py when ckpt_offload._C was built; read before _C is loaded\n"
        "# (ckpt_offload/_torch_compat.py). Not in git or the sdist: every build writes its own.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"TORCH_CUDA_VERSION = {torch.version.cuda!r}  # torch.version.cuda of that torch\n"
        f"CUDA_COMPILED = {cuda_compiled!r}  # the CUDA engine (.cu sources) is compiled in\n"
    )


class BuildExt(cpp_extension.BuildExtension):
    def _config_paths(self):
        """(in build_lib, in the source tree): where _build_config.py goes next to _C."""
        package_dir = self.get_finalized_command("build_py").get_package_dir("ckpt_offload")
        return (
            os.path.join(self.build_lib, "ckpt_offload", BUILD_CONFIG),
            os.path.join(package_dir, BUILD_CONFIG),
        )

    def run(self):
        super().run()  # builds into build_lib, then copies _C to the source tree when --inplace
        ext = next(e for e in self.extensions if e.name == "ckpt_offload._C")
        regular, inplace = self._config_paths()
        os.makedirs(os.path.dirname(regular), exist_ok=True)
        with open(regular, "w") as f:
            f.write(build_config_text(ext))
        if self.inplace:
            shutil.copyfile(regular, inplace)

    # Declared as outputs so that wheels and editable installs carry the file like _C itself.
    def get_outputs(self):
        outputs = super().get_outputs()  # --inplace: the keys of get_output_mapping, below
        if not self.inplace:
            outputs.append(self._config_paths()[0])
        return outputs

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            regular, inplace = self._config_paths()
            mapping[regular] = inplace
        return mapping

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


def read_version():
    # Read, not imported: importing ckpt_offload needs the extension this script builds.
    scope = {}
    with open(os.path.join(HERE, "ckpt_offload", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    LONG_DESCRIPTION = f.read()

setup(
    name="ckpt_offload",
    version=read_version(),
    description="Activation offloading to a pinned host-memory pool and gradient checkpointing for PyTorch",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    author="the ckpt_offload developers",
    # SPDX expression (PEP 639, setuptools >= 77); no License classifier, which PEP 639 replaces.
    license_expression="BSD-3-Clause",
    license_files=["LICENSE"],
    packages=find_packages(include=["ckpt_offload", "ckpt_offload.*"]),
    package_data={"ckpt_offload": ["py.typed"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
    # CI runs Python 3.11 only (README, Install): the floor is what is tested, newer Pythons are
    # expected to work but are not checked.
    python_requires=">=3.11",
    install_requires=["torch>=%d.%d" % MIN_TORCH],
    keywords=["pytorch", "activation offloading", "gradient checkpointing", "memory", "cuda"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Environment :: GPU :: NVIDIA CUDA",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
    zip_safe=False,
)
