import os

import pytest
import torch

import ckpt_offload as co

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # only tests/test_property.py needs it, and skips without it
    settings = None

# The CPU side streams are worker threads; a delay before every copy makes an ordering bug
# (a missing wait, a block or source reused too early) show up as wrong data here, as it
# would on a GPU. Override with CKPT_OFFLOAD_CPU_COPY_DELAY_US, the variable the library itself
# reads at import (the old name CKPT_OFFLOAD_TEST_DELAY_US still works in the tests for one release).
DELAY_ENV = "CKPT_OFFLOAD_CPU_COPY_DELAY_US"


TEST_DELAY_US = int(os.environ.get(DELAY_ENV, os.environ.get("CKPT_OFFLOAD_TEST_DELAY_US", "200")))


# Property-based tests (tests/test_property.py). "ci" (the default) is derandomized: every run
# tries the same examples, so CI is reproducible and its time bounded. "thorough" draws fresh
# random examples, ten times as many: CKPT_OFFLOAD_HYPOTHESIS_PROFILE=thorough pytest tests/test_property.py
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
    co._C.set_cpu_copy_delay_us(TEST_DELAY_US)
    yield
    co._C.set_cpu_copy_delay_us(0)


@pytest.fixture
def pool():
    """A fresh pageable pool, so byte counts start at zero."""
    return co.HostPool(pinned=False)


@pytest.fixture(params=["side", "compute"])
def stream(request):
    return request.param


def cpu_offload(pool=None, **kw):
    """co.offload pointed at CPU tensors, offloading everything by default."""
    kw.setdefault("devices", ["cpu"])
    kw.setdefault("min_bytes", 0)
    return co.offload(pool=pool, **kw)


def grads_of(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"gradient of {k} differs"
