"""The host-memory pool that offloaded activations live in."""

from __future__ import annotations

import os
import threading

from ckpt_offload import _host_memory, _numa
from ckpt_offload._args import check_bytes, check_choice, check_native_int, check_optional_bool, suggest_keywords
from ckpt_offload._runtime import _C, gpu_usable
from ckpt_offload._warn import warn_at_user_line

__all__ = ["HostPool", "PoolFullError", "SpillError", "default_pool", "pinned_available", "BACKENDS"]

#: Host-memory backends: ``"pinned"`` (``cudaHostAlloc``), ``"registered"`` (page-aligned,
#: pre-faulted memory pinned with ``cudaHostRegister``) and ``"pageable"`` (plain memory).
BACKENDS = ("pinned", "registered", "pageable")

#: Raised when the pool is at its cap and the context was made with ``on_full="raise"``.
#: A subclass of ``MemoryError``.
PoolFullError = _C.PoolFullError

#: Raised in backward when spilled activations cannot be read back intact from the pool's
#: ``spill_dir`` (a checksum mismatch or an I/O error); the message names the file. A subclass of
#: ``RuntimeError``.
SpillError = _C.SpillError

#: Staging memory (same backend as the pool, outside its cap) that spill writes in flight may hold
#: before the next offload waits for one to finish.
DEFAULT_SPILL_STAGING_BYTES = 64 << 20

#: The smallest cap a pool takes (``max_bytes``): one page, the smallest segment a block can live
#: in (the core's kSegmentAlignment). A smaller cap could never hold a block.
MIN_MAX_BYTES = 4096
#: The smallest ``spill_max_bytes``: one file page (the core's kFileAlignment), the least disk
#: space a spilled block takes; caps are rounded down to whole pages.
MIN_SPILL_MAX_BYTES = 4096


def _check_cap(name: str, value, minimum: int, unlimited: str):
    if not (isinstance(value, int) and not isinstance(value, bool) and value < minimum):  # -1: the minimum below
        value = check_bytes(name, value, minimum=1, allow_none=True)  # sizes may be strings ("8GiB")
    if value is not None and value < minimum:
        raise ValueError(
            f"{name}={value} is below the minimum of {minimum} bytes, so nothing could ever be stored under it; "
            f"pass {name} >= {minimum}, or None for {unlimited}"
        )
    return value


#: With ``max_bytes="auto"`` and no ``node_max_bytes``: the fraction of the memory available to
#: the process when the pool is made (``MemAvailable``, or less inside a container's memory
#: cgroup: Note [Container memory] in _host_memory.py) that the local ranks' pools share.
DEFAULT_HOST_FRACTION = 0.5


def _local_world_size(value) -> int:
    if value is not None:
        return check_native_int("local_world_size", value, minimum=1)
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        return 1
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"the environment variable LOCAL_WORLD_SIZE={env!r} is not a positive integer (torchrun sets it to "
            "the number of ranks on this host); fix it, or pass local_world_size= to co.HostPool"
        )
    return n


def _node_share(node_max_bytes, host_fraction, local_world_size) -> dict:
    """Note [Host shared by local ranks]: this rank's cap under ``max_bytes="auto"``, within
    what the host and the container leave (Note [Container memory] in _host_memory.py)."""
    ranks = _local_world_size(local_world_size)
    mem = _host_memory.available()
    cg = mem["cgroup"]
    if node_max_bytes is not None:
        node, bounded_by = node_max_bytes, "node_max_bytes"
        source = f"node_max_bytes={node_max_bytes}"
        if cg is not None and node_max_bytes > cg["headroom"]:
            # Past the cgroup's limit the kernel kills the process: the budget stops there.
            node, bounded_by = cg["headroom"], _host_memory.describe(cg)
            source = f"node_max_bytes={node_max_bytes} lowered to what {bounded_by} leaves"
            warn_at_user_line(
                f"co.HostPool(max_bytes='auto'): node_max_bytes={node_max_bytes} is more than this container's "
                f"memory cgroup leaves: {bounded_by} limit {cg['limit']} bytes, {cg['usage']} in use of which "
                f"{cg['reclaimable']} reclaimable page cache, so {cg['headroom']} bytes; the node's budget is "
                f"{cg['headroom']} bytes instead (a pool past the limit would get the process killed). Lower "
                "node_max_bytes, or raise the container's memory limit.",
                key=None,
            )
    else:
        node, bounded_by = int(mem["available_bytes"] * host_fraction), mem["bounded_by"]
        source = f"host_fraction={host_fraction} of the {mem['available_bytes']} bytes available ({bounded_by})"
    # Whole pages (a pool's segments are), rounded down: the local ranks' caps sum to at most
    # the node's budget.
    share = node // ranks // MIN_MAX_BYTES * MIN_MAX_BYTES
    if share < MIN_MAX_BYTES:
        raise ValueError(
            f"max_bytes='auto': the node's {node} bytes ({source}) divided between LOCAL_WORLD_SIZE={ranks} local "
            f"ranks leave {share} bytes per rank, under the minimum of {MIN_MAX_BYTES}; raise node_max_bytes "
            "(or host_fraction)" + (" or the container's memory limit" if bounded_by.startswith("cgroup") else "")
        )
    return {
        "max_bytes": share,
        "node_max_bytes": node,
        "local_world_size": ranks,
        "host_fraction": None if node_max_bytes is not None else host_fraction,
        "bounded_by": bounded_by,
        "available_bytes": mem["available_bytes"],
        "cgroup": cg,
    }


