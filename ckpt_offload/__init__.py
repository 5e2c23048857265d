"""ckpt_offload: keep saved activations in a pinned host-memory pool instead of GPU memory.

Example::

    import ckpt_offload as co
    with co.offload() as ctx:
        loss = model(x).sum()
    loss.backward()
    print(ctx.stats())
"""

from __future__ import annotations

import torch

from ckpt_offload import _torch_compat
from ckpt_offload._version import __version__

# Before _C is loaded: under another torch release loading it can fail inside the dynamic loader
# with an undefined-symbol error that names no version; this says which torch it needs instead.
_torch_compat.check(torch)
try:
    from ckpt_offload import _C
except ImportError as e:  # pragma: no cover - explained to the user
    raise ImportError(
        f"ckpt_offload's native extension could not be loaded ({e}). Build it with "
        "`pip install --no-build-isolation .` in the source folder; if you run Python from the source "
        "folder itself, its ckpt_offload/ (without the built extension) shadows the installed one: run "
        "from elsewhere, or build in place with `python setup.py build_ext --inplace`."
    ) from e
from ckpt_offload.checkpoint import CheckpointHandle, apply, checkpoint, checkpoint_sequential
from ckpt_offload.offload import DEFAULT_MIN_BYTES, keep, offload, offload_tensor
from ckpt_offload.pool import HostPool, PoolFullError, SpillError, default_pool, pinned_available
from ckpt_offload.profiling import Profile, ProfileReport, profile
from ckpt_offload.planner import Plan, plan

__all__ = [
    "offload",
    "keep",
    "offload_tensor",
    "checkpoint",
    "checkpoint_sequential",
    "apply",
    "CheckpointHandle",
    "HostPool",
    "PoolFullError",
    "SpillError",
    "default_pool",
    "build_info",
    "synchronize",
    "DEFAULT_MIN_BYTES",
    "profile",
    "ProfileReport",
    "Profile",  # deprecated alias of ProfileReport
    "plan",
    "Plan",
]


def build_info() -> dict:
    """How this ckpt_offload was built and what it can use here.

    Keys: ``version``, ``cuda_compiled`` (the CUDA copy engine is built in), ``gpu_available``,
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
    cuda = bool(_C.cuda_compiled())
    config = _torch_compat.build_config()
    pinned = pinned_available()
    return {
        "version": __version__,
        "cuda_compiled": cuda,
        "gpu_available": bool(cuda and torch.cuda.is_available() and _C.cuda_device_count() > 0),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if cuda else None,
        "built_with_torch": config.TORCH_VERSION if config else None,
        "built_with_cuda": config.TORCH_CUDA_VERSION if config and cuda else None,
        "cuda_runtime_version": (_C.cuda_runtime_version() or None) if cuda else None,
        "pool_backend": "pinned" if pinned else "pageable",
        "alignment": int(_C.ALIGNMENT),
        "default_min_bytes": DEFAULT_MIN_BYTES,
    }


def synchronize() -> None:
    """Waits for every copy on ckpt_offload's side streams (all devices, both directions) and
    releases the source tensors those copies held. Copies made with ``stream="compute"`` run on
    the compute stream itself; ``torch.cuda.synchronize()`` waits for those."""
    _C.synchronize()


def __getattr__(name):
    # co.hf imports transformers only when asked for.
    if name == "hf":
        import importlib

        module = importlib.import_module("ckpt_offload.integrations.hf")
        globals()["hf"] = module
        return module
    raise AttributeError(f"module 'ckpt_offload' has no attribute {name!r}")
