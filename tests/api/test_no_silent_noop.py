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
    with pytest.raises(
        TypeError,
        match=r"OffloadCheckpointCallback: \['devices'\] is a co.offload option; pass it "
        r"inside offload=",
    ):
        co.hf.OffloadCheckpointCallback(devices=["cpu"])
    with pytest.raises(
        TypeError,
        match=r"unknown keyword argument 'bogus'; its options are: every_n_layers, "
        r"offload, tile, use_reentrant, preserve_rng_state",
    ):
        co.hf.OffloadCheckpointCallback(bogus=1)
    with pytest.raises(TypeError, match=r"'evry_n_layers' \(did you mean 'every_n_layers'\?\)"):
        co.hf.OffloadCheckpointCallback(evry_n_layers=2)


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


# -- a context that sees tensors and offloads none of them (Note [Offloaded nothing]) -----------


def _nothing(record):
    return [w for w in record if "offloaded none of them" in str(w.message)]


def test_context_that_offloads_nothing_warns_once_naming_min_bytes_and_the_fix():
    model = nn.Linear(4, 4)  # its saved input: 32 bytes, under the default min_bytes
    ctx = co.offload(devices=["cpu"])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            with ctx:  # the line the warning points at
                y = model(torch.randn(2, 4, requires_grad=True)).sum()
            y.backward()
    ours = _nothing(record)
    assert len(ours) == 1, [str(w.message) for w in record]
    message = str(ours[0].message)
    assert f"under min_bytes={co.DEFAULT_MIN_BYTES}" in message and "kept_by_reason['too_small']" in message
    assert "min_bytes=0" in message  # the fix
    assert ours[0].filename == __file__
    assert ctx.stats()["tensors_offloaded"] == 0


def test_context_that_offloads_something_or_sees_only_parameters_does_not_warn():
    model = nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ctx = co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))
        for _ in range(2):
            with ctx:
                y = model(torch.randn(2, 4, requires_grad=True)).sum()
            y.backward()
        with co.offload(devices=["cpu"]):  # saves nothing at all: nothing to say
            torch.randn(3).sin()
        with co.offload(devices=["cpu"]):  # w * 2 saves no tensor; w is a parameter anyway
            (model.weight * 2).sum()
    assert not _nothing(record), [str(w.message) for w in record]
    assert ctx.stats()["tensors_offloaded"] > 0


