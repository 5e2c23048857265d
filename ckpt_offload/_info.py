"""``co.build_info()``: how this ckpt_offload was built and what it can use here."""

from __future__ import annotations

import torch

from ckpt_offload._torch_compat import build_config
from ckpt_offload._runtime import _C, cuda_compiled, gpu_usable
from ckpt_offload._version import __version__
from ckpt_offload.options import DEFAULT_MIN_BYTES
from ckpt_offload.pool import pinned_available

__all__ = ["build_info"]


def build_info() -> dict:
    """How this ckpt_offload was built and what it can use here.

    Keys: ``version``, ``cuda_compiled`` (the CUDA copy engine is built in), ``gpu_available``
    (CUDA tensors can be offloaded here: the engine, torch and the CUDA runtime all see a GPU),
    ``torch_version``, ``cuda_version`` (torch's CUDA version when CUDA is compiled in, else None),
    ``built_with_torch`` and ``built_with_cuda`` (the torch, and the CUDA version when CUDA is compiled
    in, that the extension was compiled against; None for a build made without setup.py),
    ``cuda_runtime_version`` (the CUDA runtime ckpt_offload runs against, or None),
    ``pool_backend`` (``"pinned"`` or ``"pageable"``: what a pool made with ``pinned=None`` uses),
    ``alignment`` (bytes), ``default_min_bytes``.

    Example::

        >>> co.build_info()["cuda_compiled"]
        True
    """
    cuda = cuda_compiled()
    config = build_config()
    return {
        "version": __version__,
        "cuda_compiled": cuda,
        "gpu_available": gpu_usable(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if cuda else None,
        "built_with_torch": config.TORCH_VERSION if config else None,
        "built_with_cuda": config.TORCH_CUDA_VERSION if config and cuda else None,
        "cuda_runtime_version": (_C.cuda_runtime_version() or None) if cuda else None,
        "pool_backend": "pinned" if pinned_available() else "pageable",
        "alignment": int(_C.ALIGNMENT),
        "default_min_bytes": DEFAULT_MIN_BYTES,
    }
