"""benchmarks/overlap.py on CPU, and the Llama-style decoder it runs (benchmarks/llama_decoder.py).

The benchmark measures; these tests check what it reports, never how fast anything ran.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys

import pytest
import torch
from conftest import assert_bit_identical, grads_of
from helpers import REPO_ROOT

import ckpt_offload as co

ROOT = REPO_ROOT
# The benchmarks are scripts next to each other, not a package: import them the way they import
# each other, with benchmarks/ on sys.path.
if os.path.join(ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from llama_decoder import (  # noqa: E402
    DECODER_CONFIGS,
    LlamaBlock,
    LlamaDecoder,
    causal_lm_loss,
    make_decoder_config,
    random_tokens,
)


def _load_overlap():
    spec = importlib.util.spec_from_file_location("overlap_benchmark", os.path.join(ROOT, "benchmarks", "overlap.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One --quick CPU run shared by the report tests (it is the slow part)."""
    overlap = _load_overlap()
    out = tmp_path_factory.mktemp("overlap")
    rc = overlap.main(["--quick", "--device", "cpu", "--no-progress", "--out", str(out)])
    with open(out / "overlap.json") as f:
        report = json.load(f)
    return overlap, rc, out, report


def test_quick_run_writes_every_strategy_row(quick_run):
    overlap, rc, _, report = quick_run
    assert rc == 0
    assert report["mode"] == "cpu" and "NOT GPU" in report["warning"]
    assert report["build_info"]["version"] == co.__version__
    seqs = report["args"]["seq_lens"]
    assert len(seqs) >= 2
    for seq in seqs:
        rows = {r["strategy"]: r for r in report["results"] if r["seq_len"] == seq}
        assert set(rows) == set(overlap.STRATEGIES)
        raw = report["raw_bandwidth"][str(seq)]
        assert raw["d2h_gbps"] > 0 and raw["h2d_gbps"] > 0
        for name, r in rows.items():
            if r["status"] != "ok":
                # Only peers that are missing here, or options still being added, may be absent.
                assert r["status"] == "not installed" or r["status"].startswith("unavailable: "), (name, r["status"])
                assert name not in ("none", "checkpoint", "hf_offload", "co_offload", "co_checkpoint_side_prefetch")
                continue
            assert len(r["step_times_s"]) == report["args"]["steps"]
            assert r["median_step_s"] > 0 and r["ratio_to_checkpoint"] > 0
            assert r["grads"]["vs_none"] is not None
        assert rows["checkpoint"]["ratio_to_checkpoint"] == 1.0
        assert rows["torchtune"]["status"] in ("not installed", "unavailable: OffloadActivations needs a CUDA device")


def test_quick_run_reports_bytes(quick_run):
    overlap, _, _, report = quick_run
    cfg = report["model"]
    batch = report["args"]["batch"]
    for seq in report["args"]["seq_lens"]:
        rows = {r["strategy"]: r for r in report["results"] if r["seq_len"] == seq}
        layer_input = batch * seq * cfg["dim"] * 4  # float32
        # HF-style: save_on_cpu sees each checkpointed layer's positional input, nothing else.
        hf = rows["hf_offload"]["host"]
        assert hf["bytes_requested"] == cfg["layers"] * layer_input
        assert hf["tensors"] == cfg["layers"]
        for name in overlap.OURS:
            r = rows[name]
            if r["status"] != "ok":
                continue
            host = r["host"]
            assert host["kind"].startswith("ckpt_offload pool")
            assert host["bytes_requested"] > 0
            assert host["peak_bytes_reserved"] >= host["bytes_requested"]
            assert host["reserved_over_requested"] >= 1.0
            # The pool keeps its segments: the steps after the first allocate nothing new.
            assert host["backend_allocs_after_first_step"] == 0
            # Bandwidth and hidden fraction come from co.profile() when this build has it.
            bw = r["bandwidth"]
            if bw["method"] == "co.profile()":
                assert bw["d2h_gbps"] > 0 and bw["h2d_gbps"] > 0
                assert 0.0 <= r["hidden_fraction"] <= 1.0 and r["hidden_method"] == "co.profile()"
            else:
                assert bw["d2h_gbps"] is None and bw["note"]
        # co.checkpoint stores each layer's input (and the rotary tables once); co.offload around
        # the whole forward stores every activation: much more.
        ck = rows["co_checkpoint_side_prefetch"]["host"]["bytes_requested"]
        assert ck >= cfg["layers"] * layer_input
        assert rows["co_offload"]["host"]["bytes_requested"] > 2 * ck
        for name in ("none", "checkpoint"):
            assert rows[name]["host"] is None


def test_quick_run_gradients_match_reference(quick_run):
    overlap, _, _, report = quick_run
    for r in report["results"]:
        if r["status"] != "ok":
            continue
        g = r["grads"]
        # Offload and recompute are exact on CPU: every strategy matches no checkpointing bit for bit.
        assert g["vs_none"]["bit_identical"], r["strategy"]
        assert g["vs_none"]["max_abs_diff"] == 0.0
        if r["strategy"] in overlap.OURS or r["strategy"] == "hf_offload":
            assert g["reference"] == overlap.BASELINE[r["strategy"]]
            assert g["vs_reference"]["bit_identical"], r["strategy"]
        assert r["repeatable"]


