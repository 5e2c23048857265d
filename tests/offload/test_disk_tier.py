"""The disk tier: ``co.HostPool(max_bytes=..., spill_dir=...)`` on the engine's CPU path.

The pool's cap is tiny, so most saved activations go through staging memory to spill files and
come back from disk in backward (the CPU side streams run with conftest's delay, so the D2H
copies really are in flight when the I/O threads would write). Checks: gradients bit for bit,
corruption on disk raising in backward, a full disk handled per on_full, no byte or file left
behind, threads, the profiler's disk records.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import textwrap
import threading

import pytest
import torch
from conftest import assert_bit_identical, cpu_offload, nonzero
from helpers import TESTS_DIR, grads_of, run_child, run_python, step_grads
from models_for_tests import Chain  # 512 x 512 float32: 1 MiB per saved activation

import ckpt_offload as co

MiB = 1 << 20
ONE = 512 * 512 * 4


def open_spill_files(d: str) -> int:
    """Descriptors of this process open on files in d (deleted ones included)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(d + "/")
    return n


def spill_pool(spill_dir, **kw):
    kw.setdefault("max_bytes", 2 * MiB)  # two of Chain's activations; the rest spill
    kw.setdefault("spill_file_bytes", 8 * MiB)
    return co.HostPool(pinned=False, spill_dir=spill_dir, **kw)


def _inputs(seed=0):
    torch.manual_seed(seed)
    return torch.randn(512, 512)


def _assert_all_back(pool):
    """Nothing spilled, staged or pooled is left once the graphs are gone."""
    co.synchronize()
    pool._tier.synchronize()
    s = pool.stats()
    assert s["bytes_in_use"] == 0
    assert s["disk"]["bytes_in_use"] == 0
    assert s["disk"]["num_blocks_in_use"] == 0
    assert s["disk"]["staging_bytes_in_use"] == 0


@pytest.mark.parametrize("prefetch", [0, 64 * MiB], ids=["no_prefetch", "prefetch"])
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batched"])
def test_spilled_gradients_bit_identical(spill_dir, stream, prefetch, batch):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    ref = step_grads(model, x)
    pool = spill_pool(spill_dir)
    kw = dict(batch_below=2 * MiB, batch_bytes=4 * MiB) if batch else {}
    ctx = cpu_offload(pool, stream=stream, prefetch_bytes=prefetch, **kw)
    got = step_grads(model, x, ctx)
    assert_bit_identical(ref, got)
    s, d = ctx.stats(), pool.stats()["disk"]
    assert s["tensors_kept"] == 0 or set(nonzero(s["kept_by_reason"])) <= {"parameter"}
    assert s["tensors_spilled"] >= 4, s
    assert s["bytes_spilled"] >= 4 * ONE
    assert d["blocks_spilled"] >= (2 if batch else 4)
    assert d["bytes_written"] == d["bytes_spilled"] == s["bytes_spilled"]
    assert d["bytes_read"] >= d["bytes_written"]  # every spilled block came back from disk
    assert d["checksum_errors"] == 0
    if prefetch and stream == "side":
        assert s["disk_prefetches"] > 0
        assert d["reads_prefetch"] == s["disk_prefetches"]
    else:
        assert s["disk_prefetches"] == 0
    _assert_all_back(pool)


