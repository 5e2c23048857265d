"""co.profile(): records complete and consistent with ctx.stats(), module attribution, the
summary, the exports (Chrome trace, CSV, JSON, PNG), the CLI, and no records when off.

CPU tests offload CPU tensors (devices=["cpu"]); conftest's copy delay makes the copies
asynchronous, so copy records have real durations and reloads can really stall.
"""

import csv
import json
import re
from collections import Counter

import pytest
import torch
from conftest import cpu_offload
from models_for_tests import Chain
from torch import nn

import ckpt_offload as co
from ckpt_offload import _C
from ckpt_offload.__main__ import main
from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_batch, make_config
from ckpt_offload.profiling.export_table import stream_names
from ckpt_offload.profiling.report import RECORD_KEYS, RECORD_KINDS

HAS_PROFILER = hasattr(_C, "profiler_start")
needs_profiler = pytest.mark.skipif(not HAS_PROFILER, reason="native extension built without the profiler")

TOTALS_KEYS = (
    "d2h_bytes",
    "d2h_seconds",
    "h2d_bytes",
    "h2d_seconds",
    "d2h_gbps",
    "h2d_gbps",
    "copy_seconds",
    "stall_seconds",
    "hidden_fraction",
    "tensors_offloaded",
    "tensors_reloaded",
    "tensors_kept",
    "kept_by_reason",
    "pool_peak_bytes",
    "pool_reserved_bytes",
    "backend_allocs",
    "cap_hits",
    "prefetched_copies",
)


def _tiny(seed=0):
    cfg = make_config("tiny")
    model = TinyTransformer(**cfg.model_kwargs(), seed=seed).train()
    return cfg, model, make_batch(cfg, seed=seed)


@pytest.fixture(scope="module")
def tiny_profile():
    """One profiled training step of the tiny model, shared by the read-only tests below."""
    if not HAS_PROFILER:
        pytest.skip("native extension built without the profiler")
    _cfg, model, tokens = _tiny()
    pool = co.HostPool(pinned=False)
    ctx = cpu_offload(pool)
    with co.profile(model, pools=pool) as prof:
        with ctx:
            loss = lm_loss(model, tokens)
        loss.backward()
    co.synchronize()
    return model, ctx.stats(), pool, prof


# ---------------------------------------------------------------- records vs. ctx.stats()


def _check_record_fields(r):
    for c in r["copies"]:
        assert c["kind"] in ("d2h", "h2d")
        assert c["bytes"] > 0 and c["members"] >= 1
        assert 0 <= c["start_us"] <= c["end_us"], c
        assert isinstance(c["prefetch"], bool)
    for w in r["waits"]:
        assert w["stall_us"] >= 0
        assert w["stall_us"] == pytest.approx(max(0.0, w["ready_us"] - w["request_us"]), abs=1e-3)
    for m in r["memory"]:
        assert m["pool_bytes_in_use"] >= 0 and m["device_bytes_saved"] >= 0
        assert m["device_bytes_allocated"] is None  # CPU
    times = [m["t_us"] for m in r["memory"]]
    assert times == sorted(times)


@needs_profiler
def test_each_kind_of_record_holds_the_keys_of_its_table(tmp_path):
    """The native record tables: every kind of record (each one present here) has exactly the keys
    _C.PROFILER_RECORD_KEYS lists for it, in order, and the report reads those kinds."""
    torch.manual_seed(0)
    model, x = Chain(n=6), torch.randn(512, 512)
    # A capped pool that spills: pool events (segments from the backend, cap hits) and disk records.
    pool = co.HostPool(pinned=False, max_bytes=2 << 20, spill_dir=str(tmp_path), spill_file_bytes=8 << 20)
    with co.profile(model, pools=[pool]) as prof:
        with cpu_offload(pool, prefetch_bytes=64 << 20):
            loss = (model(x) ** 2).sum()
        loss.backward()
        co.synchronize()
        raw = _C.profiler_records()
    assert list(raw) == [*RECORD_KINDS, "dropped"]
    assert RECORD_KEYS == dict(_C.PROFILER_RECORD_KEYS)
    for kind in RECORD_KINDS:
        assert raw[kind], f"no {kind} records: the test would not see a key missing from them"
        wrong = [list(rec) for rec in raw[kind] if list(rec) != list(RECORD_KEYS[kind])]
        assert wrong == [], (kind, wrong[:1])
    assert list(prof.records) == [*RECORD_KINDS, "dropped"]


