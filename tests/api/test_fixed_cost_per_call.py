"""Note [Fixed cost per call]: what the checkpoint routes do once per distinct options rather than
once per call -- and that doing it once never changes an answer: errors still raise at every call,
warnings still reach every call site, distinct values are never mistaken for each other, and the
tensors handed to torch's checkpoint are the same."""

import warnings
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn as nn

import ckpt_offload as co
from ckpt_offload import _option_cache, checkpointing, options as options_module
from ckpt_offload.options import OffloadOptions, as_options, check_offloads_something, pool_free_key
from conftest import assert_bit_identical, hypothesis_examples
from helpers import grads_of

CPU = {"devices": ["cpu"], "min_bytes": 0}


def test_offload_true_is_one_frozen_instance_of_the_defaults():
    assert as_options(True) is as_options(True)
    assert as_options(True) == OffloadOptions()


def test_a_dict_is_made_into_options_once_per_distinct_contents():
    a = as_options({"devices": ["cpu"], "min_bytes": "64KiB"})
    assert as_options({"devices": ["cpu"], "min_bytes": "64KiB"}) is a
    assert as_options({"min_bytes": "64KiB", "devices": ["cpu"]}) is a  # key order does not matter
    # Equal contents of other types are other entries, each normalized on its own.
    s = as_options({"devices": {"cpu"}, "min_bytes": "64KiB"})
    assert s == a and s is not a
    assert as_options({"devices": ["cpu"], "min_bytes": 65536}).min_bytes == 65536


def test_a_cached_value_never_stands_for_an_equal_value_of_another_type():
    assert as_options({"min_bytes": 1}).min_bytes == 1  # cached
    # True == 1 and hash(True) == hash(1), but True is refused, at every call.
    for _ in range(2):
        with pytest.raises(TypeError, match="min_bytes must be an int .* got bool"):
            as_options({"min_bytes": True})
    with pytest.raises(TypeError, match="min_bytes must be an int"):
        as_options({"min_bytes": 1.0})  # 1.0 == 1 too


def test_bad_options_raise_at_every_call_and_unhashable_values_are_not_cached():
    for _ in range(2):
        with pytest.raises(ValueError, match="stream must be"):
            as_options({"stream": "gpu"})
    given = {"devices": ["cpu"], "store_dtype": None, "prefetch_bytes": [1]}
    for _ in range(2):
        with pytest.raises(TypeError, match="prefetch_bytes"):
            as_options(given)


def test_a_pool_given_in_a_dict_is_put_back_on_the_options_and_never_kept_by_the_cache():
    pool, other = co.HostPool(), co.HostPool()
    a = as_options({"devices": ["cpu"], "pool": pool})
    b = as_options({"devices": ["cpu"], "pool": other})  # the same entry, another pool
    assert a.pool is pool and b.pool is other and a != b
    assert a == OffloadOptions(devices=["cpu"], pool=pool)
    assert hash(a) == hash(OffloadOptions(devices=["cpu"], pool=pool))
    assert pool_free_key(a) is pool_free_key(b)  # both made from one cached entry
    assert as_options({"devices": ["cpu"], "pool": None}).pool is None
    assert all(made.pool is None for made, _ in _option_cache.MADE_FROM_CALLS.values())
    # Dropped by its caller, the pool goes at once: nothing the cache holds refers to it.
    ref = weakref.ref(pool)
    del a, pool
    assert ref() is None


def test_options_that_do_nothing_warn_at_every_call_site():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        as_options({"store_min_bytes": 4096})
        as_options({"store_min_bytes": 4096})  # another line: warned again
    said = [w for w in caught if "store_min_bytes=4096 without store_dtype does nothing" in str(w.message)]
    assert len(said) == 2 and said[0].lineno != said[1].lineno


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_option_cache, "_MADE_FROM_CALLS_MAX", 4)
    monkeypatch.setattr(_option_cache, "MADE_FROM_CALLS", {})
    for n in range(10):
        assert as_options({"min_bytes": n}).min_bytes == n
        assert co.offload(min_bytes=n, devices=["cpu"]).min_bytes == n
    assert len(_option_cache.MADE_FROM_CALLS) <= 4


