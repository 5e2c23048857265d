"""The handle of what co.apply, a plan or co.hf.enable wrapped: :class:`CheckpointHandle` (which
blocks, what each does, their offload counts, ``remove()``), where a model keeps it, and the
guard against wrapping a model twice."""

from __future__ import annotations

import torch

from ckpt_offload._stats import StatsCollector
from ckpt_offload.blocks.forward import BlockForward

__all__ = ["HANDLE_ATTR", "CheckpointHandle", "active_handle", "check_not_applied"]


class CheckpointHandle:
    """Returned by :func:`apply`, ``Plan.apply`` and ``co.hf.enable`` (its
    :class:`~ckpt_offload.integrations.hf.HFCheckpointHandle` is this class with Hugging Face's
    installing and restoring): which blocks are wrapped (:attr:`names`) and what each does
    (:attr:`kinds`), their offload counts (:meth:`stats`), and :meth:`remove` to restore the model.

    Example::

        handle = co.apply(model, offload=True)
        print(handle.names[:2], handle.kinds[:2])   # ['layers.0', 'layers.1'] ['recompute_offload', ...]
        handle.remove()                             # every block has its own forward back
    """

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: list,
        names: list,
        kinds: list,
        every_n_layers: int = 1,
        collector: StatsCollector | None = None,
    ):
        self._model = model
        self._blocks = blocks
        self.names = names  #: qualified names of the wrapped blocks
        self._kinds = kinds
        self.every_n_layers = every_n_layers
        self.removed = False
        self._collector = collector if collector is not None else StatsCollector()
        #: the :class:`~ckpt_offload.tile_model.TileHandle` of ``tile=`` (None without it)
        self.tiles = None

    @property
    def kinds(self) -> list:
        """Per wrapped block, what it does (as ``plan.choices`` names it)."""
        return self._kinds

    def stats(self) -> dict:
        """What offload did in this handle's checkpoints, and only theirs: the keys of
        :meth:`ckpt_offload.offload.stats` summed over the contexts they used (the handle's own:
        another model wrapped with equal options counts apart; peaks: the largest),
        ``pool_peak_bytes`` (the most bytes in use in the pool, read at each pack and unpack of
        these checkpoints' inputs, since the last :meth:`reset_stats`) and ``device_saved_peak_bytes``
        (the most bytes of saved activations held on the device at once -- kept, reloaded,
        prefetched -- as co.profile() reports it, sampled at each pack and unpack of these
        checkpoints' inputs; see Note [Handle device peak] in ``_stats.py``). All
        zeros without ``offload``.

        Example::

            handle = co.apply(model, offload=True)
            model(x).sum().backward()
            print(handle.stats()["bytes_offloaded"], handle.stats()["kept_by_reason"])
            print(handle.stats()["device_saved_peak_bytes"])    # the device's peak of saved bytes
        """
        return self._collector.stats()

    def reset_stats(self) -> None:
        """Counts from zero again, the device peak included (see :meth:`stats`)."""
        self._collector.reset()

    def remove(self) -> None:
        """Restores every wrapped block's own ``forward`` (the one it had before). Calling it
        twice is harmless."""
        if self.removed:
            return
        if self.tiles is not None:
            self.tiles.remove()
        self._restore()
        if self._model.__dict__.get(HANDLE_ATTR) is self:
            del self._model.__dict__[HANDLE_ATTR]
        self.removed = True

    def _restore(self) -> None:
        """What :meth:`remove` undoes besides the model's handle attribute (a route's own part)."""
        for block in self._blocks:
            BlockForward.uninstall(block)

    def __repr__(self) -> str:
        every = f", every_n_layers={self.every_n_layers}" if self.every_n_layers != 1 else ""
        return f"{type(self).__name__}({len(self.names)} blocks{every}, removed={self.removed})"


#: Where a model keeps the handle of what ckpt_offload applied to it (co.apply, a plan, co.hf.enable).
HANDLE_ATTR = "_ckpt_offload_handle"


def active_handle(model: torch.nn.Module) -> CheckpointHandle | None:
    """The handle of what co.apply, a plan or co.hf.enable applied to ``model``, while it is
    applied (not removed); else None."""
    handle = getattr(model, "__dict__", {}).get(HANDLE_ATTR)
    return handle if isinstance(handle, CheckpointHandle) and not handle.removed else None


def check_not_applied(model: torch.nn.Module, named_blocks=(), route: str = "co.apply", why: str = "") -> None:
    """Refuses a model (or one of ``named_blocks``) that co.apply, co.hf.enable or a plan already
    wraps: wrapping twice would checkpoint twice (and ``remove`` could not restore the model)."""
    if active_handle(model) is not None:
        raise RuntimeError(
            f"{route}: the model is already wrapped by co.apply, co.hf.enable or a plan (ckpt_offload is already "
            f"applied to it){why}. Call .remove() on the handle it returned (model._ckpt_offload_handle.remove()) "
            "first"
        )
    for name, block in named_blocks:
        if "_ckpt_offload_wrapped" in block.__dict__:
            raise RuntimeError(
                f"{route}: block {name!r} is already wrapped by co.apply or a plan{why}; call .remove() on that "
                "handle first"
            )