def test_spill_counts_in_stats_and_memory_stays_bounded(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    pool = spill_pool(spill_dir, spill_staging_bytes=2 * ONE)
    with cpu_offload(pool) as ctx:
        y = model(x)
    co.synchronize()
    pool._tier.synchronize()
    d = pool.stats()["disk"]
    # Forward is over and every write has landed: the staging memory went back, the pool
    # holds what its cap allows, the rest sits on disk.
    assert d["staging_bytes_in_use"] == 0
    assert d["staging_peak_bytes_in_use"] <= 3 * ONE + 4096
    assert pool.stats()["bytes_in_use"] <= 2 * MiB
    assert d["bytes_in_use"] >= ctx.stats()["bytes_spilled"] > 0
    assert d["write_bandwidth"] > 0 and d["read_bandwidth"] is None
    (y * y).sum().backward()
    assert pool.stats()["disk"]["read_bandwidth"] > 0
    del y
    _assert_all_back(pool)


def _corrupt_every_spill_file(pool):
    for f in pool._tier.files():
        with open(f["proc_path"], "r+b") as fh:
            data = bytearray(fh.read(4 * MiB))
            for i in range(0, len(data), 4096):
                data[i] ^= 0xFF
            fh.seek(0)
            fh.write(data)


@pytest.mark.parametrize("prefetch", [0, 64 * MiB], ids=["no_prefetch", "prefetch"])
def test_corruption_on_disk_raises_in_backward(spill_dir, prefetch):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    pool = spill_pool(spill_dir)
    with cpu_offload(pool, prefetch_bytes=prefetch):
        y = model(x)
    co.synchronize()
    pool._tier.synchronize()  # every write is on disk before we damage it
    _corrupt_every_spill_file(pool)
    with pytest.raises(co.SpillError, match="checksum mismatch") as info:
        (y * y).sum().backward()
    assert spill_dir in str(info.value)  # the message names the file
    assert pool.stats()["disk"]["checksum_errors"] >= 1
    del y, info
    gc.collect()
    _assert_all_back(pool)


def test_disk_full_keeps_tensors_and_gradients_stay_exact(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    ref = step_grads(model, x)
    pool = spill_pool(spill_dir, spill_max_bytes=2 * MiB, spill_file_bytes=1 * MiB)
    ctx = cpu_offload(pool)
    got = step_grads(model, x, ctx)
    assert_bit_identical(ref, got)
    s = ctx.stats()
    assert s["kept_by_reason"]["disk_full"] >= 1
    assert s["kept_bytes_by_reason"]["disk_full"] == s["kept_by_reason"]["disk_full"] * ONE
    assert s["tensors_spilled"] == 2
    assert pool.stats()["disk"]["blocks_refused"] == s["kept_by_reason"]["disk_full"]
    assert pool.stats()["disk"]["max_bytes"] == 2 * MiB
    _assert_all_back(pool)


def test_disk_full_raises_under_on_full_raise(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    pool = spill_pool(spill_dir, spill_max_bytes=1 * MiB, spill_file_bytes=1 * MiB)
    with pytest.raises(co.PoolFullError, match="disk tier has no room.*spill_max_bytes"):
        with cpu_offload(pool, on_full="raise"):
            model(x)
    gc.collect()
    _assert_all_back(pool)


def test_disk_full_batched_counts_disk_full(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    ref = step_grads(model, x)
    pool = spill_pool(spill_dir, spill_max_bytes=4 * MiB, spill_file_bytes=4 * MiB)
    ctx = cpu_offload(pool, batch_below=2 * MiB, batch_bytes=4 * MiB)
    got = step_grads(model, x, ctx)
    assert_bit_identical(ref, got)
    assert ctx.stats()["kept_by_reason"].get("disk_full", 0) >= 1
    _assert_all_back(pool)


def test_small_file_system_full(tmp_path):
    """ENOSPC from a real (2 MiB tmpfs) file system, not from spill_max_bytes."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"):
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    d = tmp_path / "small"
    d.mkdir()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        import torch, ckpt_offload as co
        from models_for_tests import Chain
        torch.manual_seed(0)
        model, x = Chain(n=8), torch.randn(512, 512)
        (model(x) ** 2).sum().backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        pool = co.HostPool(pinned=False, max_bytes=1 << 20, spill_dir={str(d)!r}, spill_file_bytes=1 << 20)
        ctx = co.offload(pool=pool, devices=["cpu"], min_bytes=0)
        with ctx:
            y = model(x)
        (y ** 2).sum().backward()
        s = ctx.stats()
        got = [p.grad.clone() for p in model.parameters()]
        if not all(torch.equal(a, b) for a, b in zip(ref, got)):
            # Say enough to tell a wrong reload from a reference that is not reproducible here.
            model.zero_grad()
            (model(x) ** 2).sum().backward()
            again = all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
            diffs = [float((a - b).abs().max()) for a, b in zip(ref, got)]
            raise AssertionError(f"gradients differ: max |diff| per parameter {{diffs}}; the reference "
                                 f"reproduces without offload: {{again}}; stats {{s}}; disk {{pool.stats()['disk']}}")
        assert s["kept_by_reason"]["disk_full"] >= 1, s
        assert pool.stats()["disk"]["num_disk_full"] >= 1
        assert pool.stats()["disk"]["num_cap_hits"] == 0
        print("OK", s["kept_by_reason"], s["tensors_spilled"])
    """)
    cmd = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs -o size=2m tmpfs "{d}" || exit 77; exec "{sys.executable}" -c "$0"',
        script,
    ]
    r = run_child(cmd)
    if r.returncode == 77:
        pytest.skip("cannot mount a tmpfs here: " + r.stderr.strip()[:200])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


def test_nothing_left_after_graph_dies_or_backward_raises(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=8), _inputs()
    pool = spill_pool(spill_dir)
    # A graph dropped without backward.
    with cpu_offload(pool, prefetch_bytes=64 * MiB):
        y = model(x)
    assert pool.stats()["disk"]["num_blocks_in_use"] > 0
    del y
    gc.collect()
    _assert_all_back(pool)

    # A backward that raises halfway (after some blocks were read back and prefetched).
    def boom(grad):
        raise RuntimeError("boom")

    with cpu_offload(pool, prefetch_bytes=64 * MiB):
        h = torch.tanh(model.layers[0](x))
        h.register_hook(boom)
        y = h
        for layer in model.layers[1:]:
            y = torch.tanh(layer(y))
    with pytest.raises(RuntimeError, match="boom"):
        (y * y).sum().backward()
    del y, h
    gc.collect()
    _assert_all_back(pool)
    # empty_cache closes the files (their disk space goes back); the pool dying does too.
    assert open_spill_files(spill_dir) >= 1
    pool.empty_cache()
    assert open_spill_files(spill_dir) == 0
    assert pool.stats()["disk"]["bytes_reserved"] == 0
    with cpu_offload(pool):
        y = model(x)
    assert open_spill_files(spill_dir) >= 1
    del y, pool
    gc.collect()
    co.synchronize()
    assert open_spill_files(spill_dir) == 0


def test_killed_process_leaves_no_file(spill_dir):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {TESTS_DIR!r})
        import torch, ckpt_offload as co
        from models_for_tests import Chain
        pool = co.HostPool(pinned=False, max_bytes=1 << 20, spill_dir={spill_dir!r}, spill_file_bytes=8 << 20)
        with co.offload(pool=pool, devices=["cpu"], min_bytes=0):
            y = Chain(n=8)(torch.randn(512, 512))
        co.synchronize()
        pool._tier.synchronize()
        assert pool.stats()["disk"]["bytes_in_use"] > 0
        assert os.listdir({spill_dir!r}) == [], os.listdir({spill_dir!r})
        print("spilled", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = run_python(script)
    assert "spilled" in r.stdout, r.stderr
    assert r.returncode == -9
    assert os.listdir(spill_dir) == []  # the fixture checks it too


def test_threads_share_a_spilling_pool(spill_dir):
    pool = spill_pool(spill_dir, max_bytes=3 * MiB)
    errors, results = [], {}

    def work(i):
        try:
            torch.manual_seed(i)
            model, x = Chain(n=6), torch.randn(512, 512)
            ref = step_grads(model, x)
            for _ in range(2):
                got = step_grads(model, x, cpu_offload(pool, prefetch_bytes=(i % 2) * 64 * MiB))
                assert_bit_identical(ref, got)
            results[i] = True
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 4
    assert pool.stats()["disk"]["blocks_spilled"] > 0
    _assert_all_back(pool)


def test_checkpoint_and_apply_spill(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=6), _inputs().requires_grad_()
    ref = step_grads(model, x)
    pool = spill_pool(spill_dir, max_bytes=1 * MiB)
    opts = {"pool": pool, "devices": ["cpu"], "min_bytes": 0}
    model.zero_grad(set_to_none=True)
    y = x
    for layer in model.layers:
        y = co.checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), y, offload=opts)
    (y * y).sum().backward()
    assert_bit_identical(ref, grads_of(model))
    assert pool.stats()["disk"]["blocks_spilled"] > 0
    y = None
    _assert_all_back(pool)


