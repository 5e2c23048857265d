import os

import pytest
import torch

import ckpt_offload as co

# The CPU side streams are worker threads; a delay before every copy makes an ordering bug
# (a missing wait, a block or source reused too early) show up as wrong data here, as it
# would on a GPU. Override with CKPT_OFFLOAD_TEST_DELAY_US.
TEST_DELAY_US = int(os.environ.get("CKPT_OFFLOAD_TEST_DELAY_US", "200"))


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


def assert_same_params(expected: dict, got: dict, what: str):
    """Two {name: tensor} parameter sets are bit-identical; the message names the ones that are not."""
    assert expected.keys() == got.keys()
    differing = [n for n in expected if not torch.equal(expected[n], got[n])]
    assert not differing, f"{what}: parameters differ: {differing}"