@needs_profiler
def test_records_complete_and_match_stats(tiny_profile):
    _model, stats, pool, prof = tiny_profile
    r = prof.records
    assert r["dropped"] == 0
    _check_record_fields(r)
    assert stats["tensors_offloaded"] > 0 and stats["tensors_reloaded"] > 0

    d2h = [c for c in r["copies"] if c["kind"] == "d2h"]
    h2d = [c for c in r["copies"] if c["kind"] == "h2d"]
    handles = {h["handle"]: h for h in r["handles"]}
    # One handle per offloaded storage, one D2H copy per handle, one H2D per reload.
    assert len(handles) == len(r["handles"]) == stats["tensors_offloaded"]
    assert Counter(c["handle"] for c in d2h) == Counter({h: 1 for h in handles})
    # Each copy is its tensor's span widened to the 512-byte cells of its storage it touches (Note [One copy per
    # storage]): a view of a larger storage moves up to 511 bytes more on each side.
    moved = sum(c["bytes"] for c in d2h)
    assert stats["bytes_offloaded"] <= moved <= stats["bytes_offloaded"] + 2 * 511 * len(handles)
    assert len(h2d) == stats["tensors_reloaded"]
    assert sum(c["bytes"] for c in h2d) == stats["bytes_reloaded"]
    assert {c["handle"] for c in h2d} == set(handles)  # one backward: every storage came back
    for h in r["handles"]:
        assert h["bytes"] > 0 and h["device"] == "cpu"
        assert isinstance(h["shape"], list) and h["dtype"]
    # An H2D copy of a handle comes after its D2H copy.
    d2h_end = {c["handle"]: c["end_us"] for c in d2h}
    for c in h2d:
        assert c["start_us"] >= d2h_end[c["handle"]] - 1e-3

    # Every unpack that consumed a reload was recorded as a wait on a known handle.
    assert r["waits"] and all(w["handle"] in handles for w in r["waits"])
    assert len(r["waits"]) >= len(h2d)

    # Keeps: the same reasons and counts as the context's stats.
    kept = Counter(k["reason"] for k in r["keeps"])
    assert kept == Counter({k: v for k, v in stats["kept_by_reason"].items() if v})
    assert sum(k["bytes"] for k in r["keeps"]) == stats["bytes_kept"]
    assert kept["parameter"] > 0  # nn.Linear saves weight.t()

    # Totals agree with the records and the stats.
    t = prof.to_dict()["totals"]
    assert t["d2h_bytes"] == moved and t["h2d_bytes"] == stats["bytes_reloaded"]
    assert t["tensors_offloaded"] == stats["tensors_offloaded"]
    assert t["tensors_reloaded"] == stats["tensors_reloaded"]
    assert t["tensors_kept"] == stats["tensors_kept"]
    assert t["kept_by_reason"] == {k: stats["kept_by_reason"].get(k, 0) for k in t["kept_by_reason"]}

    # Memory timeline: a sample at every pack and unpack; the pool drains after backward.
    assert len(r["memory"]) >= stats["tensors_offloaded"] + stats["tensors_reloaded"]
    assert t["pool_peak_bytes"] >= stats["bytes_offloaded"]
    assert t["pool_peak_bytes"] <= pool.stats()["peak_bytes_in_use"]
    assert pool.stats()["bytes_in_use"] == 0
    assert t["pool_reserved_bytes"] == pool.stats()["bytes_reserved"]
    assert t["backend_allocs"] == sum(1 for p in r["pool"] if p["kind"] == "backend_alloc") >= 1
    assert t["cap_hits"] == 0


