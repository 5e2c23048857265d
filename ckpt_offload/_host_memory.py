"""How much host memory this process may still take: /proc/meminfo's ``MemAvailable`` and, inside
a container, what its memory cgroup leaves (Note [Container memory]).

Note [Container memory]
``MemAvailable`` is the host's figure. Inside a container (Docker, Kubernetes, Slurm with cgroups)
the kernel kills the container's processes once their memory cgroup passes its limit, whatever
the host still has free, so a budget read from ``MemAvailable`` alone can outgrow the container
and lose the run. The memory a process may still take is therefore the smaller of
``MemAvailable`` and the headroom of every memory cgroup from its own up to the root of the
cgroup mount it sees:

    headroom = limit - usage + reclaimable page cache

- limit: cgroup v2 ``memory.max`` (and ``memory.high``, past which the kernel throttles and
  reclaims hard); v1 ``memory.limit_in_bytes``, and the leaf's ``hierarchical_memory_limit``
  for ancestors above the mount. ``max`` (v2) or a v1 value near 2**63 is no limit.
- usage: v2 ``memory.current``, v1 ``memory.usage_in_bytes``.
- reclaimable: ``inactive_file`` (v2) / ``total_inactive_file`` (v1) of ``memory.stat``: page
  cache counts against the limit, but the kernel drops it before it kills anyone; without
  excluding it a container that has read its data set from disk would see almost no room.
  This is what kubelet leaves out of a container's working set. Active page cache is not
  counted (it is reclaimed too, but later and not always): the figure errs low.

The process's cgroup comes from /proc/self/cgroup (``0::/path`` for v2, the line naming
``memory`` for v1), the directory from /proc/self/mountinfo (the cgroup2 mount, or the cgroup
mount with the ``memory`` option, whose root may be the process's own cgroup: a container
without a cgroup namespace). A file missing at a level skips that level; a level with a limit
but no usage file counts its limit alone.

The figure is read once, when a pool is sized (``co.HostPool(max_bytes="auto")``): the pool's
pages (pinned ones are never reclaimed) then stay under the pool's cap, and at the cap the pool
keeps tensors on the device or spills them to disk -- it never grows past the budget.

The root of /proc and /sys is ``_ROOT``, which tests point at a fake tree.
"""

from __future__ import annotations

import os

#: Where /proc and /sys are read from: "/" except in tests, which point it at a fake tree.
_ROOT = "/"

# A v1 limit at or above this is "no limit": the kernel shows an unlimited cgroup as
# PAGE_COUNTER_MAX pages (9223372036854771712 bytes with 4 KiB pages).
_V1_UNLIMITED = 1 << 60


def _path(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _read(root: str, path: str) -> str | None:
    try:
        with open(_path(root, path)) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(root: str, path: str) -> int | None:
    """An integer file; ``"max"`` (no limit) reads as -1; None when missing or unreadable."""
    text = _read(root, path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return -1
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(root: str, path: str, *names: str) -> int | None:
    """The first of ``names`` found in a ``memory.stat`` file (``key value`` lines)."""
    text = _read(root, path)
    if text is None:
        return None
    fields = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            fields[parts[0]] = parts[1]
    for name in names:
        if name in fields:
            try:
                return int(fields[name])
            except ValueError:
                return None
    return None


def mem_available(root: str | None = None) -> int:
    """``MemAvailable`` of /proc/meminfo in bytes, or free physical pages where there is none."""
    text = _read(_ROOT if root is None else root, "/proc/meminfo")
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                break
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040).
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _cgroup_dirs(root: str) -> list[tuple[int, str, str]]:
    """``(version, directory, mount point)`` of this process's memory cgroup(s): the v2 one when
    a cgroup2 file system is mounted, the v1 one when a v1 hierarchy has the memory controller.
    The directory is as the process sees it (without ``root``)."""
    cgroup, mounts = _read(root, "/proc/self/cgroup"), _read(root, "/proc/self/mountinfo")
    if cgroup is None or mounts is None:
        return []
    paths = {}  # version -> the cgroup's path in its hierarchy
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
        elif "memory" in parts[1].split(","):
            paths[1] = parts[2]
    found = []
    for line in mounts.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if not sep or len(fields) < 5 or len(rfields) < 3:
            continue
        fstype, options = rfields[0], rfields[2].split(",")
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and "memory" in options else 0
        if version not in paths or any(v == version for v, _, _ in found):
            continue
        mount_root, mount_point, path = _unescape(fields[3]), _unescape(fields[4]), paths[version]
        # The mount shows the hierarchy from mount_root down: a container without a cgroup
        # namespace mounts its own cgroup there, and /proc/self/cgroup names it in full.
        if mount_root == "/":
            rel = path
        elif path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
            rel = path[len(mount_root.rstrip("/")) :]
        else:
            rel = ""  # outside the mount's view ("/../x"): the nearest cgroup this process sees
        if ".." in rel.split("/"):
            rel = ""
        directory = mount_point.rstrip("/") + "/" + rel.strip("/") if rel.strip("/") else mount_point
        if not os.path.isdir(_path(root, directory)):
            directory = mount_point
        found.append((version, directory, mount_point))
    return found


_FILES = {  # version -> (limit files, usage file, reclaimable fields of memory.stat)
    2: (("memory.max", "memory.high"), "memory.current", ("inactive_file",)),
    1: (("memory.limit_in_bytes",), "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")),
}