def test_a_co_offload_call_makes_its_options_once_per_distinct_arguments(monkeypatch):
    pool = co.HostPool()
    first = co.offload(min_bytes="1KiB", stream="compute", devices=["cpu"], pool=pool)
    made = []
    real = OffloadOptions.__post_init__
    monkeypatch.setattr(OffloadOptions, "__post_init__", lambda self: made.append(1) or real(self))
    again = co.offload(min_bytes="1KiB", stream="compute", devices=["cpu"], pool=pool)
    assert made == []  # nothing checked again
    want = OffloadOptions(min_bytes=1024, stream="compute", devices=["cpu"], pool=pool)
    assert again.options == first.options == want and again.options is not first.options
    # The context reads its options through ctx.options; devices and pool are resolved.
    assert (again.min_bytes, again.stream, again.on_full, again.devices) == (1024, "compute", "keep", ("cpu",))
    assert again.pool is pool and co.offload(devices=["cpu"]).pool is co.default_pool()
    # By position and by name are other entries; each is checked on its own (the options after
    # min_bytes by position are deprecated, and such a call is never cached: it warns every time).
    with pytest.warns(DeprecationWarning, match="after min_bytes by position are deprecated"):
        assert co.offload(1024, "compute", ["cpu"], pool).options == want
    assert co.offload(1024, stream="compute", devices=["cpu"], pool=pool).options == want
    with pytest.raises(TypeError, match="got min_bytes both by position and by keyword"):
        co.offload(1024, min_bytes=1024)
    # A pool that is no pool still raises on a cached entry.
    with pytest.raises(TypeError, match="pool must be a ckpt_offload.HostPool"):
        co.offload(min_bytes="1KiB", stream="compute", devices=["cpu"], pool="pool")
    # A value equal to a cached one but of another type is checked on its own.
    co.offload(measure_error=False, devices=["cpu"])
    with pytest.raises(TypeError, match="measure_error must be True or False"):
        co.offload(measure_error=0, devices=["cpu"])


def test_a_context_made_from_cached_options_offloads_as_the_first():
    pool = co.HostPool(pinned=False)
    x = torch.randn(64, 64, requires_grad=True)
    for _ in range(2):
        with co.offload(min_bytes=0, devices=["cpu"], pool=pool) as ctx:
            y = torch.tanh(x)
        y.sum().backward()
        torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)
        x.grad = None
        assert ctx.stats()["tensors_offloaded"] == 1 and ctx.stats()["bytes_offloaded"] == 64 * 64 * 4


def test_native_packer_options_are_made_once_per_cached_options_whatever_their_pool():
    given = {"devices": ["cpu"], "min_bytes": 4096, "stream": "compute"}
    a, b = as_options({**given, "pool": co.HostPool()}), as_options({**given, "pool": co.HostPool()})
    native = options_module.native_packer_options(a)
    assert options_module.native_packer_options(b) is native  # kept on their shared pool-free options
    assert options_module.native_packer_options(a.replace(min_bytes=0)).min_bytes == 0
    assert (native.min_bytes, native.side_stream) == (4096, False)
    with pytest.raises(TypeError, match="Packer: missing option 'offload_cpu'"):
        co._C.PackerOptions(min_bytes=0)
    # A Packer made from them packs as one made from the keywords.
    packer = co._C.Packer(native, co.HostPool(pinned=False)._impl)
    hooks = co._C.Hooks(packer)
    x = torch.randn(64, 64, requires_grad=True)
    hooks.enter()
    y = torch.tanh(x)
    hooks.exit()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)
    assert packer.stats()["tensors_offloaded"] == 1


def test_pool_free_key_is_the_options_without_their_pool_made_once():
    pool = co.HostPool()
    o = OffloadOptions(devices=["cpu"], pool=pool)
    key = pool_free_key(o)
    assert key == o.replace(pool=None) and key.pool is None
    assert pool_free_key(o) is key
    assert pool_free_key(key) is key  # without a pool: itself
    # A cache, not a field: equality, hashing, the dict form and a copy are unchanged.
    same = OffloadOptions(devices=["cpu"], pool=pool)
    assert o == same and hash(o) == hash(same)
    assert "_pool_free_key" not in o.to_dict() and o.replace(min_bytes=1).pool is pool


def test_devices_that_select_a_device_are_checked_once(monkeypatch):
    calls = []
    real = options_module.usable_device_types
    monkeypatch.setattr(options_module, "_offloading_devices", set())
    monkeypatch.setattr(options_module, "usable_device_types", lambda: calls.append(1) or real())
    for _ in range(3):
        check_offloads_something(("cpu",), "co.checkpoint(offload=...)")
    assert len(calls) == 1
    # One that selects nothing here is checked (and warned about, once per call site) every time.
    if "cuda" not in real():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_offloads_something(("cuda",), "test-route-a")
            check_offloads_something(("cuda",), "test-route-b")
        assert sum("selects no device" in str(w.message) for w in caught) == 2
        assert ("cuda",) not in options_module._offloading_devices


def test_tensors_only_by_position_go_to_torchs_checkpoint_as_they_are():
    f = nn.Linear(4, 4)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    run, tensors = checkpointing._as_positional(f, (x, y), {})
    assert run is f and tensors[0] is x and tensors[1] is y
    seen = []
    run, tensors = checkpointing._as_positional(lambda a: a * 2, (x,), {}, before=lambda: seen.append(1))
    assert torch.equal(run(*tensors), x * 2) and seen == [1]
    # Anything else -- a keyword, a container, a non-tensor -- goes through the flatten.
    echo = lambda *a, **k: (a, k)  # noqa: E731
    for args, kwargs, n in (((x,), {"b": y}, 2), (([x, y],), {}, 2), ((x, 3), {}, 1)):
        run, tensors = checkpointing._as_positional(echo, args, kwargs)
        assert run is not echo and len(tensors) == n and all(isinstance(t, torch.Tensor) for t in tensors)
        a, k = run(*tensors)
        assert repr((a, k)) == repr((args, kwargs))  # put back where they were


