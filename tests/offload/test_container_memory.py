"""Inside a container, ``co.HostPool(max_bytes="auto")`` sizes the node's budget from what the
memory cgroup leaves, not from the host's ``MemAvailable`` (Note [Container memory] in
ckpt_offload/_host_memory.py).

Fake /proc and /sys trees (``_host_memory._ROOT`` pointed at them) cover cgroup v2, nested v2
paths, ``max``, ``memory.high``, v1 with its hierarchical limit, the hybrid layout, missing files
and a path outside the mount's view. On a machine where this process may create a memory cgroup
(root, a v1 memory hierarchy, or a v2 one delegated to it), a real one with a 1 GiB limit runs a
pool in a child process: the budget names that cgroup and stays within it, and a pool asked for
more than fits reaches its cap (PoolFullError) instead of getting the process killed. Elsewhere
the real machine's cgroup, if any, bounds the budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import ckpt_offload as co
from ckpt_offload import _host_memory

GiB, MiB = 1 << 30, 1 << 20
V1_UNLIMITED = "9223372036854771712"
HOST_AVAILABLE = 64 * GiB  # the fake host's MemAvailable: far above every fake limit
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw"


def fake_host(
    root: Path, cgroup: str, mountinfo: list[str], files: dict[str, str], mem_available: int = HOST_AVAILABLE
) -> Path:
    """A /proc and /sys tree under ``root``: this process's cgroup lines, its mounts, the host's
    MemAvailable and the cgroup files (``{"/sys/fs/cgroup/x/memory.max": "1073741824"}``)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    (root / "proc/meminfo").write_text(
        f"MemTotal:       {2 * mem_available // 1024} kB\nMemAvailable:   {mem_available // 1024} kB\n"
    )
    for path, text in files.items():
        p = root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
    return root


@pytest.fixture
def host(tmp_path, monkeypatch):
    """Builds a fake host (fake_host's arguments) and points the budget's reads at it."""

    def make(*args, **kwargs):
        monkeypatch.setattr(_host_memory, "_ROOT", str(fake_host(tmp_path, *args, **kwargs)))

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    return make


def stat(**fields) -> str:
    return "\n".join(f"{k} {v}" for k, v in {"anon": 1, **fields}.items())


