import gc
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


def run_a_backward() -> None:
    """Runs a tiny backward on this thread. After a backward that raised, PyTorch's engine keeps
    the nodes it had queued (and the tensors they saved) until the next backward on the thread."""
    x = torch.ones(1, requires_grad=True)
    (x * 2).sum().backward()


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    """Every test leaves the default pool's bytes in use, the global module hooks and this
    thread's saved-tensor hooks stack as it found them: no stuck context, no leaked graph."""
    bytes_before = default_pool_bytes_in_use()
    hooks_before = global_module_hook_counts()
    yield
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks left active"
    assert global_module_hook_counts() == hooks_before, "global nn.Module hooks left registered"
    if default_pool_bytes_in_use() != bytes_before:
        gc.collect()  # a graph held only by a reference cycle (an exception's traceback) is not a leak
        assert default_pool_bytes_in_use() == bytes_before, "default pool bytes still in use after the test"


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
