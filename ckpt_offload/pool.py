"""The host-memory pool that offloaded activations live in."""

from __future__ import annotations

import threading

from ckpt_offload import _C
from ckpt_offload._args import check_choice, check_native_int, check_optional_bool

__all__ = ["HostPool", "PoolFullError", "default_pool", "pinned_available", "BACKENDS"]

#: Host-memory backends: ``"pinned"`` (``cudaHostAlloc``), ``"registered"`` (page-aligned,
#: pre-faulted memory pinned with ``cudaHostRegister``) and ``"pageable"`` (plain memory).
BACKENDS = ("pinned", "registered", "pageable")

#: Raised when the pool is at its cap and the context was made with ``on_full="raise"``.
#: A subclass of ``MemoryError``.
PoolFullError = _C.PoolFullError


def pinned_available() -> bool:
    """True when this build can pin host memory: CUDA compiled in and a usable GPU present."""
    return bool(_C.cuda_compiled() and _C.cuda_device_count() > 0)


class HostPool:
    """A pool of host memory for offloaded activations.

    Memory is taken from the backend in large segments (``segment_bytes``; a larger request
    gets a segment of its own size) and handed out as best-fit blocks aligned to 512 bytes,
    split and coalesced, never rounded up to a power of two. A block freed while a copy may
    still touch it is reused only once that copy has finished.

    Args:
        max_bytes: cap on the host memory the pool reserves, in bytes; ``None`` for no cap.
            At the cap, :func:`ckpt_offload.offload` keeps tensors on the device (``on_full="keep"``)
            or raises :class:`PoolFullError` (``on_full="raise"``).
        pinned: ``True`` for page-locked memory (``cudaHostAlloc``; needs a GPU), ``False`` for
            pageable memory, ``None`` to pin whenever a GPU is usable.
        segment_bytes: size of the segments small requests are carved from (default 64 MiB).
        backend: overrides ``pinned`` with a backend by name, one of :data:`BACKENDS`:
            ``"registered"`` pins large page-aligned host allocations with ``cudaHostRegister``
            (pre-faulted first) instead of ``cudaHostAlloc``; both give page-locked memory that
            copies run from asynchronously. Combine with :meth:`reserve` so that the first step
            pays no allocation.

    Example::

        pool = co.HostPool(max_bytes=8 << 30)          # at most 8 GiB of pinned memory
        pool.reserve(2 << 30)                          # taken now, not in the first step
        with co.offload(pool=pool):
            loss = model(x).sum()
        loss.backward()
        print(pool.stats()["peak_bytes_in_use"])
    """

    def __init__(
        self,
        max_bytes: int | None = None,
        pinned: bool | None = None,
        segment_bytes: int | None = None,
        backend: str | None = None,
    ):
        check_native_int("max_bytes", max_bytes, minimum=1, allow_none=True)
        check_optional_bool("pinned", pinned)
        check_native_int("segment_bytes", segment_bytes, minimum=1, allow_none=True)
        if backend is not None:
            check_choice("backend", backend, BACKENDS)
            if pinned is not None and pinned != (backend != "pageable"):
                raise ValueError(
                    f"pinned={pinned} contradicts backend={backend!r}; pass one of them "
                    "(backend='pinned' or 'registered' is pinned memory, 'pageable' is not)"
                )
        else:
            if pinned is None:
                pinned = pinned_available()
            backend = "pinned" if pinned else "pageable"
        self._impl = _C.HostPool(
            backend=backend,
            max_bytes=max_bytes or 0,
            segment_bytes=segment_bytes if segment_bytes is not None else _C.DEFAULT_SEGMENT_BYTES,
        )

    @property
    def backend(self) -> str:
        """``"pinned"``, ``"registered"`` or ``"pageable"``."""
        return self._impl.backend

    @property
    def pinned(self) -> bool:
        """True when the memory is page-locked (``"pinned"`` or ``"registered"``)."""
        return self._impl.backend in ("pinned", "registered")

    @property
    def max_bytes(self) -> int | None:
        """The cap in bytes, or None. Settable; lowering it below what is reserved frees nothing
        by itself (call :meth:`empty_cache`) but stops further growth."""
        return self._impl.stats()["max_bytes"]

    @max_bytes.setter
    def max_bytes(self, value: int | None):
        self._impl.set_max_bytes(check_native_int("max_bytes", value, minimum=1, allow_none=True) or 0)

    def set_max_bytes(self, value: int | None) -> None:
        """Same as assigning :attr:`max_bytes`."""
        self.max_bytes = value

    def stats(self) -> dict:
        """Counters of the pool.

        ``bytes_in_use`` (blocks held by live offloaded tensors), ``bytes_requested`` (what those
        asked for, before alignment), ``bytes_pending`` (freed, waiting for a copy to finish),
        ``bytes_reserved`` (taken from the backend), ``bytes_retired`` (free segments taken off the pool
        to make room at its cap, given back to the backend at the end of backward or by
        :meth:`empty_cache`, never in forward), ``peak_bytes_in_use``, ``peak_bytes_reserved``,
        ``max_bytes``, ``num_segments``, ``num_blocks_in_use``, ``num_allocs``, ``num_frees``,
        ``num_backend_allocs``, ``num_backend_frees``, ``num_cap_hits``, ``backend``.
        """
        return self._impl.stats()

    def reset_peak(self) -> None:
        """Sets the peaks to the current values."""
        self._impl.reset_peak()

    def empty_cache(self) -> int:
        """Returns every segment with no live block to the backend, after waiting for the copies
        that freed blocks still wait on. Returns the bytes released."""
        self._impl.synchronize()
        return self._impl.empty_cache()

    def reserve(self, nbytes: int) -> int:
        """Takes ``nbytes`` (page-rounded) from the backend now, as one segment within the cap,
        so the first step pays no backend allocation. Returns the size of that segment (to make
        room under the cap, wholly free segments may be given back first); raises
        :class:`PoolFullError` when the cap (or the backend) refuses.

        Example::

            pool = co.HostPool()
            pool.reserve(4 << 30)      # 4 GiB of pinned memory before training starts
        """
        check_native_int("nbytes", nbytes, minimum=1)
        got = self._impl.reserve(nbytes)
        if got == 0:
            s = self.stats()
            raise PoolFullError(
                f"ckpt_offload: could not reserve {nbytes} bytes: {s['bytes_reserved']} reserved, cap "
                f"{s['max_bytes']}; raise the cap (pool.max_bytes = ...) or reserve less"
            )
        return got

    def synchronize(self) -> None:
        """Waits for the copies that freed blocks still wait on, making those blocks reusable."""
        self._impl.synchronize()

    def __repr__(self) -> str:
        s = self.stats()
        cap = "none" if s["max_bytes"] is None else f"{s['max_bytes']:,}"
        return (
            f"HostPool(backend={s['backend']!r}, in_use={s['bytes_in_use']:,}, "
            f"reserved={s['bytes_reserved']:,}, max_bytes={cap})"
        )


_default_pool: HostPool | None = None
_default_lock = threading.Lock()


def default_pool() -> HostPool:
    """The process-wide pool that :func:`ckpt_offload.offload` uses unless given ``pool=``.

    Pinned when a GPU is usable, pageable otherwise; no cap. Example::

        co.default_pool().stats()["bytes_in_use"]
    """
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = HostPool()
        return _default_pool