def _bound(version: int, directory: str, file: str, limit: int, usage: int | None, reclaimable: int | None) -> dict:
    usage = usage if usage is not None else 0  # unknown usage: the limit alone bounds
    reclaimable = min(reclaimable or 0, usage)
    return {
        "version": version,
        "path": directory.rstrip("/") + "/" + file,
        "limit": limit,
        "usage": usage,
        "reclaimable": reclaimable,
        "headroom": max(0, min(limit, limit - usage + reclaimable)),
    }


def cgroup_headroom(root: str | None = None) -> dict | None:
    """The tightest memory cgroup over this process (Note [Container memory]):
    ``{"version", "path" (the limit's file), "limit", "usage", "reclaimable", "headroom"}``
    (bytes), or None where no cgroup limits the process's memory."""
    root = _ROOT if root is None else root
    tightest = None
    for version, directory, mount_point in _cgroup_dirs(root):
        limit_files, usage_file, reclaim_fields = _FILES[version]
        level = directory
        while True:
            usage = _read_int(root, f"{level}/{usage_file}")
            reclaimable = _stat_field(root, f"{level}/memory.stat", *reclaim_fields)
            for file in limit_files:
                limit = _read_int(root, f"{level}/{file}")
                if limit is None or limit < 0 or (version == 1 and limit >= _V1_UNLIMITED):
                    continue
                b = _bound(version, level, file, limit, usage, reclaimable)
                if tightest is None or b["headroom"] < tightest["headroom"]:
                    tightest = b
            if version == 1 and level == directory:
                # Ancestors above the mount (a container's view): the kernel's own minimum.
                hier = _stat_field(root, f"{level}/memory.stat", "hierarchical_memory_limit")
                if hier is not None and hier < _V1_UNLIMITED:
                    b = _bound(1, level, "memory.stat:hierarchical_memory_limit", hier, usage, reclaimable)
                    if tightest is None or b["headroom"] < tightest["headroom"]:
                        tightest = b
            if level.rstrip("/") == mount_point.rstrip("/") or "/" not in level.strip("/"):
                break
            level = level.rstrip("/").rsplit("/", 1)[0] or "/"
    return tightest


def available(root: str | None = None) -> dict:
    """The host memory this process may still take: ``{"available_bytes", "bounded_by",
    "mem_available", "cgroup"}`` -- the smaller of ``MemAvailable`` and the tightest cgroup's
    headroom (:func:`cgroup_headroom`, None outside a limited cgroup); ``bounded_by`` names
    which: ``"MemAvailable"`` or ``"cgroup v2 /sys/fs/cgroup/.../memory.max"``.

    Example::

        from ckpt_offload import _host_memory
        print(_host_memory.available()["bounded_by"])   # "MemAvailable" outside a container
    """
    mem = mem_available(root)
    cg = cgroup_headroom(root)
    if cg is not None and cg["headroom"] < mem:
        return {"available_bytes": cg["headroom"], "bounded_by": describe(cg), "mem_available": mem, "cgroup": cg}
    return {"available_bytes": mem, "bounded_by": "MemAvailable", "mem_available": mem, "cgroup": cg}


def describe(cg: dict) -> str:
    """``"cgroup v2 /sys/fs/cgroup/x/memory.max"``: a cgroup bound's name for messages."""
    return f"cgroup v{cg['version']} {cg['path']}"
