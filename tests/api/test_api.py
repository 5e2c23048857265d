"""Public API: build_info, HostPool, offload_tensor, and argument validation."""

import gc

import pytest
import torch

import ckpt_offload as co
from conftest import TEST_DELAY_US


def test_build_info_keys():
    info = co.build_info()
    for key in ["cuda_compiled", "gpu_available", "torch_version", "cuda_version", "pool_backend"]:
        assert key in info
    assert isinstance(info["cuda_compiled"], bool) and isinstance(info["gpu_available"], bool)
    assert info["torch_version"] == torch.__version__
    assert info["pool_backend"] in ("pinned", "pageable")
    if not info["cuda_compiled"]:
        assert info["cuda_version"] is None
    if not info["gpu_available"]:
        assert info["pool_backend"] == "pageable"


def test_cuda_build_where_torch_and_nvcc_have_cuda():
    """Where nvcc, a CUDA torch and a GPU are (the GPU machine), the CUDA engine must be compiled in."""
    import os
    import shutil

    if torch.version.cuda is None or not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("no CUDA toolchain here: the C++-only build is expected")
    if os.environ.get("CKPT_OFFLOAD_CUDA") == "0":
        pytest.skip("CKPT_OFFLOAD_CUDA=0 forced the C++-only build")
    if not torch.cuda.is_available() and os.environ.get("CKPT_OFFLOAD_CUDA") != "1":
        pytest.skip("no GPU here: the default build is the C++-only engine (CKPT_OFFLOAD_CUDA=1 forces CUDA)")
    assert co.build_info()["cuda_compiled"]


# --- HostPool -----------------------------------------------------------------------------


def test_pool_reserved_close_to_requested():
    pool = co.HostPool(pinned=False)
    n = int(129.5 * 2**20)
    h = co.offload_tensor(torch.empty(n, dtype=torch.uint8), pool=pool)
    s = pool.stats()
    assert s["bytes_requested"] == n
    assert s["bytes_reserved"] < 1.01 * n  # PyTorch's host allocator would reserve 256 MiB
    assert s["num_segments"] == 1
    del h
    assert pool.empty_cache() >= n
    assert pool.stats()["bytes_reserved"] == 0


def test_pool_stats_and_peak():
    pool = co.HostPool(pinned=False)
    hs = [co.offload_tensor(torch.randn(1000), pool=pool) for _ in range(3)]
    s = pool.stats()
    assert s["num_allocs"] == 3 and s["num_blocks_in_use"] == 3
    assert s["bytes_in_use"] == 3 * 4096  # 4000 bytes rounded to the 512-byte alignment
    assert s["bytes_requested"] == 12000
    del hs
    s = pool.stats()
    assert s["bytes_in_use"] == 0 and s["peak_bytes_in_use"] == 3 * 4096
    pool.reset_peak()
    assert pool.stats()["peak_bytes_in_use"] == 0
    assert pool.stats()["num_backend_allocs"] == 1
    assert "HostPool(backend='pageable'" in repr(pool)


def test_pool_cap_setter():
    pool = co.HostPool(pinned=False, max_bytes=1 << 20)
    assert pool.max_bytes == 1 << 20
    pool.max_bytes = None
    assert pool.max_bytes is None
    h = co.offload_tensor(torch.randn(2000), pool=pool)
    del h
    pool.synchronize()
    assert pool.stats()["bytes_reserved"] > 4096
    pool.set_max_bytes(4096)  # a lower cap gives back the free segments at once
    assert pool.stats()["bytes_reserved"] == 0
    with pytest.raises(co.PoolFullError):
        co.offload_tensor(torch.randn(2000), pool=pool)


def test_reserve_up_front_means_no_backend_allocation_later():
    pool = co.HostPool(pinned=False)
    assert pool.reserve(3 << 20) == 3 << 20
    s = pool.stats()
    assert s["bytes_reserved"] == 3 << 20 and s["num_backend_allocs"] == 1 and s["bytes_in_use"] == 0
    hs = [co.offload_tensor(torch.randn(250_000), pool=pool) for _ in range(3)]  # 1 MB each
    assert pool.stats()["num_backend_allocs"] == 1
    del hs
    capped = co.HostPool(pinned=False, max_bytes=1 << 20)
    with pytest.raises(co.PoolFullError, match="could not reserve"):
        capped.reserve(2 << 20)
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        capped.reserve(0)


def test_pinned_pool_needs_a_gpu():
    if co.build_info()["gpu_available"]:
        assert co.HostPool(pinned=True).backend == "pinned"
    else:
        with pytest.raises(ValueError, match="pinned=False"):
            co.HostPool(pinned=True)


def test_default_pool_is_shared():
    assert co.default_pool() is co.default_pool()
    assert co.default_pool().backend == co.build_info()["pool_backend"]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"max_bytes": -1}, ValueError, "max_bytes=-1 is below the minimum of 4096 bytes"),
        ({"max_bytes": 0}, ValueError, "max_bytes=0 is below the minimum of 4096 bytes"),
        ({"max_bytes": 1.5}, TypeError, "max_bytes must be an int or None"),
        ({"max_bytes": True}, TypeError, "max_bytes"),
        ({"pinned": "yes"}, TypeError, "pinned must be True, False or None"),
        ({"segment_bytes": 0}, ValueError, "segment_bytes must be >= 1"),
    ],
)
def test_pool_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        co.HostPool(**kwargs)