@pytest.mark.parametrize("offload", [False, CPU, "options"])
def test_gradients_match_through_the_fast_paths(offload):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    want = dict(grads_of(model), x=x.grad.clone())
    model.zero_grad(set_to_none=True)
    x.grad = None
    opts = OffloadOptions(**CPU) if offload == "options" else offload
    for _ in range(2):  # the second call reads every cache the first one filled
        co.checkpoint(model, x, offload=opts).sum().backward()
        assert_bit_identical(want, dict(grads_of(model), x=x.grad.clone()))
        model.zero_grad(set_to_none=True)
        x.grad = None


def test_options_pickle_without_their_caches():
    pool = co.HostPool()
    o = OffloadOptions(devices=["cpu"], min_bytes="64KiB", pool=pool)
    hash(o), pool_free_key(o)  # fill both caches
    assert "_hash" in o.__dict__ and "_pool_free_key" in o.__dict__
    state = o.__getstate__()
    assert "_hash" not in state and "_pool_free_key" not in state  # a string hashes otherwise elsewhere
    p = OffloadOptions(devices=["cpu"], min_bytes=65536, pool=pool)
    assert hash(o) == hash(p) == hash(tuple(getattr(p, k) for k in options_module.OFFLOAD_KEYS))


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_a_block_that_raises_leaves_the_routes_context_idle(error):
    # The route enters and exits its shared context itself (not through `with`): a raise inside
    # torch's checkpoint must still exit it, and the next call must work as the first.
    pool = co.HostPool(pinned=False)
    opts = OffloadOptions(pool=pool, **CPU)

    def block(x):
        y = torch.tanh(x)
        if flag:
            raise error("from the block")
        return y

    x = torch.randn(4, 8, requires_grad=True)
    flag = True
    with pytest.raises(error, match="from the block"):
        co.checkpoint(block, x, offload=opts)
    ctx = checkpointing.context_for(opts)
    assert not ctx.active and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    flag = False
    co.checkpoint(block, x, offload=opts).sum().backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)
    assert checkpointing.context_for(opts) is ctx and ctx.stats()["tensors_offloaded"] >= 1


def test_a_full_pool_raises_at_the_routes_exit_and_backward_still_works():
    # on_full="raise" with batching: the batch's flush at the route's exit raises PoolFullError
    # (its tensors kept on the device), as it does at a `with co.offload()` exit.
    pool = co.HostPool(pinned=False, max_bytes=4096, segment_bytes=4096)
    opts = OffloadOptions(pool=pool, on_full="raise", batch_below=64 * 1024, batch_bytes=64 * 1024, **CPU)
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(co.PoolFullError):
        co.checkpoint(torch.exp, x, offload=opts)
    assert not checkpointing.context_for(opts).active


# Values of each option, valid and not, of the types a call may mix up (1 and True, 1.0; a list,
# a tuple, a set; a string where a number goes).
_VALUES = {
    "min_bytes": [0, 1, 4096, True, 1.0, "4KiB", "4 KiB", -1, None],
    "stream": ["side", "compute", "gpu", 1, None],
    "devices": [["cpu"], ("cpu",), {"cpu"}, "cpu", None, [1], ["cpu", "cpu"], [torch.device("cpu")]],
    "on_full": ["keep", "raise", "drop", True],
    "batch_below": [0, 64, "1KiB", False, 2.0],
    "measure_error": [False, True, 0, 1],
    "store_dtype": [None, torch.bfloat16, "bf16", torch.int8, "fp8"],
}


def _outcome(make):
    """What a call gives: its options, or the type and message of what it raised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make()
    except (TypeError, ValueError) as e:
        return (type(e), str(e))


@settings(max_examples=hypothesis_examples(60), deadline=None)
@given(data=st.data())
def test_property_cached_calls_give_what_an_uncached_call_gives(data):
    # Any mix of option values, by keyword, with or without a pool, then the same call with one
    # value swapped for another of the same option (often one that compares equal: 1 and True, a
    # list and a tuple): every call, first or served by the cache, gives what OffloadOptions
    # itself gives, options or error.
    names = data.draw(st.lists(st.sampled_from(sorted(_VALUES)), unique=True, min_size=1, max_size=4), label="names")
    kwargs = {n: data.draw(st.sampled_from(_VALUES[n]), label=n) for n in names}
    if data.draw(st.booleans(), label="pool"):
        kwargs["pool"] = co.HostPool(pinned=False)
    swapped = data.draw(st.sampled_from(names), label="swapped")
    variant = {**kwargs, swapped: data.draw(st.sampled_from(_VALUES[swapped]), label="swapped value")}
    for call in (kwargs, variant, kwargs, variant):
        want = _outcome(lambda call=call: OffloadOptions(**call))
        got = _outcome(lambda call=call: options_module.from_arguments("co.offload()", (), call))
        assert got == want
        if isinstance(want, OffloadOptions):
            assert got.pool is want.pool and hash(got) == hash(want)
        got = _outcome(lambda call=call: as_options(dict(call)))
        if isinstance(want, OffloadOptions):
            assert got == want and got.pool is want.pool
        else:  # as_options names its argument first
            assert got[0] is want[0] and got[1].endswith(want[1])
