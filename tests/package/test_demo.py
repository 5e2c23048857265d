"""The `python -m ckpt_offload {demo,info}` command line and the built-in TinyTransformer."""

import json
import subprocess
import sys

import pytest
import torch

import ckpt_offload as co
from ckpt_offload.demo import runner as demo
from ckpt_offload.demo.report import format_report
from ckpt_offload.__main__ import main
from ckpt_offload.demo.model import CONFIGS, TinyTransformer, lm_loss, make_batch, make_config

TINY_DEMO = ["demo", "--size", "tiny", "--steps", "2", "--device", "cpu"]


def _gpu():
    return demo.gpu_usable()


# ---------------------------------------------------------------- demo, in process


def test_demo_cpu_prints_match_and_writes_json(tmp_path, capsys):
    rc = main(TINY_DEMO + ["--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gradients on step 1: bit-identical" in out
    assert "losses on all 2 steps: bit-identical" in out
    # On CPU the report must say what its numbers mean there.
    assert "No GPU was used" in out and "not GPU behaviour" in out

    path = tmp_path / "out" / "demo.json"
    assert f"wrote {path}" in out
    r = json.loads(path.read_text())
    for key in (
        "date",
        "build_info",
        "config",
        "cpu_only",
        "note",
        "grads_match",
        "losses_match",
        "activation_bytes_on_device_baseline",
        "activation_bytes_on_device_offload",
        "bytes_offloaded_to_pool",
        "time_ratio",
        "pool",
        "baseline",
        "offload",
    ):
        assert key in r, key
    assert r["grads_match"] is True and r["losses_match"] is True
    assert r["cpu_only"] is True
    assert "cuda_compiled" in r["build_info"]
    assert r["config"]["size"] == "tiny" and r["config"]["steps"] == 2
    assert r["bytes_offloaded_to_pool"] > 0
    assert r["activation_bytes_on_device_offload"] < r["activation_bytes_on_device_baseline"]
    pool = r["pool"]
    for key in ("peak_bytes_in_use", "bytes_reserved", "num_segments", "num_backend_allocs", "backend"):
        assert key in pool, key
    assert pool["peak_bytes_in_use"] > 0
    assert pool["bytes_in_use"] == 0  # every offloaded block came back after backward
    assert len(r["baseline"]["losses"]) == len(r["offload"]["losses"]) == 2
    assert r["baseline"]["losses"] == r["offload"]["losses"]
    assert isinstance(r["time_ratio"], float) and r["time_ratio"] > 0
    # Every saved activation is accounted for: kept + offloaded + deduplicated == baseline.
    s1 = r["offload"]["stats_first_step"]
    assert (
        r["activation_bytes_on_device_offload"] + s1["bytes_offloaded"] + s1["bytes_deduplicated"]
        == r["activation_bytes_on_device_baseline"]
    )


@pytest.mark.parametrize("stream", ["side", "compute"])
def test_run_demo_returns_match_everything_offloaded(stream):
    r = demo.run_demo(size="tiny", steps=2, device="cpu", min_bytes=0, stream=stream)
    assert r["grads_match"], r["grad_mismatches"]
    assert r["losses_match"]
    assert r["num_grads_compared"] == len(list(TinyTransformer(**CONFIGS["tiny"].model_kwargs()).parameters()))
    # min_bytes=0: no activation stays behind.
    assert r["activation_bytes_on_device_offload"] == 0
    assert r["bytes_offloaded_to_pool"] > 0
    assert "kept on the device" in format_report(r)


def test_demo_one_step_has_no_time_ratio(capsys):
    rc = main(["demo", "--size", "tiny", "--steps", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "n/a (one step)" in out


def test_demo_exit_status_is_1_when_gradients_differ(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_compare_grads", lambda a, b: (False, ["head.weight"], 1.0))
    rc = main(TINY_DEMO)
    out = capsys.readouterr().out
    assert rc == 1
    assert "MISMATCH" in out and "head.weight" in out


def test_demo_leads_with_the_recipe_and_the_bandwidth_arithmetic():
    r = demo.run_demo(size="tiny", steps=2, device="cpu", min_bytes=0)
    c = CONFIGS["tiny"]
    rc = r["recipe"]
    assert rc["grads_match"] and rc["losses_match"]
    # checkpointed blocks offload exactly their inputs: layers x batch x seq x dim float32
    block_input = c.batch * c.seq * c.dim * 4
    assert rc["bytes_offloaded_per_step"] == rc["bytes_reloaded_per_step"] == c.layers * block_input
    assert rc["device_saved_peak_bytes"] <= c.layers * block_input
    assert rc["pool_bytes_in_use_after"] == 0
    # offloading every saved tensor copies many times more
    assert r["bytes_offloaded_to_pool"] > 10 * rc["bytes_offloaded_per_step"]
    bw = r["bandwidth_arithmetic"]
    assert bw["bandwidth_source"].startswith("measured by co.profile") and "CPU memcpy" in bw["bandwidth_source"]
    for name, compute in (("offload_everything", r["baseline"]), ("recipe", r["checkpoint"])):
        a = bw[name]
        assert a["copy_s"] == pytest.approx(
            a["d2h_bytes"] / (bw["d2h_gbps"] * 1e9) + a["h2d_bytes"] / (bw["h2d_gbps"] * 1e9)
        )
        assert a["compute_s"] == compute["median_step_s"]
        assert a["copy_over_compute"] == pytest.approx(a["copy_s"] / a["compute_s"])
    assert bw["offload_everything"]["d2h_bytes"] == r["bytes_offloaded_to_pool"]
    assert rc["time_ratio_vs_checkpoint"] == pytest.approx(
        r["recipe_run"]["median_step_s"] / r["checkpoint"]["median_step_s"]
    )
    text = format_report(r)
    order = [
        text.index(k)
        for k in (
            "recommended: checkpointed blocks",
            "contrast: offload every saved tensor",
            "bandwidth arithmetic",
            "offload everything, in detail",
        )
    ]
    assert order == sorted(order)
    assert "co.apply(model, offload=True)" in text and "bit-identical to the baseline" in text


def test_demo_exit_status_is_1_when_the_recipe_gradients_differ(monkeypatch, capsys):
    real, calls = demo._compare_grads, []

    def compare(a, b):  # the first comparison is offload-everything's; the recipe's come after
        calls.append(1)
        return real(a, b) if len(calls) == 1 else (False, ["head.weight"], 1.0)

    monkeypatch.setattr(demo, "_compare_grads", compare)
    rc = main(TINY_DEMO)
    out = capsys.readouterr().out
    assert rc == 1 and len(calls) == 3
    assert "gradients on step 1 and every loss: MISMATCH" in out


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and a CUDA build of ckpt_offload")
def test_demo_cuda_recipe_next_to_offload_everything():
    r = demo.run_demo(size="tiny", steps=3, device="cuda")
    rc = r["recipe"]
    assert rc["grads_match"] and rc["losses_match"]
    assert rc["max_memory_allocated"] > 0 and rc["checkpoint_max_memory_allocated"] > 0
    assert rc["time_ratio_vs_checkpoint"] > 0 and rc["offload_everything_ratio_vs_baseline"] > 0
    text = format_report(r)
    assert "torch.cuda.max_memory_allocated: baseline" in text and "recommended" in text


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and a CUDA build of ckpt_offload")
def test_demo_cuda(tmp_path):
    r = demo.run_demo(size="tiny", steps=2, device="cuda", min_bytes=0)
    assert r["grads_match"], r["grad_mismatches"]
    assert r["losses_match"]
    assert r["cpu_only"] is False
    assert r["baseline"]["max_memory_allocated"] > 0 and r["offload"]["max_memory_allocated"] > 0
    assert r["bytes_offloaded_to_pool"] > 0
    assert "max_memory_allocated" in format_report(r)


# ---------------------------------------------------------------- info and arguments


def test_info_subprocess(tmp_path):
    # Run where this test imported ckpt_offload from (installed, or built in place), not from
    # whatever ./ckpt_offload the working directory holds.
    import os

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(co.__file__)))
    p = subprocess.run(
        [sys.executable, "-m", "ckpt_offload", "info"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert "cuda_compiled" in p.stdout
    assert "default_pool" in p.stdout and "bytes_reserved" in p.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["demo", "--steps", "two"], "argument --steps: expected a positive integer"),
        (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["demo", "--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["demo", "--min-bytes", "-1"], "argument --min-bytes: expected a number of bytes or a size such as '64KiB'"),
        (["demo", "--stream", "fast"], "argument --stream: invalid choice"),
        ([], "required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "usage:" in err


@pytest.mark.skipif(_gpu(), reason="checks the error given when no GPU is usable")
def test_device_cuda_without_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--device", "cuda", "--size", "tiny"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: no usable CUDA GPU" in err and "--device cpu" in err


def test_help_mentions_cpu_meaning(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--steps" in out and "--out DIR" in out and "not GPU behaviour" in out


# ---------------------------------------------------------------- TinyTransformer


def _tiny(seed=0, **kw):
    return TinyTransformer(**make_config("tiny", **kw).model_kwargs(), seed=seed)


def test_tiny_transformer_is_deterministic_given_seed():
    torch.manual_seed(1)
    a = _tiny(seed=123)
    torch.manual_seed(2)  # a different global RNG state must not matter
    b = _tiny(seed=123)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = _tiny(seed=124)
    assert not all(torch.equal(sa[k], c.state_dict()[k]) for k in sa)

    # Same seed for dropout: same loss and same gradients, bit for bit.
    tokens = make_batch(make_config("tiny"), seed=5)
    results = []
    for model in (a, b):
        model.train()
        torch.manual_seed(7)
        loss = lm_loss(model, tokens)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(x, y) for x, y in zip(results[0][1], results[1][1]))


def test_seeded_init_leaves_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    _tiny(seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_tiny_transformer_shapes_and_errors():
    cfg = make_config("tiny")
    model = _tiny().eval()
    tokens = make_batch(cfg, batch=3, seed=0)
    assert tokens.shape == (3, cfg.seq + 1) and tokens.dtype == torch.int64
    assert model(tokens[:, :-1]).shape == (3, cfg.seq, cfg.vocab)
    assert model(tokens[:, :5]).shape == (3, 5, cfg.vocab)  # shorter than seq is fine
    with torch.no_grad():
        assert torch.equal(model(tokens[:, :-1]), model(tokens[:, :-1]))  # eval: no dropout
    with pytest.raises(ValueError, match="longer than seq"):
        model(tokens)
    with pytest.raises(ValueError, match="divisible by heads"):
        TinyTransformer(vocab=10, dim=10, layers=1, heads=3, seq=4)
    with pytest.raises(ValueError, match="size must be one of"):
        make_config("huge")
    with pytest.raises(TypeError, match="unknown field"):
        make_config("tiny", width=3)
    assert make_config("medium", batch=2).batch == 2


def test_tiny_transformer_under_offload_matches():
    """The model reused by benchmarks works under co.offload on CPU (bit-identical grads)."""
    cfg = make_config("tiny")
    tokens = make_batch(cfg, seed=1)
    grads = []
    for use_offload in (False, True):
        model = _tiny(seed=0)
        torch.manual_seed(0)
        if use_offload:
            with co.offload(devices=["cpu"], min_bytes=0, pool=co.HostPool()) as ctx:
                loss = lm_loss(model, tokens)
        else:
            loss = lm_loss(model, tokens)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert ctx.stats()["tensors_offloaded"] > 0
    assert all(torch.equal(x, y) for x, y in zip(*grads))


def test_demo_reports_device_peak_against_total_and_time_spread(tmp_path, capsys):
    rc = main(["demo", "--size", "small", "--steps", "3", "--device", "cpu", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads((tmp_path / "demo.json").read_text())
    peak, total = r["device_saved_peak_bytes"], r["saved_bytes_total"]
    assert 0 < peak <= 0.6 * total, (peak, total)
    from ckpt_offload.profiling.summary import saved_line

    assert f"saved activations on the device at their peak (step 1, co.profile): {saved_line(peak, total)}" in out
    assert r["time_ratio_min"] <= r["time_ratio"] <= r["time_ratio_max"]
    assert f"(min {r['time_ratio_min']:.2f}x, max {r['time_ratio_max']:.2f}x over steps)" in out
    assert r["config"]["prefetch_bytes"] is None


def test_demo_prefetch_bytes_option_reaches_the_context(monkeypatch):
    seen = {}
    real = demo.offload

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(demo, "offload", spy)
    assert main(TINY_DEMO + ["--prefetch-bytes", "1234", "--no-progress"]) == 0
    assert seen["prefetch_bytes"] == 1234


def test_tiny_demo_at_the_default_min_bytes_says_why_the_recipe_copies_nothing():
    r = demo.run_demo(size="tiny", steps=1, device="cpu")  # block inputs of 64 KiB, under the default 256 KiB
    assert r["recipe"]["bytes_offloaded_per_step"] == 0 and r["recipe"]["inputs_under_min_bytes"] > 0
    text = format_report(r)
    assert "copied nothing: at size 'tiny' each block's input is under min_bytes=262144" in text, text
    assert "--min-bytes 0 shows its copies" in text


def test_a_warning_during_a_progress_bar_is_printed_above_it():
    import io
    import warnings

    pytest.importorskip("tqdm")
    from tqdm import tqdm

    from ckpt_offload.demo.runner import _warnings_above

    out = io.StringIO()
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for i in _warnings_above(tqdm(range(3), desc="run", file=out, ascii=True)):
            if i == 1:
                warnings.warn("a library warning", stacklevel=1)
    assert warnings.showwarning is before  # restored after the bar
    lines = out.getvalue().replace("\r", "\n").splitlines()
    warned = [line for line in lines if "a library warning" in line]
    assert warned and all("run:" not in line and "it/s" not in line for line in warned), lines


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ckpt_offload {co.__version__}"


def test_info_says_whether_default_offload_does_anything(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    if co.build_info()["gpu_available"]:
        assert "co.offload() with defaults here: offloads CUDA tensors" in out
    else:
        assert "co.offload() with defaults here: offloads NOTHING" in out and "devices=['cpu']" in out