def test_apply_spills(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=6), _inputs().requires_grad_()
    ref = step_grads(model, x)
    pool = spill_pool(spill_dir, max_bytes=1 * MiB)
    handle = co.apply(model, offload={"pool": pool, "devices": ["cpu"], "min_bytes": 0})
    got = step_grads(model, x)
    handle.remove()
    assert_bit_identical(ref, got)
    assert pool.stats()["disk"]["blocks_spilled"] > 0
    _assert_all_back(pool)


def test_offload_tensor_spills_and_reloads(spill_dir):
    pool = spill_pool(spill_dir, max_bytes=1 * MiB)
    xs = [torch.randn(256, 1024) for _ in range(3)]  # 1 MiB each: the 2nd and 3rd spill
    hs = [co.offload_tensor(x, pool=pool) for x in xs]
    assert pool.stats()["disk"]["blocks_spilled"] == 2
    for x, h in zip(xs, hs):
        assert torch.equal(h.reload(), x)
    del hs, h
    _assert_all_back(pool)


def test_profile_has_disk_records(spill_dir):
    torch.manual_seed(0)
    model, x = Chain(n=6), _inputs()
    pool = spill_pool(spill_dir)
    with co.profile(pools=[pool]) as prof:
        step_grads(model, x, cpu_offload(pool, prefetch_bytes=64 * MiB))
    rec = prof.to_dict()["records"]
    writes = [d for d in rec["disk"] if d["kind"] == "disk_write"]
    reads = [d for d in rec["disk"] if d["kind"] == "disk_read"]
    d2h = {c["handle"] for c in rec["copies"] if c["kind"] == "d2h"}
    assert len(writes) >= 3 and {w["handle"] for w in writes} <= d2h
    assert {r["handle"] for r in reads} == {w["handle"] for w in writes}
    assert any(r["prefetch"] for r in reads)
    assert all(0 <= d["start_us"] <= d["end_us"] for d in rec["disk"])
    assert max(m["disk_bytes_in_use"] for m in rec["memory"]) >= ONE
    assert "disk: " in prof.summary() and "written to the spill files" in prof.summary()
    cats = {e.get("cat") for e in prof.chrome_trace()["traceEvents"]}
    assert {"disk_write", "disk_read"} <= cats