def test_quick_run_headline_markdown_and_plot(quick_run):
    overlap, _, out, report = quick_run
    per_seq = report["headline"]["per_seq"]
    assert [p["seq_len"] for p in per_seq] == report["args"]["seq_lens"]
    for p in per_seq:
        assert p["ours_overhead"] is not None and p["hf_overhead"] is not None
    assert set(report["headline"]["targets"]) >= {
        "within_3pct_of_checkpoint",
        "bandwidth_at_least_90pct_of_raw",
        "reserved_at_most_1_1x_requested",
        "zero_backend_allocs_after_first_step",
    }
    md = (out / "overlap.md").read_text()
    assert "CPU NUMBERS, NOT GPU NUMBERS" in md
    for seq in report["args"]["seq_lens"]:
        assert f"## seq len {seq}" in md
    for name in overlap.STRATEGIES:
        assert f"| {name} |" in md
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: no overlap.png")
    png = out / "overlap.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_name_the_flag(capsys):
    overlap = _load_overlap()
    with pytest.raises(SystemExit):
        overlap.parse_args(["--strategies", "co_offload,nope"])
    assert "--strategies" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overlap.parse_args(["--device", "cpu", "--seq-lens", "64,x"])
    assert "--seq-lens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overlap.parse_args(["--device", "cpu", "--model", "tiny", "--seq-lens", "99999"])
    assert "max_seq" in capsys.readouterr().err
    args = overlap.parse_args(["--device", "cpu", "--strategies", "co_offload"])
    assert args.strategies == ["none", "checkpoint", "co_offload"]  # the references always run


def test_unsupported_option_is_reported_not_raised(monkeypatch):
    overlap = _load_overlap()
    monkeypatch.setitem(overlap.OUR_OPTIONS, "co_checkpoint_side_prefetch", {"stream": "side", "no_such_key": 1})
    with pytest.raises(overlap.Unavailable, match="unavailable: .*no_such_key"):
        overlap.build_strategy("co_checkpoint_side_prefetch", torch.device("cpu"))


# ---- the Llama-style model --------------------------------------------------------------------


def test_llama_shapes_and_presets():
    cfg = make_decoder_config("tiny")
    model = LlamaDecoder(cfg, seed=0)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == cfg.layers
    assert all(isinstance(layer, LlamaBlock) for layer in model.layers)
    assert model.num_parameters() == cfg.num_parameters()
    tokens = random_tokens(cfg.vocab, batch=3, seq=17, seed=1)
    assert tokens.shape == (3, 18) and tokens.dtype == torch.int64
    logits = model(tokens[:, :-1])
    assert logits.shape == (3, 17, cfg.vocab)
    # grouped-query attention: fewer key/value projections than query heads
    attn = model.layers[0].attn
    assert attn.k_proj.out_features == cfg.kv_heads * cfg.head_dim < attn.q_proj.out_features
    # same seed, same weights; tied embeddings share one tensor
    again = LlamaDecoder(cfg, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    tied = LlamaDecoder(make_decoder_config("tiny", tie_embeddings=True), seed=0)
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.num_parameters() == make_decoder_config("tiny", tie_embeddings=True).num_parameters()
    # causal: the first position's logits do not depend on later tokens
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % cfg.vocab
    assert torch.allclose(model(changed[:, :-1])[:, :5], logits[:, :5], atol=1e-6)
    assert DECODER_CONFIGS["1b"].num_parameters() > 1_000_000_000
    with pytest.raises(ValueError, match="kv_heads"):
        make_decoder_config("tiny", kv_heads=3)
    with pytest.raises(ValueError, match="preset"):
        make_decoder_config("huge")
    with pytest.raises(ValueError, match="max_seq"):
        model(torch.zeros(1, cfg.max_seq + 1, dtype=torch.int64))


def test_llama_apply_offload_gives_bit_identical_grads():
    cfg = make_decoder_config("tiny")
    model = LlamaDecoder(cfg, seed=0)
    tokens = random_tokens(cfg.vocab, batch=2, seq=48, seed=0)
    causal_lm_loss(model, tokens).backward()
    reference = grads_of(model)

    model.zero_grad(set_to_none=True)
    handle = co.apply(model, offload={"devices": ["cpu"], "min_bytes": 0, "pool": co.HostPool(pinned=False)})
    assert len(handle.names) == cfg.layers
    causal_lm_loss(model, tokens).backward()
    co.synchronize()
    assert_bit_identical(grads_of(model), reference)
    handle.remove()

    # the benchmark's way: a per-layer checkpoint function, rotary tables passed by keyword (a
    # pageable pool of its own: the default pool is pinned on a GPU machine)
    model.zero_grad(set_to_none=True)
    fn = functools.partial(
        co.checkpoint, offload={"devices": ["cpu"], "min_bytes": 0, "stream": "side", "pool": co.HostPool(pinned=False)}
    )
    causal_lm_loss(model, tokens, checkpoint_fn=fn).backward()
    co.synchronize()
    assert_bit_identical(grads_of(model), reference)


def test_decoder_lives_in_benchmarks_not_in_the_library():
    """The benchmark model is not shipped: no module of the installed package defines it."""
    package = os.path.dirname(os.path.abspath(co.__file__))
    sources = [os.path.join(d, f) for d, _, files in os.walk(package) for f in files if f.endswith(".py")]
    assert sources
    for path in sources:
        with open(path) as f:
            text = f.read()
        for name in ("class LlamaDecoder", "class DecoderConfig", "class LlamaConfig", "LLAMA_CONFIGS"):
            assert name not in text, f"{path} defines {name}"
    assert importlib.util.find_spec("ckpt_offload.models") is None
