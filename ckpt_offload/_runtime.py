"""The native extension and what this process can run with it: loaded and decided here, once.

Every other module takes ``_C`` and the "is a GPU usable" answer from here, so that the import
error a user sees and the rule for "a GPU is usable" are written one time.
"""

from __future__ import annotations

import torch

from ckpt_offload._torch_compat import check as _check_torch

# Before _C is loaded: under another torch release loading it can fail inside the dynamic loader
# with an undefined-symbol error that names no version; this says which torch it needs instead.
_check_torch(torch)
try:
    import ckpt_offload._C as _C
except ImportError as e:  # pragma: no cover - explained to the user
    raise ImportError(
        f"ckpt_offload's native extension could not be loaded ({e}). Build it with "
        "`pip install --no-build-isolation .` in the source folder; if you run Python from the source "
        "folder itself, its ckpt_offload/ (without the built extension) shadows the installed one: run "
        "from elsewhere, or build in place with `python setup.py build_ext --inplace`."
    ) from e

__all__ = ["_C", "cuda_compiled", "gpu_usable", "usable_device_types", "default_devices", "synchronize"]


def cuda_compiled() -> bool:
    """True when the CUDA copy engine is built into this ckpt_offload."""
    return bool(_C.cuda_compiled())


def gpu_usable() -> bool:
    """True when CUDA tensors can be offloaded here: the CUDA engine is built in, torch sees a
    GPU, and the CUDA runtime ckpt_offload runs on counts at least one device."""
    return bool(cuda_compiled() and torch.cuda.is_available() and _C.cuda_device_count() > 0)


def usable_device_types() -> set:
    """Device types that have tensors to offload here: ``cpu`` always, ``cuda`` when
    :func:`gpu_usable`."""
    return {"cpu", "cuda"} if gpu_usable() else {"cpu"}


def default_devices() -> list:
    """What ``co.offload(devices=None)`` offloads: the accelerator in use, nothing without one."""
    return ["cuda"] if gpu_usable() else []


def synchronize() -> None:
    """Waits for every copy on ckpt_offload's side streams (all devices, both directions) and
    releases the source tensors those copies held. Copies made with ``stream="compute"`` run on
    the compute stream itself; ``torch.cuda.synchronize()`` waits for those.

    Example::

        h = co.offload_tensor(x)
        co.synchronize()        # the copy into the pool has finished; x may be modified now
    """
    _C.synchronize()
