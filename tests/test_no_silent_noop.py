"""Routes that would offload nothing say so at the user's own line, once per call site; a pool
cap hit under on_full="keep" warns once per context; misplaced options fail at construction."""
import inspect
import warnings

import pytest
import torch
from torch import nn

import ckpt_offload as co

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a usable GPU")


def _ours(record):
    return [w for w in record if "selects no device with tensors here" in str(w.message)]


@needs_no_gpu
@pytest.mark.parametrize("route", ["offload", "checkpoint", "apply"])
def test_route_that_offloads_nothing_warns_at_the_users_line_once(route):
    def call():
        if route == "offload":
            return co.offload()  # the line the warning must point at
        if route == "checkpoint":
            return co.checkpoint(torch.sin, torch.randn(3, requires_grad=True), offload=True)
        return co.apply(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), offload=True)

    lines = {"offload": "co.offload()", "checkpoint": "co.checkpoint(torch.sin", "apply": "co.apply(nn.Sequential"}
    src, start = inspect.getsourcelines(call)
    expected_line = start + next(i for i, s in enumerate(src) if lines[route] in s)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            result = call()
            if route == "apply":
                result.remove()
    ours = _ours(record)
    assert len(ours) == 1, [str(w.message) for w in record]  # once per call site
    assert ours[0].filename == __file__ and ours[0].lineno == expected_line
    assert "devices=['cpu']" in str(ours[0].message)  # names the fix


def test_devices_cpu_does_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        co.offload(devices=["cpu"])
        co.checkpoint(torch.sin, torch.randn(3, requires_grad=True), offload={"devices": ["cpu"]})
    assert not _ours(record)


def test_pool_cap_hit_under_keep_warns_once_per_context_with_bytes():
    pool = co.HostPool(max_bytes=1 << 20, pinned=False)
    ctx = co.offload(devices=["cpu"], pool=pool, min_bytes=0, on_full="keep")
    x = torch.randn(1 << 19, requires_grad=True)  # 2 MiB: more than the cap
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            with ctx:
                y = x.sin()
            y.sum().backward()
    full = [w for w in record if "at its cap" in str(w.message)]
    assert len(full) == 1, [str(w.message) for w in record]
    message = str(full[0].message)
    kept = ctx.stats()["kept_bytes_by_reason"]["pool_full"]
    assert kept > 0 and "max_bytes" in message and "bytes) stayed on the device" in message
    assert full[0].filename == __file__


def test_pool_cap_not_hit_does_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with co.offload(devices=["cpu"], pool=co.HostPool(pinned=False), min_bytes=0):
            y = torch.randn(100, requires_grad=True).sin()
        y.sum().backward()
    assert not [w for w in record if "at its cap" in str(w.message)]


@pytest.mark.parametrize("key", ["min_bytes", "devices"])
def test_apply_misplaced_offload_option_fails_at_construction(key):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(TypeError, match=rf"co.apply: \['{key}'\] is a co.offload option; pass it inside offload="):
        co.apply(model, offload=True, **{key: 0})
    assert getattr(model, "_ckpt_offload_handle", None) is None


def test_callback_misplaced_offload_option_fails_at_construction():
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match=r"OffloadCheckpointCallback: \['devices'\] is a co.offload option; pass it "
                                        r"inside offload="):
        co.hf.OffloadCheckpointCallback(devices=["cpu"])
    with pytest.raises(TypeError, match="unknown checkpoint keyword"):
        co.hf.OffloadCheckpointCallback(bogus=1)


@needs_no_gpu
def test_callback_that_offloads_nothing_warns_at_construction():
    pytest.importorskip("transformers")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        co.hf.OffloadCheckpointCallback(offload=True)
    ours = _ours(record)
    assert len(ours) == 1 and ours[0].filename == __file__
    assert "OffloadCheckpointCallback(offload=...)" in str(ours[0].message)


def test_callback_with_offload_from_training_arguments_does_not_warn_at_construction():
    pytest.importorskip("transformers")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        co.hf.OffloadCheckpointCallback()  # offload comes from TrainingArguments, checked at on_init_end
    assert not _ours(record)


def test_one_default_for_offload_across_routes():
    pytest.importorskip("transformers")
    defaults = {
        f.__qualname__: inspect.signature(f).parameters["offload"].default
        for f in (co.checkpoint, co.checkpoint_sequential, co.apply, co.hf.enable)
    }
    assert set(defaults.values()) == {False}, defaults
    # The callback's None means "TrainingArguments' offload entry, else that same default".
    cb = co.hf.OffloadCheckpointCallback()
    assert cb._settings(None)[1] is False