def test_checkpoint_route_that_offloads_nothing_warns_at_the_users_line():
    layer = nn.Linear(4, 4)
    # A pool of its own: the shared context of these options is this test's (a context warns once).
    options = {"devices": ["cpu"], "pool": co.HostPool(pinned=False)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            y = co.checkpoint(layer, torch.randn(2, 4, requires_grad=True), offload=options)
            y.sum().backward()
    ours = _nothing(record)
    assert len(ours) == 1, [str(w.message) for w in record]
    assert ours[0].filename == __file__ and "min_bytes" in str(ours[0].message)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CPU tensors in a context offloading 'cuda'")
def test_context_that_sees_only_other_devices_tensors_warns_naming_devices():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ctx = co.offload(devices=["cuda"], min_bytes=0)
        with ctx:
            y = torch.randn(64, 64, requires_grad=True).sin().sum()
        y.backward()
    ours = _nothing(record)
    assert len(ours) == 1 and "devices=['cuda']" in str(ours[0].message)
    assert "devices=['cpu']" in str(ours[0].message)


def test_hooks_disabled_warning_names_the_fix():
    import ckpt_offload.offloading as offload_module

    offload_module._warned_hooks_disabled.clear()
    ctx = co.offload(devices=["cpu"], min_bytes=0)

    def f(x):
        with ctx:
            return (x.sin() * x).sum()

    with pytest.warns(UserWarning, match=r"hooks are disabled here .* run this forward outside the torch.func"):
        torch.func.grad(f)(torch.randn(3))


def test_full_disk_warns_once_per_context_like_a_full_pool(tmp_path):
    from models_for_tests import Chain  # 1 MiB per saved activation

    torch.manual_seed(0)
    model, x = Chain(n=8), torch.randn(512, 512)
    pool = co.HostPool(
        pinned=False, max_bytes=2 << 20, spill_dir=str(tmp_path), spill_max_bytes=2 << 20, spill_file_bytes=1 << 20
    )
    ctx = co.offload(devices=["cpu"], min_bytes=0, pool=pool)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            with ctx:
                y = model(x.requires_grad_())
            y.square().sum().backward()
    full = [w for w in record if "disk tier is full" in str(w.message)]
    assert len(full) == 1, [str(w.message) for w in record]
    message = str(full[0].message)
    kept = ctx.stats()["kept_by_reason"]["disk_full"]
    assert kept > 0 and "kept_by_reason['disk_full']" in message and "spill_max_bytes=2097152" in message
    assert full[0].filename == __file__
    del ctx, pool, y


_ONE_CHANNEL = """
import logging, sys, torch, ckpt_offload as co
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING, format="LOG %(name)s: %(message)s")
pool = co.HostPool(max_bytes=1 << 20, pinned=False)
x = torch.randn(1 << 19, requires_grad=True)
with co.offload(devices=["cpu"], pool=pool, min_bytes=0):
    y = x.sin()
y.sum().backward()
"""


@pytest.mark.parametrize("logging_setup", ["unconfigured", "configured"])
def test_a_warning_prints_once_and_reaches_a_configured_logger(logging_setup, tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _ONE_CHANNEL, logging_setup],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("the host pool is at its cap") == (1 if logging_setup == "unconfigured" else 2), r.stderr
    assert r.stderr.count("UserWarning: co.offload(): the host pool is at its cap") == 1, r.stderr
    assert ("LOG ckpt_offload: co.offload(): the host pool" in r.stderr) == (logging_setup == "configured"), r.stderr


# -- keywords that look like ours ------------------------------------------------------------


def test_checkpoint_keyword_typo_is_an_error_not_an_argument_for_the_function():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"unknown keyword offlaod= \(did you mean offload=\?\)"):
        co.checkpoint(torch.sin, x, offlaod=True)
    with pytest.raises(TypeError, match=r"preserve_rng= \(did you mean preserve_rng_state=\?\)"):
        co.checkpoint(lambda t, **kw: t.sin(), x, preserve_rng=False)
    with pytest.raises(TypeError, match=r"min_bytes= is a co.offload option.*offload=\{'min_bytes'"):
        co.checkpoint(torch.sin, x, min_bytes=0)

    def f(t, offlaod=1, scale=1.0):  # declared by the function: passed on, as torch's checkpoint does
        return t * offlaod * scale

    y = co.checkpoint(f, x, offlaod=3, scale=2.0)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 6.0))


def test_offload_callback_lists_its_options_and_points_every_n_layers_at_the_checkpoint_callback():
    pytest.importorskip("transformers")
    with pytest.raises(
        TypeError,
        match=r"'min_byte' \(did you mean 'min_bytes'\?\); its options are: "
        r"min_bytes, stream, devices, pool, on_full",
    ):
        co.hf.OffloadCallback(min_byte=0)
    with pytest.raises(TypeError, match=r"every_n_layers=.*co.hf.OffloadCheckpointCallback\(every_n_layers="):
        co.hf.OffloadCallback(every_n_layers=2)


_PLAN_QUIETLY = """
import torch, ckpt_offload as co
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
x = torch.randn(32, 64)
plan = co.plan(model, lambda: model(x).sum().backward(), budget="1MiB", offload={"devices": ["cpu"], "min_bytes": 0})
print("planned", len(plan.choices))
"""


@pytest.mark.skipif(
    not torch.version.cuda or torch.cuda.is_available(),
    reason="the noise comes from a CUDA build of torch on a machine without a usable GPU",
)
def test_plan_on_a_cuda_torch_without_a_gpu_prints_no_gpu_probe_noise(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    r = subprocess.run(
        [sys.executable, "-c", _PLAN_QUIETLY],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "planned 4" in r.stdout
    for noise in ("gpuGetDeviceCount", "USDT:", "profiler_start"):
        assert noise not in r.stderr, r.stderr