@needs_profiler
def test_retain_graph_two_backwards_reload_twice(pool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    ctx = cpu_offload(pool)
    with co.profile(model, pools=pool) as prof:
        with ctx:
            loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        del loss
    co.synchronize()
    s = ctx.stats()
    r = prof.records
    h2d = Counter(c["handle"] for c in r["copies"] if c["kind"] == "h2d")
    d2h = Counter(c["handle"] for c in r["copies"] if c["kind"] == "d2h")
    assert set(d2h.values()) == {1} and len(d2h) == s["tensors_offloaded"]
    # Each backward reloads every storage once (an unpack that shares a live reload adds no copy).
    assert set(h2d) == set(d2h) and all(n == 2 for n in h2d.values()), h2d
    assert sum(h2d.values()) == s["tensors_reloaded"]
    assert sum(c["bytes"] for c in r["copies"] if c["kind"] == "h2d") == s["bytes_reloaded"]
    assert pool.stats()["bytes_in_use"] == 0


@needs_profiler
def test_module_attribution_with_model(tiny_profile):
    model, _, _, prof = tiny_profile
    names = {n for n, _ in model.named_modules() if n} | {"TinyTransformer", ""}  # "": the loss, outside
    modules = {h["module"] for h in prof.records["handles"]}
    assert modules <= names, modules - names
    # Activations of both blocks' attention and MLP were attributed to those submodules.
    for prefix in ("blocks.0.attn", "blocks.1.attn", "blocks.0.mlp", "blocks.1.mlp"):
        assert any(m == prefix or m.startswith(prefix + ".") for m in modules), (prefix, modules)
    # Compute ranges: one per module forward that had a tensor argument, properly timed.
    ranges = prof.records["compute"]
    assert {c["name"] for c in ranges} >= {"TinyTransformer", "blocks.0", "blocks.1.attn", "head"}
    assert all(c["device"] == "cpu" and 0 <= c["start_us"] <= c["end_us"] for c in ranges)
    root = next(c for c in ranges if c["name"] == "TinyTransformer")
    for c in ranges:  # every module forward nests inside the model's
        assert root["start_us"] - 1e-3 <= c["start_us"] and c["end_us"] <= root["end_us"] + 1e-3
    # Kept tensors carry their module too (weights are saved inside the Linear layers).
    assert any(k["module"].endswith("qkv") for k in prof.records["keeps"] if k["reason"] == "parameter")


@needs_profiler
def test_module_attribution_without_model(pool):
    _, model, tokens = _tiny()
    with co.profile(pools=pool) as prof:
        with cpu_offload(pool):
            loss = lm_loss(model, tokens)
        loss.backward()
    modules = {h["module"] for h in prof.records["handles"]}
    assert any(m.startswith("TinyTransformer/Block/CausalSelfAttention") for m in modules), modules
    assert all(m == "" or m.startswith("TinyTransformer") for m in modules)


@needs_profiler
def test_scope_unwinds_when_forward_raises(pool):
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    outer = nn.Sequential(nn.Linear(8, 8), Boom())
    with co.profile(outer, pools=pool) as prof:
        with pytest.raises(ValueError, match="boom"):
            outer(torch.randn(4, 8))
        with cpu_offload(pool):
            y = torch.randn(16, 16, requires_grad=True).exp()  # saved outside any module
        y.sum().backward()
    assert [h["module"] for h in prof.records["handles"]] == [""]
    assert {c["name"] for c in prof.records["compute"]} == {"Sequential", "0", "1"}


# ---------------------------------------------------------------- profiling off, nesting


@needs_profiler
def test_profiling_off_records_nothing(pool):
    _, model, tokens = _tiny()
    assert not _C.profiler_enabled()
    with cpu_offload(pool) as ctx:
        loss = lm_loss(model, tokens)
    loss.backward()
    assert ctx.stats()["tensors_offloaded"] > 0
    with co.profile(pools=pool) as prof:
        pass
    assert not _C.profiler_enabled()
    for kind in RECORD_KINDS:
        assert prof.records[kind] == [], kind
    t = prof.to_dict()["totals"]
    assert t["d2h_bytes"] == t["h2d_bytes"] == 0 and t["hidden_fraction"] == 0.0
    assert "TOTAL" in prof.summary()


@needs_profiler
def test_nested_profile_raises_and_hooks_are_removed(pool):
    pre = dict(torch.nn.modules.module._global_forward_pre_hooks)
    post = dict(torch.nn.modules.module._global_forward_hooks)
    with co.profile() as outer:
        with pytest.raises(RuntimeError, match="already active"), co.profile():
            pass
        assert _C.profiler_enabled()
    assert not _C.profiler_enabled()
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == pre
    assert dict(torch.nn.modules.module._global_forward_hooks) == post
    assert outer.records["copies"] == []
    with co.profile():  # usable again
        pass


def test_profile_before_exit_and_bad_arguments():
    p = co.ProfileReport()
    with pytest.raises(RuntimeError, match="exits"):
        p.summary()
    with pytest.raises(TypeError, match="model"):
        co.profile(model="not a module")
    with pytest.raises(TypeError, match="pools"):
        co.profile(pools=[object()])


# ---------------------------------------------------------------- summary and totals


def _synthetic():
    """Two copies of one 1 MB storage in "blocks.0" and a stall of 50 us waiting for the reload."""
    return {
        "copies": [
            {
                "id": 0,
                "kind": "d2h",
                "handle": 7,
                "bytes": 1_000_000,
                "device": "cuda:0",
                "stream": 1,
                "start_us": 10.0,
                "end_us": 110.0,
                "prefetch": False,
                "members": 1,
            },
            {
                "id": 1,
                "kind": "h2d",
                "handle": 7,
                "bytes": 1_000_000,
                "device": "cuda:0",
                "stream": 2,
                "start_us": 500.0,
                "end_us": 700.0,
                "prefetch": True,
                "members": 1,
            },
        ],
        "handles": [
            {
                "handle": 7,
                "bytes": 1_000_000,
                "shape": [250, 1000],
                "dtype": "float32",
                "device": "cuda:0",
                "module": "blocks.0",
            }
        ],
        "waits": [{"handle": 7, "device": "cuda:0", "request_us": 650.0, "ready_us": 700.0, "stall_us": 50.0}],
        "keeps": [
            {
                "reason": "parameter",
                "bytes": 4096,
                "module": "blocks.0",
                "shape": [32, 32],
                "dtype": "float32",
                "device": "cuda:0",
            },
            {"reason": "too_small", "bytes": 64, "module": "", "shape": [16], "dtype": "float32", "device": "cuda:0"},
        ],
        "pool": [{"kind": "backend_alloc", "bytes": 64 << 20, "start_us": 5.0, "end_us": 9.0}],
        "compute": [{"name": "blocks.0", "device": "cuda:0", "start_us": 0.0, "end_us": 400.0}],
        "memory": [
            {
                "t_us": 10.0,
                "pool_bytes_in_use": 1_000_448,
                "device_bytes_saved": 1_000_000,
                "device_bytes_allocated": 5_000_000,
            },
            {
                "t_us": 650.0,
                "pool_bytes_in_use": 0,
                "device_bytes_saved": 1_000_000,
                "device_bytes_allocated": 6_000_000,
            },
        ],
        "dropped": 0,
    }


def test_totals_arithmetic_on_synthetic_records():
    pool_stats = [{"bytes_reserved": 64 << 20, "max_bytes": None, "backend": "pinned"}]
    prof = co.ProfileReport.from_records(_synthetic(), pool_stats)
    t = prof.totals()
    assert t["d2h_bytes"] == t["h2d_bytes"] == 1_000_000
    assert t["d2h_seconds"] == pytest.approx(100e-6) and t["h2d_seconds"] == pytest.approx(200e-6)
    assert t["d2h_gbps"] == pytest.approx(10.0) and t["h2d_gbps"] == pytest.approx(5.0)
    assert t["copy_seconds"] == pytest.approx(300e-6) and t["stall_seconds"] == pytest.approx(50e-6)
    assert t["hidden_fraction"] == pytest.approx(250 / 300)
    assert t["tensors_offloaded"] == t["tensors_reloaded"] == 1 and t["prefetched_copies"] == 1
    assert t["tensors_kept"] == 2 and t["kept_by_reason"]["parameter"] == 1 and t["kept_by_reason"]["too_small"] == 1
    assert t["pool_peak_bytes"] == 1_000_448 and t["pool_reserved_bytes"] == 64 << 20
    assert t["backend_allocs"] == 1 and t["cap_hits"] == 0
    assert t["device_allocated_peak_bytes"] == 6_000_000 and not t["cpu_only"]
    assert set(TOTALS_KEYS) <= set(t)

    s = prof.summary()
    assert "GPU copies" in s and "CPU copies" not in s
    lines = s.splitlines()
    total = next(line for line in lines if line.startswith("TOTAL"))
    row = next(line for line in lines if line.startswith("blocks.0"))
    # tensors, offloaded, reloaded, D2H GB/s, H2D GB/s, copy ms, hidden ms, stall ms, prefetch, kept
    assert total.split()[1:] == ["1", "976.6", "KiB", "976.6", "KiB", "10.00", "5.00", "0.30", "0.25", "0.05", "1", "2"]
    assert row.split()[-1] == "1"  # the parameter kept in blocks.0
    assert any(line.startswith("(no module)") for line in lines)  # the too_small keep
    assert "83% hidden" in s and "1 backend allocation (" in s and "parameter 1" in s and "too_small 1" in s
    assert "TOTAL" in prof.summary(by="total") and "blocks.0" not in prof.summary(by="total").split("TOTAL")[0]
    assert "(other 1 modules)" in prof.summary(top=1)
    with pytest.raises(ValueError, match="by"):
        prof.summary(by="layer")
    with pytest.raises(ValueError, match="top"):
        prof.summary(top=0)
    json.dumps(prof.to_dict())


@needs_profiler
def test_summary_matches_records(tiny_profile):
    _, stats, _, prof = tiny_profile
    s = prof.summary()
    assert "CPU copies (memcpy)" in s
    lines = s.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("module"))
    total = next(line for line in lines if line.startswith("TOTAL"))
    assert int(total.split()[1]) == stats["tensors_offloaded"]
    assert int(total.split()[-1]) == stats["tensors_kept"]
    assert "blocks.0.attn" in s and lines[header + 1].startswith("---")
    # The per-module rows add up to the total.
    rows = prof.by_module()
    t = prof.totals()
    assert sum(m["d2h_bytes"] for m in rows) == t["d2h_bytes"]
    assert sum(m["h2d_bytes"] for m in rows) == t["h2d_bytes"]
    assert sum(m["stall_seconds"] for m in rows) == pytest.approx(t["stall_seconds"])
    assert sum(m["tensors_kept"] for m in rows) == t["tensors_kept"]
    assert 0.0 <= t["hidden_fraction"] <= 1.0 and t["d2h_gbps"] > 0 and t["h2d_gbps"] > 0
    assert len(prof.summary(top=2).splitlines()) < len(lines)


