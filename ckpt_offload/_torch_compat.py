"""The torch-release guard that runs before ckpt_offload's native extension is loaded.

``_C`` is compiled against one torch release's C++ headers and links that release's libraries
(libc10, libtorch, libtorch_python; libc10_cuda and the CUDA runtime for the CUDA engine). torch
keeps no C++ ABI between releases, so under another torch ``_C`` either fails to load with an
undefined-symbol error that names neither version, or loads and misbehaves. setup.py records the
build's torch in ``_build_config.py``; this module compares it with the imported torch before
``_C`` is imported (a mismatch can fail inside the loader, too late to explain).

"Same release" means the same public version, ``torch.__version__`` without its local part:
``2.14.1+cu130`` and ``2.14.1+cpu`` are the same release (their C++ API and ABI are the same; only the
CUDA variant differs), ``2.14.1`` and ``2.14.0`` are not, and neither are two nightlies of
different dates (``2.15.0.dev20261101``), which do break the ABI between them. The CUDA variant is
checked on its own, and only where it matters: an extension with the CUDA engine compiled in links
the CUDA runtime of its build, so it needs a CUDA torch of the same CUDA major version (CUDA keeps
compatibility within a major version). A C++-only extension loads under any variant of its release.
"""

from __future__ import annotations

import os


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def _cuda_major(version: str | None) -> str | None:
    return version.split(".", 1)[0] if version else None


def mismatch(
    built_torch: str,
    built_cuda: str | None,
    cuda_compiled: bool,
    runtime_torch: str,
    runtime_cuda: str | None,
) -> str | None:
    """Why an extension built against ``built_torch`` (its torch's CUDA ``built_cuda``; the CUDA
    engine compiled in when ``cuda_compiled``) cannot run under ``runtime_torch`` (CUDA
    ``runtime_cuda``), or None when it can.

    Example::

        >>> mismatch("2.14.1+cu130", "13.0", True, "2.14.1+cu130", "13.0") is None
        True
        >>> mismatch("2.14.1+cu130", "13.0", False, "2.11.0+cpu", None)
        'it was built against torch 2.14.1+cu130, but torch 2.11.0+cpu is imported'
    """
    if _public(built_torch) != _public(runtime_torch):
        return f"it was built against torch {built_torch}, but torch {runtime_torch} is imported"
    if cuda_compiled and runtime_cuda is None:
        return (
            f"it was built with its CUDA engine against torch {built_torch} (CUDA {built_cuda}), but the "
            f"imported torch {runtime_torch} is a CPU-only build"
        )
    if cuda_compiled and _cuda_major(built_cuda) != _cuda_major(runtime_cuda):
        return (
            f"it was built with its CUDA engine against torch {built_torch} (CUDA {built_cuda}), but the "
            f"imported torch {runtime_torch} uses CUDA {runtime_cuda}"
        )
    return None


def rebuild_command() -> str:
    """The command that rebuilds _C against the torch now installed."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    source_dir = os.path.dirname(package_dir)
    if os.path.exists(os.path.join(source_dir, "setup.py")):
        # Built in place in a source checkout (python setup.py build_ext --inplace).
        return f"cd {source_dir} && python setup.py build_ext --inplace"
    # --no-cache-dir: pip would otherwise reinstall the wheel it cached from the first build,
    # compiled against the old torch.
    return (
        "pip install --no-build-isolation --no-cache-dir --force-reinstall --no-deps "
        "<the ckpt_offload sdist or source folder>"
    )


def build_config():
    """The ``_build_config`` module setup.py wrote, or None for a build made without setup.py."""
    try:
        import ckpt_offload._build_config as _build_config
    except ImportError:
        return None
    return _build_config


def check(torch) -> None:
    """Raises ImportError naming both torch versions and the rebuild command when the built
    extension does not match the imported ``torch``."""
    config = build_config()
    if config is None:
        return
    problem = mismatch(
        config.TORCH_VERSION, config.TORCH_CUDA_VERSION, config.CUDA_COMPILED, torch.__version__, torch.version.cuda
    )
    if problem:
        raise ImportError(
            f"ckpt_offload's native extension does not match the installed torch: {problem}. A compiled "
            f"extension only loads under the torch release it was built against. Rebuild it against this "
            f"torch: {rebuild_command()}"
        )