def test_bad_spill_arguments(tmp_path):
    with pytest.raises(ValueError, match="spill_dir needs max_bytes"):
        co.HostPool(pinned=False, spill_dir=str(tmp_path))
    with pytest.raises(ValueError, match="spill_dir=.*is not an existing directory"):
        co.HostPool(pinned=False, max_bytes=MiB, spill_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="spill_max_bytes needs spill_dir"):
        co.HostPool(pinned=False, max_bytes=MiB, spill_max_bytes=MiB)
    with pytest.raises(TypeError, match="spill_dir must be a path"):
        co.HostPool(pinned=False, max_bytes=MiB, spill_dir=5)
    with pytest.raises(ValueError, match="spill_max_bytes"):
        co.HostPool(pinned=False, max_bytes=MiB, spill_dir=str(tmp_path), spill_max_bytes=0)
    pool = co.HostPool(pinned=False, max_bytes=MiB, spill_dir=tmp_path)  # a PathLike is fine
    assert pool.spill_dir == str(tmp_path)
    assert "spill_dir=" in repr(pool)
    assert "disk" not in co.HostPool(pinned=False).stats()


# ---- GPU: pinned staging, CUDA events as the writes' `after`, H2D from read-back blocks ----

from helpers import HAS_GPU, cuda_device  # noqa: E402
from helpers import sleep_stream as _sleep  # noqa: E402


@pytest.fixture
def device():
    """The CUDA device for the GPU tests below (conftest's `device` also runs on CPU)."""
    yield from cuda_device()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and a CUDA build of ckpt_offload")
@pytest.mark.parametrize("prefetch", [0, 64 * MiB], ids=["no_prefetch", "prefetch"])
def test_gpu_spilled_gradients_bit_identical(spill_dir, device, stream, prefetch):
    torch.manual_seed(0)
    model = Chain(n=8).to(device)
    x = torch.randn(512, 512, device=device)
    ref = step_grads(model, x)
    pool = co.HostPool(max_bytes=2 * MiB, spill_dir=spill_dir, spill_file_bytes=16 * MiB)
    assert pool.pinned
    ctx = co.offload(pool=pool, min_bytes=0, stream=stream, prefetch_bytes=prefetch)
    model.zero_grad(set_to_none=True)
    with ctx:
        y = model(x)
        _sleep()  # the D2H copies are still running when the I/O threads would start writing
    (y * y).sum().backward()
    assert_bit_identical(ref, grads_of(model))
    assert ctx.stats()["tensors_spilled"] >= 4
    assert pool.stats()["disk"]["bytes_read"] >= pool.stats()["disk"]["bytes_written"] > 0
    del y
    _assert_all_back(pool)
