"""What a new user's first mistakes get: a typo named with its correction on every public entry
point, options that would do nothing warned with what makes them work, and clear errors for
impossible values (sizes, caps, bandwidths, paths, contexts used out of order)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

import ckpt_offload as co
from ckpt_offload._args import parse_bytes


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=64
    )
    return transformers.LlamaForCausalLM(config)


def _blocks():
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])


# One call per public entry point, each with one misspelled keyword: (route, call, the right name).
TYPOS = {
    "offload": (lambda: co.offload(min_byte=1), "min_bytes"),
    "offload_tensor": (lambda: co.offload_tensor(torch.ones(4), strem="side"), "stream"),
    "OffloadOptions": (lambda: co.OffloadOptions(mni_bytes=1), "min_bytes"),
    "checkpoint": (
        lambda: co.checkpoint(lambda x: x * 2, torch.ones(2, requires_grad=True), use_reentrnt=False),
        "use_reentrant",
    ),
    "checkpoint_sequential": (
        lambda: co.checkpoint_sequential(list(_blocks()), 2, torch.ones(2, 4), use_reentrnt=False),
        "use_reentrant",
    ),
    "apply": (lambda: co.apply(_blocks(), every_n_layer=2), "every_n_layers"),
    "HostPool": (lambda: co.HostPool(max_byte=1 << 20), "max_bytes"),
    "profile": (lambda: co.profile(record_shape=False), "record_shapes"),
    "selective_offload_context": (
        lambda: co.selective_offload_context(lambda ctx, op, *a, **k: None, allow_cache_entry_mutaton=True),
        "allow_cache_entry_mutation",
    ),
    "plan": (lambda: co.plan(_blocks(), lambda m: None, budgt="1MiB"), "budget"),
    "hf.enable": (lambda: co.hf.enable(_tiny_llama(), every_n_layer=2), "every_n_layers"),
    "hf.disable": (lambda: co.hf.disable(_tiny_llama(), modle=1), "model"),
    "hf.OffloadCheckpointCallback": (lambda: co.hf.OffloadCheckpointCallback(every_n_layer=2), "every_n_layers"),
    "hf.OffloadCallback": (lambda: co.hf.OffloadCallback(min_byte=1), "min_bytes"),
    "tiled": (lambda: co.tiled(torch.nn.Linear(4, 4), token_wize=True), "token_wise"),
    "tiled_cross_entropy": (
        lambda: co.tiled_cross_entropy(
            torch.ones(2, 4), torch.nn.Linear(4, 8), torch.zeros(2, dtype=torch.long), ignore_indx=0
        ),
        "ignore_index",
    ),
    "tile": (lambda: co.tile(torch.nn.Linear(4, 4), tokens_wise=True), "token_wise"),
    "TileOptions": (lambda: co.TileOptions(norm=False), "norms"),
}
# Public names that take no keyword a user could misspell, or are results rather than calls.
NOT_CALLED_WITH_KEYWORDS = {
    "keep",
    "default_pool",
    "pinned_available",
    "build_info",
    "synchronize",
    "CheckpointHandle",
    "ProfileReport",
    "Plan",
    "PoolFullError",
    "SpillError",
    "hf.HFCheckpointHandle",
    "hf.HFCheckpointFunction",
    "Tiled",
    "TileHandle",
}  # made by co.tiled and co.tile


def _public_callables():
    names = [n for n in co.__all__ if callable(getattr(co, n))]
    pytest.importorskip("transformers")
    names += [f"hf.{n}" for n in co.hf.__all__ if callable(getattr(co.hf, n))]
    return names


def test_every_public_entry_point_is_walked():
    missing = sorted(set(_public_callables()) - set(TYPOS) - NOT_CALLED_WITH_KEYWORDS)
    assert not missing, f"public entry points without a misspelled-keyword case: {missing}"


@pytest.mark.parametrize("route", sorted(TYPOS))
def test_a_misspelled_keyword_names_the_right_one(route):
    if route.startswith("hf."):
        pytest.importorskip("transformers")
    call, right = TYPOS[route]
    with pytest.raises(TypeError, match=rf"did you mean '?{right}'?"):
        call()


def test_the_signatures_still_show_the_real_parameters():
    # The wrappers that add "did you mean" keep help() and inspect honest.
    assert "min_bytes" in inspect.signature(co.OffloadOptions).parameters
    assert "max_bytes" in inspect.signature(co.HostPool).parameters
    assert "budget" in inspect.signature(co.plan).parameters


# --- options that would do nothing ------------------------------------------------------------


def _warnings_of(make):
    from ckpt_offload import _warn

    _warn._warned_sites.clear()  # once per call site: every case here calls from the same line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"measure_error": True}, "measure_error=True without store_dtype does nothing"),
        ({"store_min_bytes": "1KiB"}, "store_min_bytes=1024 without store_dtype does nothing"),
        ({"stream": "compute", "prefetch_bytes": "1MiB"}, "does nothing with stream='compute'"),
    ],
)
def test_an_option_without_effect_warns_with_the_fix(kwargs, says):
    got = _warnings_of(lambda: co.offload(devices=["cpu"], **kwargs))
    assert any(says in m for m in got), got
    # ... and with what makes it work, it is quiet.
    fixed = dict(kwargs, store_dtype=torch.bfloat16) if "stream" not in kwargs else dict(kwargs, stream="side")
    assert not [m for m in _warnings_of(lambda: co.offload(devices=["cpu"], **fixed)) if "does nothing" in m]


def test_the_too_small_warning_does_not_offer_batching_as_the_rescue():
    x = torch.randn(16, requires_grad=True)

    def run():
        with co.offload(devices=["cpu"], min_bytes="1MiB", batch_below="2MiB", batch_bytes="4MiB") as ctx:
            y = (x * x).sum()
        y.backward()
        return ctx

    got = [m for m in _warnings_of(run) if "offloaded none" in m]
    assert got, "the context offloaded nothing and should say so"
    assert "lower it" in got[0] and "never offloaded, batched or not" in got[0], got[0]
    # What the warning proposes does offload: min_bytes lowered.
    with co.offload(devices=["cpu"], min_bytes=0) as ctx:
        y = (x * x).sum()
    y.backward()
    assert ctx.stats()["tensors_offloaded"] > 0


def test_store_dtype_takes_the_names_lossy_takes():
    assert co.OffloadOptions(store_dtype="bf16").store_dtype is torch.bfloat16
    assert co.OffloadOptions(store_dtype="fp8").store_dtype is torch.float8_e4m3fn
    assert co.OffloadOptions(store_dtype="float16").store_dtype is torch.float16
    with pytest.raises(ValueError, match="store_dtype: unknown name 'int8'"):
        co.OffloadOptions(store_dtype="int8")


def test_exit_of_a_context_never_entered_raises_a_second_exit_does_not():
    ctx = co.offload(devices=["cpu"])
    with pytest.raises(RuntimeError, match="never entered"):
        ctx.__exit__(None, None, None)
    with ctx:
        pass
    ctx.__exit__(None, None, None)  # after a real exit: nothing to do, as documented


# --- impossible values --------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0.3B", "0.5", "1.0001KB"])
def test_a_fraction_of_a_byte_is_refused_not_made_zero(value):
    with pytest.raises(ValueError, match="min_bytes"):
        co.OffloadOptions(min_bytes=value)


def test_whole_bytes_written_with_a_fraction_are_read():
    assert parse_bytes("x", "1.5KiB") == 1536
    assert parse_bytes("x", "0.1KB") == 100  # exact, not 100.00000000000001 -> refused
    assert co.OffloadOptions(min_bytes="2.0B").min_bytes == 2


@pytest.mark.parametrize("value", [-1, 0, "1KiB"])
def test_a_pool_cap_below_the_minimum_says_the_real_minimum(value):
    with pytest.raises(ValueError, match="below the minimum of 4096 bytes"):
        co.HostPool(max_bytes=value, pinned=False)


def test_plan_refuses_levels_it_does_not_build_and_negative_bandwidth():
    with pytest.raises(ValueError, match="levels must be <= 3"):
        co.plan(_blocks(), lambda m: None, budget="1MiB", levels=5)
    with pytest.raises(ValueError, match="bandwidth must be bytes per second >= 0, got -1"):
        co.plan(_blocks(), lambda m: None, budget="1MiB", bandwidth=-1)


def test_profile_report_save_to_a_folder_it_cannot_make_names_the_folder(tmp_path):
    model = torch.nn.Linear(8, 8)
    with co.profile(model) as prof:
        with co.offload(devices=["cpu"], min_bytes=0):
            y = model(torch.randn(4, 8, requires_grad=True)).sum()
        y.backward()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"ProfileReport.save: cannot write into the folder .*file/sub"):
        prof.save(str(blocker / "sub"))


def _cli(*args):
    # Run from outside the source tree, whose ckpt_offload/ (without the built extension when the
    # package is installed) would shadow the installed one.
    return subprocess.run(
        [sys.executable, "-m", "ckpt_offload", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tempfile.gettempdir(),
    )


def test_cli_byte_arguments_take_size_strings_and_refuse_fractions(tmp_path):
    from ckpt_offload.cli._common import _size

    assert _size("64KiB") == 65536 and _size("4096") == 4096
    r = _cli("demo", "--min-bytes", "0.3B")
    assert r.returncode == 2 and "not a whole number of bytes" in r.stderr, r.stderr
    r = _cli("demo", "--min-bytes", "lots")
    assert r.returncode == 2 and "a size such as '64KiB'" in r.stderr, r.stderr


def test_cli_script_with_size_is_refused(tmp_path):
    script = tmp_path / "f.py"
    script.write_text("def step():\n    pass\n")
    for command in (["profile"], ["plan", "--budget", "1MiB"]):
        r = _cli(*command, "--script", f"{script}:step", "--size", "tiny")
        assert r.returncode == 2 and "drop --size" in r.stderr, r.stderr


def test_heartbeat_shows_a_long_step_is_running_and_how_long_it_took():
    import io
    import threading

    from ckpt_offload.cli._common import heartbeat

    beat = threading.Event()

    class Stream(io.StringIO):
        def write(self, text):
            if text.startswith("  ... "):
                beat.set()
            return super().write(text)

    out = Stream()
    with heartbeat("planning the model", every=0.01, stream=out):
        assert beat.wait(30), "no progress line while the step ran"
    lines = out.getvalue().splitlines()
    assert lines[0] == "planning the model ..." and lines[-1].startswith("  done in "), lines
    assert all(line.endswith(" s") for line in lines[1:-1]), lines
