"""ckpt_offload: keep saved activations in a pinned host-memory pool instead of GPU memory.

Example::

    import ckpt_offload as co
    with co.offload() as ctx:
        loss = model(x).sum()
    loss.backward()
    print(ctx.stats())
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

from ckpt_offload._version import __version__  # noqa: F401  (co.__version__)
from ckpt_offload._runtime import synchronize  # loads the native extension (a clear error if it cannot)
from ckpt_offload._info import build_info
from ckpt_offload._warn import deprecated_names as _deprecated_names
from ckpt_offload.blocks import CheckpointHandle, apply
from ckpt_offload.checkpointing import checkpoint, checkpoint_sequential
from ckpt_offload.host_copy import offload_tensor
from ckpt_offload.offloading import keep, offload
from ckpt_offload.options import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH_BYTES,
    OffloadOptions,
)
from ckpt_offload.selective import selective_offload_context
from ckpt_offload.pool import HostPool, PoolFullError, SpillError, default_pool, pinned_available
from ckpt_offload.profiling import DEPRECATED as _PROFILING_DEPRECATED
from ckpt_offload.profiling import ProfileReport, profile
from ckpt_offload.planner import Plan, plan
from ckpt_offload.tiling import Tiled, tiled, tiled_cross_entropy
from ckpt_offload.tile_model import TileHandle, TileOptions, tile

__all__ = [
    "offload",
    "keep",
    "offload_tensor",
    "OffloadOptions",
    "checkpoint",
    "checkpoint_sequential",
    "selective_offload_context",
    "apply",
    "CheckpointHandle",
    "HostPool",
    "PoolFullError",
    "SpillError",
    "default_pool",
    "pinned_available",
    "build_info",
    "synchronize",
    "DEFAULT_MIN_BYTES",
    "DEFAULT_PREFETCH_BYTES",
    "DEFAULT_BATCH_BYTES",
    "profile",
    "ProfileReport",
    "plan",
    "Plan",
    "tiled",
    "Tiled",
    "tiled_cross_entropy",
    "tile",
    "TileOptions",
    "TileHandle",
]

# Modules renamed in 0.2.0 so that no public name hides a module: `ckpt_offload.offload` and
# `ckpt_offload.checkpoint` were modules shadowed by the context manager and the function of the
# same name. An import of an old path says where it went, instead of "No module named ...".
_MOVED = {
    "ckpt_offload.offload": "ckpt_offload.offloading",
    "ckpt_offload.checkpoint": "ckpt_offload.checkpointing (co.apply and CheckpointHandle: ckpt_offload.blocks)",
    "ckpt_offload.planner.plan": "ckpt_offload.planner.planning",
    "ckpt_offload.planner.cli": "ckpt_offload.cli.plan",
    "ckpt_offload.demo.cli": "ckpt_offload.cli",
    "ckpt_offload.integrations._hf_trainer": "ckpt_offload.integrations.hf.trainer",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = _MOVED.get(name)
        if new is None:
            return None
        raise ModuleNotFoundError(
            f"{name} was renamed in ckpt_offload 0.2.0: import from {new} instead (the public names are "
            f"also at the top level: co.offload, co.checkpoint, co.apply, co.DEFAULT_MIN_BYTES, ...; see "
            "CHANGELOG.md)",
            name=name,
        )


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


_deprecated = _deprecated_names(__name__, _PROFILING_DEPRECATED, stacklevel=3)


def __getattr__(name):
    # co.hf imports transformers only when asked for.
    if name == "hf":
        module = importlib.import_module("ckpt_offload.integrations.hf")
        globals()["hf"] = module
        return module
    return _deprecated(name)  # co.Profile: the alias co.profiling keeps (it warns)
