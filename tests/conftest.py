import gc
import os

import pytest
import torch

import ckpt_offload as co
from helpers import GPU_REASON, HAS_GPU, cuda_device, grads_of  # noqa: F401  (grads_of: tests import it from here)

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # only tests/property/test_property.py needs it, and skips without it
    settings = None

# The CPU side streams are worker threads; a delay before every copy makes an ordering bug
# (a missing wait, a block or source reused too early) show up as wrong data here, as it
# would on a GPU. Override with CKPT_OFFLOAD_CPU_COPY_DELAY_US, the variable the library itself
# reads at import (the old name CKPT_OFFLOAD_TEST_DELAY_US still works in the tests for one release).
DELAY_ENV = "CKPT_OFFLOAD_CPU_COPY_DELAY_US"


TEST_DELAY_US = int(os.environ.get(DELAY_ENV, os.environ.get("CKPT_OFFLOAD_TEST_DELAY_US", "200")))


# Property-based tests (tests/property/test_property.py). "ci" (the default) is derandomized: every run
# tries the same examples, so CI is reproducible and its time bounded. "thorough" draws fresh
# random examples, ten times as many: CKPT_OFFLOAD_HYPOTHESIS_PROFILE=thorough pytest tests/property/test_property.py
HYPOTHESIS_PROFILE = os.environ.get("CKPT_OFFLOAD_HYPOTHESIS_PROFILE", "ci")
if HYPOTHESIS_PROFILE not in ("ci", "thorough"):
    raise ValueError(f"CKPT_OFFLOAD_HYPOTHESIS_PROFILE must be 'ci' or 'thorough', got {HYPOTHESIS_PROFILE!r}")
if settings is not None:
    _hypothesis_common = dict(
        deadline=None,  # the CPU copy delay and a loaded CI machine make per-example times vary
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,  # a failure prints the @reproduce_failure line
    )
    settings.register_profile("ci", derandomize=True, database=None, **_hypothesis_common)
    settings.register_profile("thorough", derandomize=False, **_hypothesis_common)
    settings.load_profile(HYPOTHESIS_PROFILE)


def hypothesis_examples(ci: int) -> int:
    """max_examples for a property test: ``ci`` examples in CI, ten times as many when thorough."""
    return ci * (10 if HYPOTHESIS_PROFILE == "thorough" else 1)


@pytest.fixture(autouse=True, scope="session")
def _async_cpu_streams_with_delay():
    co._C.testing.set_cpu_copy_delay_us(TEST_DELAY_US)
    yield
    co._C.testing.set_cpu_copy_delay_us(0)


_GLOBAL_MODULE_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def global_module_hook_counts() -> dict:
    """How many global nn.Module hooks of each kind are registered (co.offload and co.profile add some)."""
    mod = torch.nn.modules.module
    return {name: len(getattr(mod, name)) for name in _GLOBAL_MODULE_HOOKS if hasattr(mod, name)}


def default_pool_bytes_in_use() -> int:
    co.synchronize()
    return co.default_pool().stats()["bytes_in_use"]


def device_bytes_saved() -> int:
    """The memory timeline's count of saved-activation bytes held on their device."""
    co.synchronize()  # a source still being copied counts until its copy has read it
    return co._C.device_bytes_saved()


def run_a_backward() -> None:
    """Runs a tiny backward on this thread. After a backward that raised, PyTorch's engine keeps
    the nodes it had queued (and the tensors they saved) until the next backward on the thread."""
    x = torch.ones(1, requires_grad=True)
    (x * 2).sum().backward()


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    """Every test leaves the default pool's bytes in use, the device bytes the memory timeline
    counts, the global module hooks and this thread's saved-tensor hooks stack as it found them:
    no stuck context, no leaked graph, no holder of device bytes that outlives its graph."""
    bytes_before = default_pool_bytes_in_use()
    device_before = device_bytes_saved()
    hooks_before = global_module_hook_counts()
    yield
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks left active"
    assert global_module_hook_counts() == hooks_before, "global nn.Module hooks left registered"
    if default_pool_bytes_in_use() != bytes_before or device_bytes_saved() != device_before:
        gc.collect()  # a graph held only by a reference cycle (an exception's traceback) is not a leak
        assert default_pool_bytes_in_use() == bytes_before, "default pool bytes still in use after the test"
        assert device_bytes_saved() == device_before, "device bytes still counted in the memory timeline"


@pytest.fixture
def _fresh_dynamo():
    """For the torch.compile tests (``pytestmark = pytest.mark.usefixtures("_fresh_dynamo")``):
    each starts from an empty Dynamo cache and cleared counters, on one thread, and leaves compiled
    autograd off, the cache empty and the thread count as it found them."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on a busy 2-core machine
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.config.compiled_autograd = False
    torch._dynamo.reset()
    torch.set_num_threads(threads)


@pytest.fixture
def pool():
    """A fresh pageable pool, so byte counts start at zero."""
    return co.HostPool(pinned=False)


@pytest.fixture
def spill_dir(tmp_path):
    """An empty directory for a pool's ``spill_dir`` (a str), checked empty again after the test:
    spill files never have a name (O_TMPFILE, or unlinked at once), so nothing is ever left there."""
    d = tmp_path / "spill"
    d.mkdir()
    yield str(d)
    assert os.listdir(d) == []


@pytest.fixture(params=["side", "compute"])
def stream(request):
    return request.param


@pytest.fixture(
    params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)])]
)
def device(request):
    """Runs a behaviour test on CPU tensors and, marked `gpu` (skipped without a GPU), on CUDA.
    Offload it with `co.offload(devices=[device.type], ...)`. GPU-only files define their own."""
    if request.param == "cpu":
        yield torch.device("cpu")
    else:
        yield from cuda_device()


def cpu_offload(pool=None, **kw):
    """co.offload pointed at CPU tensors, offloading everything by default."""
    kw.setdefault("devices", ["cpu"])
    kw.setdefault("min_bytes", 0)
    return co.offload(pool=pool, **kw)


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"gradient of {k} differs"


def assert_same_params(expected: dict, got: dict, what: str):
    """Two {name: tensor} parameter sets are bit-identical; the message names the ones that are not."""
    assert expected.keys() == got.keys()
    differing = [n for n in expected if not torch.equal(expected[n], got[n])]
    assert not differing, f"{what}: parameters differ: {differing}"


def step_peak_bytes(step, warmup: int = 1) -> int:
    """Peak of torch-allocated CPU memory during ``step()`` above what was allocated when it
    started, read from torch.profiler's memory events: a measure independent of ckpt_offload's
    own counters (the host pool allocates its own memory, so it is not counted; reloads are).
    ``warmup`` calls first, so gradients exist and the figure is activations plus temporaries."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals) - totals[0] if totals else 0


def nonzero(counts: dict) -> dict:
    """The entries of a stats dict (kept_by_reason lists every reason, zeros included) that are not 0."""
    return {k: v for k, v in counts.items() if v}
