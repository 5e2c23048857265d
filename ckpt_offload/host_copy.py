"""``co.offload_tensor``: one tensor copied into the host pool outside autograd, and given back by
``handle.reload()`` -- the copy engine on its own. The checks of the tensor itself and the
pool-full error are the native side's (``csrc/torch/host_copies.cpp``); here, the arguments."""

from __future__ import annotations

import torch

from ckpt_offload._args import check_choice, suggest_keywords
from ckpt_offload._runtime import _C
from ckpt_offload.options import STREAM_MODES
from ckpt_offload.pool import HostPool, default_pool

__all__ = ["offload_tensor"]


@suggest_keywords("co.offload_tensor")
def offload_tensor(tensor: torch.Tensor, pool: HostPool | None = None, stream: str = "side"):
    """Copies one tensor into the pool, outside autograd; ``handle.reload()`` gives it back.

    The low-level entry to the copy engine (what :class:`offload` uses per saved tensor): the
    copy is asynchronous on ``stream="side"``, the exact layout (sizes, strides, storage offset)
    comes back, an expanded tensor is stored at the size of its source, and the pool block is
    returned when the handle dies, after its last copy has finished. Raises
    :class:`~ckpt_offload.PoolFullError` when the pool is at its cap, and ``ValueError`` for a
    tensor whose bytes are not one plain strided span of its own storage -- among them a
    ZeroTensor (forward-mode AD's zero tangents, ``torch._efficientzerotensor``), which has no
    data to copy: keep it as it is (``co.offload`` does, as ``kept_by_reason["no_data"]``).

    With ``stream="side"`` the copy waits only for work already enqueued when this is called:
    do not modify ``tensor`` in place before :func:`ckpt_offload.synchronize` (``reload`` raises
    if it sees the tensor's version changed, but the copy may already hold the new values).

    Example::

        h = co.offload_tensor(x)          # x's bytes now also live in the pool
        del x                             # device memory can go
        x = h.reload()                    # same values, same strides, on the same device
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if pool is not None and not isinstance(pool, HostPool):
        raise TypeError(f"pool must be a ckpt_offload.HostPool or None, got {type(pool).__name__}")
    check_choice("stream", stream, STREAM_MODES)
    pool = pool if pool is not None else default_pool()
    # What the tensor itself must be, and the pool-full error with offload_tensor's own remedies,
    # are the native side's (csrc/torch/host_copies.cpp): one check, one set of messages.
    return _C.offload_tensor(tensor.detach(), pool._impl, stream == "side")