def pinned_available() -> bool:
    """True when this build can pin host memory: CUDA compiled in and a usable GPU present."""
    return gpu_usable()


class HostPool:
    """A pool of host memory for offloaded activations.

    Memory is taken from the backend in large segments (``segment_bytes``; a larger request
    gets a segment of its own size) and handed out as best-fit blocks aligned to 512 bytes,
    split and coalesced, never rounded up to a power of two. A block freed while a copy may
    still touch it is reused only once that copy has finished.

    Args:
        max_bytes: cap on the host memory the pool reserves, in bytes (at least
            :data:`MIN_MAX_BYTES`, one page); ``None`` for no cap.
            At the cap, :func:`ckpt_offload.offload` keeps tensors on the device (``on_full="keep"``)
            or raises :class:`PoolFullError` (``on_full="raise"``). ``"auto"``: this rank's share
            of the node, ``node_max_bytes`` (or ``host_fraction`` of the host's available memory)
            divided between the ``LOCAL_WORLD_SIZE`` local ranks, rounded down to a page; the
            first local rank to reach its share says so once (with ``spill_dir`` the excess goes
            to disk). Inside a container the budget never exceeds what its memory cgroup leaves
            (limit less usage, page cache counted as free): at its cap the pool keeps or spills,
            it never grows the process past the limit. See :attr:`share`.
        node_max_bytes: with ``max_bytes="auto"``, the host memory all local ranks' pools may
            reserve together. Spill staging memory (``spill_staging_bytes`` per rank) is outside it.
            More than the container's memory cgroup leaves is lowered to that, with a warning
            naming both.
        host_fraction: with ``max_bytes="auto"`` and no ``node_max_bytes``, the fraction of the
            memory available when the pool is made that the local ranks share: ``MemAvailable``,
            or the memory cgroup's headroom where that is smaller; default 0.5
            (``ckpt_offload.pool.DEFAULT_HOST_FRACTION``).
        local_world_size: with ``max_bytes="auto"``, the number of ranks sharing this host;
            default: the ``LOCAL_WORLD_SIZE`` environment variable (torchrun sets it), else 1.
        pinned: ``True`` for page-locked memory (``cudaHostAlloc``; needs a GPU), ``False`` for
            pageable memory, ``None`` to pin whenever a GPU is usable. A segment the driver
            refuses to pin (``vm.max_map_count`` or ``RLIMIT_MEMLOCK`` exhausted) is taken as
            pageable memory instead, with a warning naming the limit (:meth:`pinned_fallback`).
        segment_bytes: size of the segments small requests are carved from (default 64 MiB).
        backend: overrides ``pinned`` with a backend by name, one of :data:`BACKENDS`:
            ``"registered"`` pins large page-aligned host allocations with ``cudaHostRegister``
            (pre-faulted first) instead of ``cudaHostAlloc``; both give page-locked memory that
            copies run from asynchronously. Combine with :meth:`reserve` so that the first step
            pays no allocation.
        spill_dir: a directory on a local disk (NVMe). With it, what the pool's cap refuses is
            not kept on the device: its bytes go (through a small staging area) to preallocated,
            nameless files there, written and read back by I/O threads with a CRC32C per chunk;
            backward's prefetch starts the reads early. Needs ``max_bytes``. See
            docs/disk_tier.md.
        spill_max_bytes: cap on the disk space the spill files take (at least
            :data:`MIN_SPILL_MAX_BYTES`, rounded down to whole 4096-byte pages); ``None``: what the disk
            has. At the cap (or a full disk) the tensor is kept on the device (kept reason
            ``"disk_full"``) or :class:`PoolFullError` is raised under ``on_full="raise"``.
        spill_file_bytes: size of each preallocated spill file (default 256 MiB).
        spill_io_threads: threads doing the disk reads and writes (default 2).
        spill_staging_bytes: host memory (outside ``max_bytes``) the writes in flight may hold
            before an offload waits for the disk (default 64 MiB).
        numa_node: the NUMA node the pool's segments are placed on: ``"auto"`` (default) the
            current GPU's node (from sysfs) on a host with several nodes, else none; an int, that
            node; None, none (pages go where they are first touched). A bound segment is mapped,
            given the node's policy, faulted in and (pinned backends) registered with
            ``cudaHostRegister``; ``stats()["bytes_by_node"]`` says where its pages are.
            See :attr:`numa`.

    Every byte count here (``max_bytes``, ``segment_bytes``, the ``spill_*_bytes``, and
    :meth:`set_max_bytes` / :meth:`reserve`) is an int or a size string such as ``"8GiB"`` or
    ``"512MiB"`` (KiB/MiB/GiB: powers of 1024; KB/MB/GB: of 1000).

    Example::

        pool = co.HostPool(max_bytes="8GiB")           # at most 8 GiB of pinned memory
        pool.reserve(2 << 30)                          # taken now, not in the first step
        with co.offload(pool=pool):
            loss = model(x).sum()
        loss.backward()
        print(pool.stats()["peak_bytes_in_use"])

        # segments on NUMA node 0 (default "auto": the GPU's node)
        pool = co.HostPool(numa_node=0)

        # 8 ranks on a node (torchrun sets LOCAL_WORLD_SIZE): 256 GiB of host memory between them,
        # 32 GiB each, and what does not fit goes to the local disk
        pool = co.HostPool(max_bytes="auto", node_max_bytes="256GiB", spill_dir="/local/nvme")

        # 4 GiB of pinned memory, then up to 100 GiB on a local NVMe disk
        pool = co.HostPool(max_bytes=4 << 30, spill_dir="/local/nvme", spill_max_bytes=100 << 30)
        print(pool.stats()["disk"]["bytes_written"])
    """

    #: The keys of :meth:`stats`, in order, from the native stats table (Note [Stats tables] in
    #: csrc/core/stats_table.h).
    STATS_KEYS: tuple = _C.POOL_STATS_KEYS
    #: The keys of ``stats()["disk"]`` (with ``spill_dir``), in order: the disk tier's and the spill's.
    DISK_STATS_KEYS: tuple = _C.DISK_STATS_KEYS

    @suggest_keywords("co.HostPool")
    def __init__(
        self,
        max_bytes: int | None = None,
        pinned: bool | None = None,
        segment_bytes: int | None = None,
        backend: str | None = None,
        spill_dir: str | os.PathLike | None = None,
        spill_max_bytes: int | None = None,
        spill_file_bytes: int | None = None,
        spill_io_threads: int | None = None,
        spill_staging_bytes: int | None = None,
        node_max_bytes: int | str | None = None,
        host_fraction: float | None = None,
        local_world_size: int | None = None,
        numa_node: int | str | None = "auto",
    ):
        # Note [Host shared by local ranks]
        self._share = None
        if isinstance(max_bytes, str) and max_bytes == "auto":
            node_max_bytes = check_bytes("node_max_bytes", node_max_bytes, minimum=1, allow_none=True)
            if host_fraction is not None:
                if node_max_bytes is not None:
                    raise ValueError(
                        "pass node_max_bytes or host_fraction, not both: node_max_bytes is the node's "
                        "budget in bytes, host_fraction a fraction of the host's available memory"
                    )
                if (
                    isinstance(host_fraction, bool)
                    or not isinstance(host_fraction, (int, float))
                    or not 0 < host_fraction <= 1
                ):
                    raise ValueError(f"host_fraction must be a number in (0, 1], got {host_fraction!r}")
            self._share = _node_share(
                node_max_bytes,
                DEFAULT_HOST_FRACTION if host_fraction is None else float(host_fraction),
                local_world_size,
            )
            max_bytes = self._share["max_bytes"]
        else:
            given = [
                n
                for n, v in (
                    ("node_max_bytes", node_max_bytes),
                    ("host_fraction", host_fraction),
                    ("local_world_size", local_world_size),
                )
                if v is not None
            ]
            if given:
                raise ValueError(
                    f"{given[0]} needs max_bytes='auto' (the pool's share of the node); pass "
                    f"co.HostPool(max_bytes='auto', {given[0]}=...)"
                )
        self._warned_fallback = False
        # Sizes may be strings ("8GiB"); from here on they are ints.
        max_bytes = _check_cap("max_bytes", max_bytes, MIN_MAX_BYTES, "no cap")
        spill_max_bytes = _check_cap("spill_max_bytes", spill_max_bytes, MIN_SPILL_MAX_BYTES, "what the disk has")
        spill_file_bytes = check_bytes("spill_file_bytes", spill_file_bytes, minimum=1, allow_none=True)
        check_native_int("spill_io_threads", spill_io_threads, minimum=1, allow_none=True)
        spill_staging_bytes = check_bytes("spill_staging_bytes", spill_staging_bytes, minimum=1, allow_none=True)
        if spill_dir is None:
            given = [
                n
                for n, v in (
                    ("spill_max_bytes", spill_max_bytes),
                    ("spill_file_bytes", spill_file_bytes),
                    ("spill_io_threads", spill_io_threads),
                    ("spill_staging_bytes", spill_staging_bytes),
                )
                if v is not None
            ]
            if given:
                raise ValueError(f"{given[0]} needs spill_dir: pass spill_dir='/path/on/local/disk' to spill to disk")
        else:
            if not isinstance(spill_dir, (str, os.PathLike)):
                raise TypeError(
                    f"spill_dir must be a path (str or os.PathLike) or None, got {type(spill_dir).__name__}"
                )
            spill_dir = os.fspath(spill_dir)
            if not max_bytes:
                raise ValueError(
                    "spill_dir needs max_bytes: the pool spills to disk only what exceeds its cap; "
                    "pass e.g. co.HostPool(max_bytes=8 << 30, spill_dir=...)"
                )
            if not os.path.isdir(spill_dir):
                raise ValueError(
                    f"spill_dir={spill_dir!r} is not an existing directory; create it (on a local disk) first"
                )
        check_optional_bool("pinned", pinned)
        segment_bytes = check_bytes("segment_bytes", segment_bytes, minimum=1, allow_none=True)
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
        # Note [NUMA-local segments] (csrc/core/numa.h); the core refuses a node this process
        # may not use, naming the allowed ones.
        node, self._numa_reason = _numa.resolve(numa_node)
        self._numa_node = -1 if node is None else node
        self._impl = _C.HostPool(
            backend=backend,
            max_bytes=max_bytes or 0,
            segment_bytes=segment_bytes if segment_bytes is not None else _C.DEFAULT_SEGMENT_BYTES,
            numa_node=self._numa_node,
        )
        self._fallback_possible = backend != "pageable"
        self._warned_share = False
        self._tier = None
        self._staging = None
        if spill_dir is not None:
            self._tier = _C.FileTier(
                dir=spill_dir,
                max_bytes=spill_max_bytes or 0,
                io_threads=spill_io_threads or 2,
                **({"file_bytes": spill_file_bytes} if spill_file_bytes else {}),
            )
            # Staging blocks carry offloads the cap refused to disk, and read-backs the pool has
            # no room for: the same backend (pinned copies stay asynchronous), no cap of its own
            # (the throttle bounds it), small segments.
            self._staging = _C.HostPool(backend=backend, max_bytes=0, segment_bytes=16 << 20, numa_node=self._numa_node)
            # The pool spills while this object lives (contexts hold it); blocks already on disk
            # keep what they need to come back.
            self._spill = _C.attach_spill(
                self._impl, self._tier, self._staging, spill_staging_bytes or DEFAULT_SPILL_STAGING_BYTES
            )

    @property
    def share(self) -> dict | None:
        """With ``max_bytes="auto"``: how the cap was sized, ``{"max_bytes", "node_max_bytes",
        "local_world_size", "host_fraction", "bounded_by", "available_bytes", "cgroup"}``;
        None otherwise. ``host_fraction`` is None when ``node_max_bytes`` was given;
        ``bounded_by`` names what set the node's budget: ``"node_max_bytes"``,
        ``"MemAvailable"`` or the container's limit (``"cgroup v2 /sys/fs/cgroup/.../memory.max"``);
        ``available_bytes`` is the smaller of ``MemAvailable`` and the cgroup's headroom when
        the pool was made; ``cgroup`` the tightest memory cgroup (``{"version", "path", "limit",
        "usage", "reclaimable", "headroom"}``) or None.

        Example::

            pool = co.HostPool(max_bytes="auto", pinned=False)
            print(pool.share["bounded_by"])    # "MemAvailable" outside a container
        """
        return dict(self._share) if self._share is not None else None

    @property
    def numa(self) -> dict:
        """Where the pool places its segments: ``{"numa_node", "reason"}`` -- the node (None:
        none) and why, e.g. ``"GPU 0 (0000:17:00.0) is on node 0"``, ``"no usable GPU"``.
        ``stats()["bytes_by_node"]`` says where the bytes are.

        Example::

            print(co.HostPool(pinned=False).numa)   # {'numa_node': None, 'reason': 'no usable GPU'} on CPU
        """
        return {"numa_node": None if self._numa_node < 0 else self._numa_node, "reason": self._numa_reason}

    def pinned_fallback(self) -> dict | None:
        """For a pinned pool: ``{"segments", "bytes", "reason"}`` -- segments the driver refused
        to pin and that were taken as pageable memory instead (``bytes``: those the pool holds
        now), and the first refusal's diagnosis naming the host limit (``vm.max_map_count``,
        ``RLIMIT_MEMLOCK``); None for a pageable pool."""
        return self._impl.pinned_fallback()

    def _check_host_limits(self) -> None:
        """Warns once per pool when pinned memory was refused, and, for a ``max_bytes="auto"``
        pool, once per node when the first local rank reaches its share (Note [Host shared by
        local ranks]). Called at context exits and after :meth:`reserve`."""
        if self._fallback_possible and not self._warned_fallback:
            fb = self._impl.pinned_fallback()
            if fb and fb["segments"]:
                self._warned_fallback = True
                warn_at_user_line(
                    f"co.HostPool: {fb['reason']}. The pool took that segment (and takes any later refused one) "
                    "as pageable memory instead: correct, but its copies are slower and not asynchronous. "
                    "pool.pinned_fallback() counts them. (Warned once per pool.)",
                    key=None,
                )
        if self._share is not None and not self._warned_share:
            if not self._impl.stats()["num_cap_hits"]:
                return
            self._warned_share = True
            # One rank on the host: nobody else to leave the message to.
            if self._share["local_world_size"] > 1 and not _first_on_node("share-full"):
                return
            sh = self._share
            where = (
                f"what exceeds it goes to spill_dir={self.spill_dir!r} (on disk) instead"
                if self._tier is not None
                else "what exceeds it stays on the device (kept_by_reason['pool_full']); pass spill_dir= to "
                "send it to a local disk instead"
            )
            budget = (
                f"node_max_bytes={sh['node_max_bytes']}"
                if sh["host_fraction"] is None
                else f"host_fraction={sh['host_fraction']} of the host's available memory = {sh['node_max_bytes']} "
                "bytes"
            )
            warn_at_user_line(
                f"co.HostPool(max_bytes='auto'): this rank's pool reached its share of the node's host memory "
                f"({budget}, divided between LOCAL_WORLD_SIZE={sh['local_world_size']} local ranks: "
                f"{sh['max_bytes']} bytes per rank); {where}. Raise node_max_bytes (or host_fraction) to give "
                "the ranks more. (Said once per node, by the first rank to reach its share.)",
                key=None,
            )

    @property
    def spill_dir(self) -> str | None:
        """The directory spilled activations go to, or None."""
        return self._tier.stats()["dir"] if self._tier is not None else None

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
        self._impl.set_max_bytes(_check_cap("max_bytes", value, MIN_MAX_BYTES, "no cap") or 0)

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
        ``num_backend_allocs``, ``num_backend_frees``, ``num_cap_hits``, ``backend``,
        ``numa_node`` (the node segments are placed on, None when unbound) and ``bytes_by_node``
        (``{node: bytes}`` of the reserved segments' pages, measured when each was taken; None
        when unbound).

        With ``spill_dir``, ``"disk"`` holds the disk tier's: ``bytes_in_use`` / ``bytes_reserved``
        (file space held by spilled blocks / preallocated), ``blocks_spilled``, ``bytes_written``,
        ``bytes_read``, ``write_bandwidth`` / ``read_bandwidth`` (bytes/s while the disk was busy,
        None before any I/O), ``read_stalls`` / ``read_stall_seconds`` (backward waiting for the disk),
        ``write_stalls`` / ``write_stall_seconds`` (offloads waiting for staging memory),
        ``reads_prefetch`` (reads started by prefetch), ``blocks_refused`` (no room on disk),
        ``checksum_errors``, ``staging_bytes_in_use``, ``direct_io``, and more.
        """
        s = self._impl.stats()
        if self._tier is not None:
            s["disk"] = _C.spill_stats(self._impl)
        return s

    def reset_peak(self) -> None:
        """Sets the peaks to the current values."""
        self._impl.reset_peak()

    def empty_cache(self) -> int:
        """Returns every segment with no live block to the backend, after waiting for the copies
        that freed blocks still wait on. Returns the bytes released."""
        self._impl.synchronize()
        released = self._impl.empty_cache()
        if self._tier is not None:
            # Spill files holding no block are closed, which gives their disk space back.
            self._tier.synchronize()
            self._staging.synchronize()
            self._staging.empty_cache()
            self._tier.empty_cache()
        return released

    def reserve(self, nbytes: int) -> int:
        """Takes ``nbytes`` (page-rounded) from the backend now, as one segment within the cap,
        so the first step pays no backend allocation. Returns the size of that segment (to make
        room under the cap, wholly free segments may be given back first); raises
        :class:`PoolFullError` when the cap (or the backend) refuses.

        Example::

            pool = co.HostPool()
            pool.reserve(4 << 30)      # 4 GiB of pinned memory before training starts
        """
        nbytes = check_bytes("nbytes", nbytes, minimum=1)
        got = self._impl.reserve(nbytes)
        self._check_host_limits()
        if got == 0:
            s = self.stats()
            raise PoolFullError(
                f"ckpt_offload: could not reserve {nbytes} bytes: {s['bytes_reserved']} reserved, cap "
                f"{s['max_bytes']}; raise the cap (pool.max_bytes = ...) or reserve less"
            )
        return got

    def synchronize(self) -> None:
        """Waits for the copies that freed blocks still wait on, making those blocks reusable;
        with ``spill_dir``, also for the disk reads and writes queued so far."""
        self._impl.synchronize()
        if self._tier is not None:
            self._tier.synchronize()
            self._staging.synchronize()

    def __repr__(self) -> str:
        s = self.stats()
        cap = "none" if s["max_bytes"] is None else f"{s['max_bytes']:,}"
        disk = ""
        if "disk" in s:
            disk = f", spill_dir={s['disk']['dir']!r}, disk_in_use={s['disk']['bytes_in_use']:,}"
        return (
            f"HostPool(backend={s['backend']!r}, in_use={s['bytes_in_use']:,}, "
            f"reserved={s['bytes_reserved']:,}, max_bytes={cap}{disk})"
        )


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot: with the pid, a name no other process
    has), or None when it does not exist (or /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22, after the name in parentheses
    except (OSError, IndexError):
        return None


_markers: list = []  # (path, our content) of the markers this process made: removed at its exit


def _remove_markers() -> None:
    for path, ours in _markers:
        try:
            with open(path) as f:
                if f.read() != ours:
                    continue  # a later launch's now
            os.unlink(path)
        except OSError:
            pass


def _first_on_node(what: str) -> bool:
    """True in exactly one of the local ranks of this launch that call it with ``what``: the
    first to claim a marker file in the temporary directory named for the ranks' common parent
    process (torchrun's agent, a spawner), its start time, and MASTER_PORT. The marker holds the
    claiming rank's pid and start time; a marker whose rank has exited is a previous launch's (the
    same parent launching again with the same port, as ``mp.spawn`` run twice with a fixed port
    does, or a launch that was killed) and is claimed anew, under a lock, so that each launch says
    it once. The rank that claimed it removes it when it exits. True where that cannot be decided
    (better said by every rank than by none)."""
    import atexit
    import tempfile

    ppid = os.getppid()
    parent_started, me_started = _started(ppid), _started(os.getpid())
    if parent_started is None or me_started is None:
        return True
    import fcntl  # after /proc answered: Linux

    name = f"ckpt_offload-{what}-{ppid}-{parent_started}-{os.environ.get('MASTER_PORT', '')}"
    path = os.path.join(tempfile.gettempdir(), name)
    ours = f"{os.getpid()} {me_started}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes (or the process dies)
        held = os.read(fd, 64).decode(errors="replace").split()
        if len(held) == 2 and held[0].isdigit() and _started(int(held[0])) == held[1]:
            return False  # claimed by a rank of this launch that is still running
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, ours.encode())
    except OSError:
        return True
    finally:
        os.close(fd)
    if not _markers:
        atexit.register(_remove_markers)
    _markers.append((path, ours))
    return True


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