# ---------------------------------------------------------------- exports


def _check_nesting(xs):
    """X events on one track must nest (Perfetto flags slices that overlap without nesting)."""
    tracks = {}
    for e in xs:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track, evs in tracks.items():
        stack = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-6:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + 1e-6, (track, stack[-1], e)
            stack.append(e)


def _check_trace(trace):
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    xs = [e for e in events if e["ph"] == "X"]
    for e in xs:
        assert isinstance(e["name"], str) and e["name"]
        for key in ("ts", "dur"):
            assert isinstance(e[key], (int, float)) and e[key] >= 0, e
        assert (e["pid"], e["tid"]) in threads, e
        assert e["pid"] in procs
    return events, threads, procs, xs


@needs_profiler
def test_chrome_trace_is_valid_trace_event_json(tiny_profile, tmp_path):
    _, stats, _, prof = tiny_profile
    path = prof.export_chrome_trace(tmp_path / "trace.json")
    with open(path) as f:
        trace = json.load(f)
    events, threads, procs, xs = _check_trace(trace)
    assert {"compute", "D2H", "H2D", "pool"} <= set(threads.values())
    _check_nesting(xs)
    assert "cpu" in procs.values() and "host pool" in procs.values()
    by_track = Counter(threads[(e["pid"], e["tid"])] for e in xs)
    # Demand reloads run on a stream of their own (Note [Stream ordering] rule 4), shown as a
    # second H2D track ("H2D (stream N)") next to the prefetches' "H2D".
    h2d = sum(n for track, n in by_track.items() if track.startswith("H2D"))
    assert by_track["D2H"] == stats["tensors_offloaded"] and h2d == stats["tensors_reloaded"]
    assert by_track["compute"] >= len(prof.records["compute"])
    copy = next(e for e in xs if threads[(e["pid"], e["tid"])] == "D2H")
    assert {"bytes", "shape", "dtype", "module", "handle", "GB/s"} <= set(copy["args"])
    assert any(e["ph"] == "C" for e in events)  # memory counters