# --- offload() arguments ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"min_bytes": -1}, ValueError, "min_bytes must be >= 0"),
        ({"min_bytes": "1 MB of it"}, ValueError, "min_bytes: cannot read '1 MB of it' as bytes"),  # "1MB" is a size
        ({"min_bytes": 1.0}, TypeError, "min_bytes must be an int"),
        ({"stream": "fast"}, ValueError, r"stream must be one of \('side', 'compute'\)"),
        ({"stream": 1}, TypeError, "stream must be one of"),
        ({"on_full": "drop"}, ValueError, r"on_full must be one of \('keep', 'raise'\)"),
        ({"devices": ["tpu"]}, ValueError, "devices: unknown device 'tpu'"),
        ({"devices": ["meta"]}, ValueError, "device type 'meta' is not supported"),
        ({"devices": ["cuda:1"]}, ValueError, "devices takes device types, not devices"),
        ({"devices": 3}, TypeError, "devices must be a device type"),
        ({"devices": [3]}, TypeError, "devices entries must be strings or torch.device"),
        ({"pool": "big"}, TypeError, "pool must be a ckpt_offload.HostPool or None"),
    ],
)
def test_offload_bad_arguments(kwargs, exc, match):
    kwargs.setdefault("devices", ["cpu"])
    with pytest.raises(exc, match=match):
        co.offload(**kwargs)


def test_offload_accepts_device_forms():
    assert co.offload(devices="cpu").devices == ("cpu",)
    assert co.offload(devices=torch.device("cpu")).devices == ("cpu",)
    assert co.offload(devices=("cpu", "cpu")).devices == ("cpu",)
    if co.build_info()["cuda_compiled"]:
        assert co.offload(devices=["cpu", "cuda"]).devices == ("cpu", "cuda")
    else:
        with pytest.raises(ValueError, match="no CUDA"):
            co.offload(devices=["cuda"])


# --- what the pack hook returns -------------------------------------------------------------


def test_saved_activation_says_whether_it_was_offloaded():
    """The object pack hands to autograd answers `offloaded` (read by tests and when debugging a
    plan): True for a tensor whose bytes went to the pool, False for one kept as it is."""
    pool = co.HostPool(pinned=False)
    ctx = co.offload(pool=pool, min_bytes=4096, devices=["cpu"])
    big, small = torch.randn(1 << 12), torch.randn(8)
    with ctx:
        moved, kept = ctx._packer.pack(big), ctx._packer.pack(small)
    assert moved.offloaded is True and kept.offloaded is False
    assert pool.stats()["bytes_in_use"] >= big.nbytes
    with pytest.raises(AttributeError):
        moved.offloaded = False  # read-only
    assert torch.equal(ctx._packer.unpack(moved), big) and torch.equal(ctx._packer.unpack(kept), small)
    del moved, kept
    gc.collect()
    assert pool.stats()["bytes_in_use"] == 0


# --- offload_tensor: the engine on its own --------------------------------------------------


def test_offload_tensor_round_trip(pool, stream):
    x = torch.randn(300, 200)[7:, 3:150].t()
    h = co.offload_tensor(x, pool=pool, stream=stream)
    assert h.offloaded and h.device == "cpu"
    y = h.reload()
    assert torch.equal(x, y) and y.stride() == x.stride()
    # Only the span the tensor reaches is copied; the offset is kept modulo 512 bytes, so the
    # data pointer keeps its alignment (kernels pick code paths by it).
    assert (y.storage_offset() - x.storage_offset()) * 4 % 512 == 0
    assert y.data_ptr() % 64 == x.data_ptr() % 64
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_offload_tensor_bad_arguments(pool):
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        co.offload_tensor([1, 2, 3])
    with pytest.raises(ValueError, match="tensor: .*plain strided tensor"):
        co.offload_tensor(torch.randn(4, 4).to_sparse(), pool=pool)
    with pytest.raises(ValueError, match="stream must be one of"):
        co.offload_tensor(torch.randn(4), stream="other")
    with pytest.raises(TypeError, match="pool must be"):
        co.offload_tensor(torch.randn(4), pool=object())


def test_source_is_not_freed_before_its_copy(pool):
    """The source's memory must stay valid until the (delayed, asynchronous) copy has read it.
    Freed early, the allocator hands the same memory to the next same-size tensor."""
    assert TEST_DELAY_US > 0
    for i in range(20):
        x = torch.full((4096,), float(i))
        h = co.offload_tensor(x, pool=pool, stream="side")
        del x
        junk = [torch.full((4096,), -1.0) for _ in range(4)]  # likely reuses x's memory if freed
        assert torch.equal(h.reload(), torch.full((4096,), float(i)))
        del junk
    co.synchronize()
    assert co._C.num_keepalives() == 0


def test_block_not_reused_while_its_copy_is_pending():
    pool = co.HostPool(pinned=False)
    co._C.testing.set_cpu_copy_delay_us(20000)
    try:
        h = co.offload_tensor(torch.randn(10000), pool=pool, stream="side")
        del h  # its copy is still queued behind the 20 ms delay
        s = pool.stats()
        assert s["bytes_in_use"] == 0 and s["bytes_pending"] == 40448
        h2 = co.offload_tensor(torch.ones(10000), pool=pool, stream="side")
        assert pool.stats()["bytes_pending"] in (0, 40448)
        assert torch.equal(h2.reload(), torch.ones(10000))
        del h2
        pool.synchronize()
        assert pool.stats()["bytes_pending"] == 0
    finally:
        co._C.testing.set_cpu_copy_delay_us(TEST_DELAY_US)


def test_many_handles_many_threads(pool):
    import threading

    errors = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(50):
            x = torch.randn(int(torch.randint(1, 5000, (1,), generator=g)), generator=g)
            h = co.offload_tensor(x, pool=pool)
            if not torch.equal(h.reload(), x):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    gc.collect()
    assert pool.stats()["bytes_in_use"] == 0
    assert pool._impl.check_invariants() == ""