def test_v2_limit_less_usage_plus_inactive_page_cache_bounds_the_budget(host):
    d = "/sys/fs/cgroup/kubepods/pod1/ctr"
    host(
        "0::/kubepods/pod1/ctr\n",
        [V2_MOUNT],
        {
            f"{d}/memory.max": str(2 * GiB),
            f"{d}/memory.current": str(3 * GiB // 2),
            f"{d}/memory.stat": stat(active_file=200 * MiB, inactive_file=GiB),
        },
    )
    headroom = 2 * GiB - 3 * GiB // 2 + GiB  # inactive page cache counts as free, active does not
    pool = co.HostPool(max_bytes="auto", pinned=False, local_world_size=2)
    share = pool.share
    assert share["bounded_by"] == f"cgroup v2 {d}/memory.max"
    assert share["available_bytes"] == headroom
    assert share["node_max_bytes"] == headroom // 2  # host_fraction 0.5
    assert pool.max_bytes == headroom // 2 // 2 // 4096 * 4096
    assert share["cgroup"] == {
        "version": 2,
        "path": f"{d}/memory.max",
        "limit": 2 * GiB,
        "usage": 3 * GiB // 2,
        "reclaimable": GiB,
        "headroom": headroom,
    }


def test_v2_nested_parent_limit_binds_and_max_is_no_limit(host):
    pod, ctr = "/sys/fs/cgroup/kubepods/pod1", "/sys/fs/cgroup/kubepods/pod1/ctr"
    host(
        "0::/kubepods/pod1/ctr\n",
        [V2_MOUNT],
        {
            f"{ctr}/memory.max": "max",
            f"{ctr}/memory.current": str(100 * MiB),
            f"{ctr}/memory.stat": stat(),
            # /sys/fs/cgroup/kubepods has no files at all: skipped; the root has no memory.max.
            f"{pod}/memory.max": str(GiB),
            f"{pod}/memory.current": str(900 * MiB),
            f"{pod}/memory.stat": stat(inactive_file=60 * MiB),
            "/sys/fs/cgroup/memory.stat": stat(inactive_file=10 * GiB),
        },
    )
    cg = _host_memory.cgroup_headroom()
    assert cg["path"] == f"{pod}/memory.max" and cg["headroom"] == GiB - 900 * MiB + 60 * MiB
    assert _host_memory.available()["bounded_by"] == f"cgroup v2 {pod}/memory.max"


def test_v2_memory_high_below_max_binds(host):
    d = "/sys/fs/cgroup/job"
    host(
        "0::/job\n",
        [V2_MOUNT],
        {
            f"{d}/memory.max": str(4 * GiB),
            f"{d}/memory.high": str(3 * GiB),
            f"{d}/memory.current": str(GiB),
            f"{d}/memory.stat": stat(inactive_file=0),
        },
    )
    cg = _host_memory.cgroup_headroom()
    assert (cg["path"], cg["headroom"]) == (f"{d}/memory.high", 2 * GiB)


def test_v2_all_max_leaves_mem_available(host):
    d = "/sys/fs/cgroup/user.slice"
    host(
        "0::/user.slice\n",
        [V2_MOUNT],
        {f"{d}/memory.max": "max", f"{d}/memory.high": "max", f"{d}/memory.current": str(GiB)},
    )
    assert _host_memory.cgroup_headroom() is None
    pool = co.HostPool(max_bytes="auto", pinned=False)
    assert pool.share["bounded_by"] == "MemAvailable"
    assert pool.share["node_max_bytes"] == HOST_AVAILABLE // 2 and pool.share["cgroup"] is None


def test_mem_available_below_the_cgroup_headroom_binds(host):
    d = "/sys/fs/cgroup/job"
    host(
        "0::/job\n",
        [V2_MOUNT],
        {f"{d}/memory.max": str(32 * GiB), f"{d}/memory.current": str(GiB)},
        mem_available=8 * GiB,
    )
    mem = _host_memory.available()
    assert mem["bounded_by"] == "MemAvailable" and mem["available_bytes"] == 8 * GiB
    assert mem["cgroup"]["headroom"] == 31 * GiB


def test_v1_container_view_with_hierarchical_limit(host):
    # Docker without a cgroup namespace: /proc/self/cgroup names the full path, the mount's root
    # is that cgroup, so its files are at the mount point itself.
    m = "/sys/fs/cgroup/memory"
    host(
        "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n0::/\n",
        [
            f"35 31 0:32 /docker/abc {m} ro,nosuid - cgroup cgroup rw,memory",
            "36 31 0:33 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct",
        ],
        {
            f"{m}/memory.limit_in_bytes": V1_UNLIMITED,
            f"{m}/memory.usage_in_bytes": str(400 * MiB),
            f"{m}/memory.stat": stat(
                inactive_file=5 * MiB, total_inactive_file=100 * MiB, hierarchical_memory_limit=GiB
            ),
        },
    )
    cg = _host_memory.cgroup_headroom()
    assert cg["version"] == 1 and cg["path"] == f"{m}/memory.stat:hierarchical_memory_limit"
    assert cg["headroom"] == GiB - 400 * MiB + 100 * MiB  # total_inactive_file: the hierarchy's


def test_v1_own_limit_in_a_hybrid_layout(host):
    # v1 memory next to a cgroup2 mount without the memory controller (systemd's hybrid layout).
    d = "/sys/fs/cgroup/memory/slurm/uid_0/job_7"
    host(
        "4:memory:/slurm/uid_0/job_7\n0::/\n",
        [
            "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
            "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw",
        ],
        {
            f"{d}/memory.limit_in_bytes": str(2 * GiB),
            f"{d}/memory.usage_in_bytes": str(GiB),
            f"{d}/memory.stat": stat(total_inactive_file=0, hierarchical_memory_limit=2 * GiB),
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
            "/sys/fs/cgroup/unified/cgroup.controllers": "hugetlb",
        },
    )
    cg = _host_memory.cgroup_headroom()
    assert (cg["version"], cg["path"], cg["headroom"]) == (1, f"{d}/memory.limit_in_bytes", GiB)


@pytest.mark.parametrize("missing", ["usage", "stat", "limit", "proc_cgroup", "mountinfo"])
def test_missing_files(host, tmp_path, missing):
    d = "/sys/fs/cgroup/job"
    files = {
        f"{d}/memory.max": str(2 * GiB),
        f"{d}/memory.current": str(GiB),
        f"{d}/memory.stat": stat(inactive_file=GiB // 2),
    }
    files.pop({"usage": f"{d}/memory.current", "stat": f"{d}/memory.stat"}.get(missing, ""), None)
    if missing == "limit":
        files.pop(f"{d}/memory.max")
    host("0::/job\n", [V2_MOUNT], files)
    if missing == "proc_cgroup":
        (tmp_path / "proc/self/cgroup").unlink()
    if missing == "mountinfo":
        (tmp_path / "proc/self/mountinfo").unlink()
    cg = _host_memory.cgroup_headroom()
    if missing in ("limit", "proc_cgroup", "mountinfo"):
        assert cg is None  # nothing known limits the process: MemAvailable alone
        assert _host_memory.available()["available_bytes"] == HOST_AVAILABLE
    elif missing == "usage":
        assert cg["headroom"] == 2 * GiB  # the limit alone still bounds
    else:
        assert cg["headroom"] == GiB  # no page cache known to be reclaimable: none counted


def test_path_outside_the_mounts_view_uses_the_mount(host):
    host("0::/../sibling\n", [V2_MOUNT], {"/sys/fs/cgroup/memory.max": str(GiB), "/sys/fs/cgroup/memory.current": "0"})
    assert _host_memory.cgroup_headroom()["path"] == "/sys/fs/cgroup/memory.max"


def test_node_max_bytes_past_the_cgroup_warns_naming_both_and_is_lowered(host):
    d = "/sys/fs/cgroup/job"
    host(
        "0::/job\n",
        [V2_MOUNT],
        {f"{d}/memory.max": str(2 * GiB), f"{d}/memory.current": str(GiB), f"{d}/memory.stat": stat(inactive_file=0)},
    )
    with pytest.warns(UserWarning) as record:
        pool = co.HostPool(max_bytes="auto", node_max_bytes="4GiB", pinned=False)
    msg = str(record[0].message)
    assert f"node_max_bytes={4 * GiB}" in msg and f"limit {2 * GiB} bytes" in msg and f"{GiB} bytes" in msg
    assert f"cgroup v2 {d}/memory.max" in msg
    assert pool.max_bytes == GiB and pool.share["bounded_by"] == f"cgroup v2 {d}/memory.max"
    # Within the headroom: as given, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = co.HostPool(max_bytes="auto", node_max_bytes="512MiB", pinned=False)
    assert pool.max_bytes == 512 * MiB and pool.share["bounded_by"] == "node_max_bytes"


def test_a_full_cgroup_leaves_no_share_and_says_which_limit(host):
    d = "/sys/fs/cgroup/job"
    host(
        "0::/job\n",
        [V2_MOUNT],
        {f"{d}/memory.max": str(GiB), f"{d}/memory.current": str(GiB), f"{d}/memory.stat": stat(inactive_file=0)},
    )
    with pytest.raises(ValueError, match=f"cgroup v2 {d}/memory.max.*container's memory limit"):
        co.HostPool(max_bytes="auto", pinned=False)


def test_real_machine_budget_within_its_cgroup():
    """This machine's own cgroup, read for real: the budget never exceeds its headroom."""
    mem = _host_memory.available()
    cg = _host_memory.cgroup_headroom()
    pool = co.HostPool(max_bytes="auto", pinned=False, local_world_size=1)
    assert pool.share["node_max_bytes"] <= mem["available_bytes"] <= mem["mem_available"]
    if cg is None:
        assert pool.share["bounded_by"] == "MemAvailable"
    else:
        assert pool.max_bytes <= cg["headroom"] <= cg["limit"]


# --- a real memory cgroup ----------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, torch, ckpt_offload as co
    pool = co.HostPool(max_bytes="auto", pinned=False, segment_bytes=16 << 20)
    x = torch.ones(16 << 18)                  # 16 MiB
    handles, refused = [], None
    for _ in range(1000):                     # far past the share: until the cap refuses
        try:
            handles.append(co.offload_tensor(x, pool=pool))
        except co.PoolFullError as e:
            refused = str(e)
            break
    ok = all(torch.equal(h.reload(), x) for h in handles[:2])
    print(json.dumps({"share": pool.share, "stats": pool.stats(), "refused": refused, "ok": ok}))
""")


def _own_v1_memory_cgroup() -> str | None:
    for version, directory, _ in _host_memory._cgroup_dirs("/"):
        if version == 1 and os.access(directory, os.W_OK) and os.path.exists(f"{directory}/memory.limit_in_bytes"):
            return directory
    return None


def test_real_cgroup_limit_bounds_the_pool_and_the_process_survives(tmp_path):
    parent = _own_v1_memory_cgroup()
    if parent is None:
        # A v2 child would need the memory controller delegated to this process's cgroup, which
        # then may hold no process itself: not a layout a test can make for itself.
        pytest.skip("no writable v1 memory cgroup here (not root, or cgroup v2): the fake trees cover the reading")
    limit = GiB
    cgroup = Path(parent) / f"ckpt_offload-test-{os.getpid()}"
    try:
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {e}")
    try:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "LOCAL_WORLD_SIZE": "1",
            "PYTHONPATH": os.pathsep.join([str(Path(co.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        # The shell joins the cgroup, then becomes Python: everything the pool takes is charged there.
        # Outside the tree: `python -c` puts its cwd first on sys.path, where a checkout's
        # ckpt_offload/ (without a built _C) would shadow the installed package.
        proc = subprocess.run(
            ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$0" -c "$1"', sys.executable, CHILD],
            env=env,
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        cgroup.rmdir()
    assert proc.returncode == 0, f"child died (rc {proc.returncode}; -9: killed at the limit): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    share, stats = out["share"], out["stats"]
    assert share["bounded_by"] == f"cgroup v1 {cgroup}/memory.limit_in_bytes"
    assert share["cgroup"]["limit"] == limit and 0 < share["node_max_bytes"] <= limit // 2
    assert out["refused"] and out["ok"]  # the cap refused, the kept copies are intact
    assert stats["peak_bytes_reserved"] <= stats["max_bytes"] == share["max_bytes"]