def test_untimed_records_count_in_bytes_not_in_times(tmp_path):
    r = _synthetic()
    r["copies"].append(dict(r["copies"][0], id=2, handle=8, start_us=None, end_us=None))
    r["handles"].append(dict(r["handles"][0], handle=8))
    r["waits"].append({"handle": 8, "device": "cuda:0", "request_us": None, "ready_us": 3.0, "stall_us": None})
    prof = co.ProfileReport.from_records(r, [])
    t = prof.totals()
    assert t["d2h_bytes"] == 2_000_000 and t["tensors_offloaded"] == 2
    assert t["d2h_gbps"] == pytest.approx(10.0) and t["d2h_seconds"] == pytest.approx(100e-6)
    assert t["stall_seconds"] == pytest.approx(50e-6) and t["untimed_records"] == 2
    assert "2 copy/wait records have no timestamp" in prof.summary()
    with open(prof.export_chrome_trace(tmp_path / "t.json")) as f:
        _, threads, _, xs = _check_trace(json.load(f))
    assert sum(1 for e in xs if threads[(e["pid"], e["tid"])] == "D2H") == 1
    with open(prof.export_csv(tmp_path / "r.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and rows[-1]["start_us"] == "" and rows[-1]["gbps"] == ""


def test_chrome_trace_second_stream_gets_its_own_track():
    r = _synthetic()
    r["copies"].append(dict(r["copies"][0], id=2, stream=99, start_us=20.0, end_us=60.0))  # overlaps copy 0
    _, threads, _, xs = _check_trace(co.ProfileReport.from_records(r, []).chrome_trace())
    d2h = sorted(threads[(e["pid"], e["tid"])] for e in xs if e["cat"] == "d2h")
    assert d2h == ["D2H", "D2H (stream 99)"]
    _check_nesting(xs)


def test_chrome_trace_synthetic_has_stall_marker(tmp_path):
    pool_stats = [{"bytes_reserved": 0, "max_bytes": None, "backend": "pinned"}]
    prof = co.ProfileReport.from_records(_synthetic(), pool_stats)
    with open(prof.export_chrome_trace(tmp_path / "t.json")) as f:
        _events, threads, procs, xs = _check_trace(json.load(f))
    stall = next(e for e in xs if e["name"].startswith("stall"))
    assert threads[(stall["pid"], stall["tid"])] == "compute" and procs[stall["pid"]] == "cuda:0"
    assert stall["ts"] == 650.0 and stall["dur"] == 50.0
    h2d = next(e for e in xs if threads[(e["pid"], e["tid"])] == "H2D")
    assert h2d["args"]["GB/s"] == pytest.approx(5.0) and h2d["args"]["shape"] == [250, 1000]


@needs_profiler
def test_csv_json_and_png(tiny_profile, tmp_path):
    _, _, _, prof = tiny_profile
    with open(prof.export_csv(tmp_path / "records.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(prof.records["copies"])
    assert all(r["shape"].startswith("[") and r["dtype"] for r in rows)
    handles = {h["handle"]: h for h in prof.records["handles"]}
    assert all(r["module"] == handles[int(r["handle"])]["module"] for r in rows)
    assert any(r["module"].startswith("blocks.1.") for r in rows)
    assert {r["kind"] for r in rows} == {"d2h", "h2d"}

    with open(prof.export_json(tmp_path / "profile.json")) as f:
        d = json.load(f)
    assert set(TOTALS_KEYS) <= set(d["totals"])
    assert d["totals"] == json.loads(json.dumps(prof.to_dict()["totals"]))
    assert len(d["records"]["copies"]) == len(prof.records["copies"])
    again = co.ProfileReport.from_records(d["records"], d["pool_stats"])
    assert again.summary() == prof.summary()

    pytest.importorskip("matplotlib")
    png = prof.plot_memory(tmp_path / "memory.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_memory_synthetic_with_allocator_line(tmp_path):
    pytest.importorskip("matplotlib")
    prof = co.ProfileReport.from_records(_synthetic(), [])
    paths = prof.save(tmp_path / "out")
    assert set(paths) == {"summary", "trace", "csv", "json", "memory"}
    for p in paths.values():
        assert (tmp_path / "out").joinpath(p.rsplit("/", 1)[-1]).stat().st_size > 0


def test_report_class_alias_and_exporter_functions(tmp_path):
    """The result class is co.ProfileReport (not a case variant of co.profile), co.Profile stays as
    its alias, and the exporters are functions over a report giving what the methods give."""
    from ckpt_offload.profiling import export_table, export_trace

    assert co.Profile is co.ProfileReport
    assert co.ProfileReport.__name__.lower() != co.profile.__name__.lower()
    assert repr(co.ProfileReport()) == "ProfileReport(<recording>)"
    prof = co.ProfileReport.from_records(_synthetic(), [])
    assert export_trace.chrome_trace(prof) == prof.chrome_trace()
    assert export_table.to_dict(prof) == prof.to_dict()
    export_table.export_csv(prof, tmp_path / "a.csv")
    prof.export_csv(tmp_path / "b.csv")
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()
    assert prof.CSV_COLUMNS == export_table.CSV_COLUMNS
    with pytest.raises(RuntimeError, match="exits"):
        export_trace.chrome_trace(co.ProfileReport())


# ---------------------------------------------------------------- command line


@needs_profiler
def test_cli_profile_writes_folder(tmp_path, capsys):
    out = tmp_path / "prof"
    rc = main(
        [
            "profile",
            "--steps",
            "2",
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--min-bytes",
            "0",
            "--no-progress",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "TOTAL" in text and "CPU copies (memcpy)" in text and "blocks.0" in text
    for name in ("summary.txt", "trace.json", "records.csv", "profile.json"):
        assert (out / name).stat().st_size > 0, name
    d = json.loads((out / "profile.json").read_text())
    # A deduplicated storage unpacked after its first reload was freed is reloaded again.
    assert d["totals"]["d2h_bytes"] > 0 and d["totals"]["h2d_bytes"] >= d["totals"]["d2h_bytes"]
    _check_trace(json.loads((out / "trace.json").read_text()))
    try:
        import matplotlib  # noqa: F401

        assert (out / "memory.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib" in (out / "summary.txt").read_text()


@needs_profiler
def test_cli_profile_user_script(tmp_path, capsys):
    script = tmp_path / "my_train.py"
    script.write_text(
        "import torch\n"
        "import ckpt_offload as co\n"
        "lin = torch.nn.Linear(32, 32)\n"
        "def step():\n"
        "    with co.offload(devices=['cpu'], min_bytes=0):\n"
        "        loss = lin(torch.randn(8, 32)).relu().sum()\n"
        "    loss.backward()\n"
    )
    out = tmp_path / "prof"
    rc = main(["profile", "--steps", "2", "--script", f"{script}:step", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "Linear" in capsys.readouterr().out
    d = json.loads((out / "profile.json").read_text())
    assert d["totals"]["tensors_offloaded"] > 0


@pytest.mark.parametrize(
    "script, message",
    [
        ("nocolon.py", "FILE.py:FUNCTION"),
        ("missing.py:step", "no such file"),
        ("{f}:nothere", "no attribute"),
        ("{f}:VALUE", "not a function"),
    ],
)
def test_cli_profile_bad_script(tmp_path, capsys, script, message):
    f = tmp_path / "s.py"
    f.write_text("VALUE = 3\n")
    with pytest.raises(SystemExit) as e:
        main(["profile", "--script", script.format(f=f), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["profile", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["profile", "--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["profile", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["profile", "--top", "0"], "argument --top: must be >= 1"),
    ],
)
def test_cli_profile_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given when no GPU is usable")
def test_cli_profile_cuda_without_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--device", "cuda", "--size", "tiny", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert "no usable CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_info_prints_pool_configuration(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("backend:", "max_bytes:", "segment_bytes:", "reserved:", "cuda_compiled:"):
        assert key in out, key


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAS_PROFILER and torch.cuda.is_available() and co.build_info()["gpu_available"]),
    reason="needs a CUDA GPU, a CUDA build of ckpt_offload and its profiler",
)
@pytest.mark.parametrize("stream", ["side", "compute"])
def test_gpu_record_timings(stream):
    cfg = make_config("tiny")
    model = TinyTransformer(**cfg.model_kwargs(), seed=0).cuda().train()
    tokens = make_batch(cfg, seed=0, device="cuda")
    pool = co.HostPool()
    with co.profile(model, pools=pool) as prof:
        with co.offload(min_bytes=0, stream=stream, pool=pool) as ctx:
            loss = lm_loss(model, tokens)
        loss.backward()
        torch.cuda.synchronize()
    s = ctx.stats()
    r = prof.records
    assert r["dropped"] == 0
    d2h = {c["handle"]: c for c in r["copies"] if c["kind"] == "d2h"}
    h2d = [c for c in r["copies"] if c["kind"] == "h2d"]
    assert len(d2h) == s["tensors_offloaded"] > 0 and len(h2d) == s["tensors_reloaded"] > 0
    for c in r["copies"]:
        assert c["device"].startswith("cuda") and 0 <= c["start_us"] < c["end_us"], c
    for c in h2d:
        assert c["start_us"] >= d2h[c["handle"]]["end_us"], (c, d2h[c["handle"]])
    for c in r["compute"]:
        assert 0 <= c["start_us"] < c["end_us"], c
    assert any(m["device_bytes_allocated"] for m in r["memory"])
    t = prof.totals()
    assert t["d2h_gbps"] > 0.1 and t["h2d_gbps"] > 0.1 and not t["cpu_only"]
    assert "GPU copies" in prof.summary()
    _, _, _, xs = _check_trace(prof.chrome_trace())
    _check_nesting([e for e in xs if e["cat"] in ("d2h", "h2d")])


@needs_profiler
def test_cli_profile_small_default_window_saves_device_memory(tmp_path, capsys):
    """With defaults, the device peak of saved activations is at most 60% of
    the pool's peak (the whole step), and the summary says so as "X of Y, Z% less"."""
    out = tmp_path / "prof"
    rc = main(["profile", "--size", "small", "--device", "cpu", "--steps", "1", "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    totals = json.loads((out / "profile.json").read_text())["totals"]
    device, pool, total = totals["device_saved_peak_bytes"], totals["pool_peak_bytes"], totals["saved_total_bytes"]
    assert 0 < device <= 0.6 * pool, (device, pool)
    assert total >= pool
    from ckpt_offload.profiling.summary import saved_line

    line = saved_line(device, total)
    assert re.search(r"[\d.]+ [KMG]iB of [\d.]+ [KMG]iB, \d+% less", line)
    assert f"saved activations held on the device peaked at {line}" in text


@needs_profiler
def test_cli_profile_fixed_whole_step_window_shows_no_saving(tmp_path, capsys):
    """The same run with a window larger than the step brings everything back at once: the
    measurement above can fail."""
    out = tmp_path / "prof"
    rc = main(
        [
            "profile",
            "--size",
            "small",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--out",
            str(out),
            "--no-progress",
            "--prefetch-bytes",
            str(256 * 2**20),
        ]
    )
    assert rc == 0
    totals = json.loads((out / "profile.json").read_text())["totals"]
    assert totals["device_saved_peak_bytes"] > 0.9 * totals["pool_peak_bytes"]


def test_cli_profile_out_checked_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["profile", "--size", "tiny", "--device", "cpu", "--out", str(blocker)])
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "--out" in err.err and "not a folder" in err.err
    assert "profiling" not in err.err  # nothing ran


def test_saved_line_format():
    from ckpt_offload.profiling.summary import saved_line

    assert saved_line(25 * 2**20, 100 * 2**20) == "25.0 MiB of 100.0 MiB, 75% less"
    assert saved_line(0, 0) == "0 B of 0 B"


def test_stream_names():
    copies = [
        {"id": 0, "device": 0, "stream": 11, "kind": "d2h"},
        {"id": 1, "device": 0, "stream": 12, "kind": "h2d"},
        {"id": 2, "device": 0, "stream": 13, "kind": "h2d"},
        {"id": 3, "device": 1, "stream": 20, "kind": "d2h"},
        {"id": 4, "device": 1, "stream": 20, "kind": "h2d"},
    ]
    assert stream_names(copies) == {(0, 11): "d2h", (0, 12): "h2d", (0, 13): "h2d.2", (1, 20): "compute"}


def test_records_csv_names_streams(tmp_path):
    pool = co.HostPool(pinned=False)
    with co.profile(pools=[pool]) as prof:
        with co.offload(devices=["cpu"], min_bytes=0, pool=pool):
            y = torch.randn(1000, requires_grad=True).sin()
        y.sum().backward()
    with open(prof.export_csv(tmp_path / "records.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["stream"] for r in rows} <= {"compute", "d2h", "h2d", "h2d.2", "d2h.2"}
    json.dumps(rows)
