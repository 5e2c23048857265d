"""Writes the GPU suite's summary.md (benchmarks/gpu_suite.sh calls it last).

    python3 benchmarks/_suite_summary.py OUT_DIR WORK_DIR ELAPSED_S

OUT_DIR holds what the suite returns (suite.log, gpu_tests.xml, cpu_tests.xml, test_logs.txt, ...),
WORK_DIR the suite's scratch: steps.tsv (name, status, seconds, note per step), build_info.json,
diagnose.md and extras/ (the benchmarks' json/md files, packed into extras.tar.gz afterwards).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _suite_tests import section  # noqa: E402  (after the sys.path line)

out, work, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3])
extras = os.path.join(work, "extras")
LOGS = "test_logs.txt"
steps = [line.rstrip("\n").split("\t") for line in open(os.path.join(work, "steps.tsv")) if line.strip()]
info_path = os.path.join(work, "build_info.json")
lines = []
gpu = next((s for s in steps if s[0] == "gpu_present"), None)
failed = [s[0] for s in steps if s[1].startswith(("FAIL", "TIMEOUT"))]
title = "ckpt_offload GPU suite"
lines.append(f"# {title}: {'FAILED (' + ', '.join(failed) + ')' if failed else 'all steps passed'}")
lines.append("")
if gpu and gpu[1] != "PASS":
    lines.append("> **NO GPU: the GPU tests skipped and the bandwidth numbers are CPU numbers, not GPU numbers.**")
    lines.append("")
try:
    info = json.load(open(info_path))
    lines.append(
        f"ckpt_offload {info.get('version')} · torch {info.get('torch_version')} · CUDA {info.get('cuda_version')} "
        f"(runtime {info.get('cuda_runtime_version')}) · cuda_compiled={info.get('cuda_compiled')} · "
        f"gpu_available={info.get('gpu_available')} · pool backend {info.get('pool_backend')}"
    )
except Exception:
    lines.append("build_info: unavailable (the build or the import failed)")
if gpu:
    lines.append(f"GPU: {gpu[3] or 'none'} · total {elapsed} s")
lines.append("")
lines.append("| step | status | seconds | note |")
lines.append("|---|---|---:|---|")
for name, status, secs, note in steps:
    lines.append(f"| {name} | {status} | {secs} | {note} |")

diag = os.path.join(work, "diagnose.md")
if os.path.exists(diag):
    lines += ["", f'## Diagnose (every run\'s full output: {LOGS}, sections "diagnose: ...")', ""]
    lines += open(diag).read().rstrip("\n").splitlines()
for label, fname in (("GPU tests", "gpu_tests.xml"), ("CPU tests", "cpu_tests.xml")):
    lines.append("")
    lines += section(os.path.join(out, fname), label, LOGS)

bw = os.path.join(extras, "bandwidth.json")
lines.append("")
lines.append("## Bandwidth (bandwidth.md has the full tables; extras/bandwidth.json every sample)")
lines.append("")
if os.path.exists(bw):
    try:
        r = json.load(open(bw))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        lines.append(f"{r.get('gpu_name') or 'CPU path'} · largest size {r['sizes'][-1] // (1 << 20)} MiB")
        lines.append("")
        lines.append(
            "| direction | method | peak GB/s | GB/s at largest size | ratio to raw there | knee (80% of peak) |"
        )
        lines.append("|---|---|---:|---:|---:|---:|")
        big = r["sizes"][-1]
        at = {(x["direction"], x["method"]): x for x in r["results"] if x["bytes"] >= big}
        for key, k in r["knees"].items():
            if not k:
                continue
            d, m = key.split("/")
            row, raw = at.get((d, m)), at.get((d, "raw"))
            ratio = f"{row['gbps'] / raw['gbps']:.2f}" if row and raw else "-"
            there = f"{row['gbps']:.2f}" if row else "-"
            lines.append(f"| {d} | {m} | {k['peak_gbps']:.2f} | {there} | {ratio} | {k['knee_bytes'] // 1024} KiB |")
        lines.append("")
        s = r.get("suggested_min_bytes")
        lines.append(
            f"Suggested min_bytes (larger side-stream knee): {s // 1024 if s else '-'} KiB; "
            f"default {r['build_info']['default_min_bytes'] // 1024} KiB. Round trips verified: {r['verified']}."
        )
        ov = r["overhead"]["pack_unpack_overhead_us"]
        lines.append(
            f"Pack+unpack overhead per saved tensor: offloaded {ov['offloaded']:.1f} µs, kept {ov['kept']:.1f} µs."
        )
    except Exception as e:
        lines.append(f"could not read bandwidth.json: {e}")
else:
    lines.append("no bandwidth.json (the step failed or did not run)")

dt = os.path.join(extras, "disk_tier.json")
lines.append("")
lines.append("## Disk tier (extras/disk_tier.md)")
lines.append("")
if os.path.exists(dt):
    try:
        r = json.load(open(dt))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        best = max(r["bandwidth"], key=lambda b: b["write_gbps"] + b["read_gbps"])
        s = r["step"]
        lines.append(
            f"Spill files on {r['dir']} ({r['fs_type']}, O_DIRECT={best['direct_io']}): "
            f"{best['write_gbps']:.2f} GB/s write, {best['read_gbps']:.2f} GB/s read "
            f"({best['io_threads']} I/O threads). Step ({s['model']}, seq {s['seq']}): host-only "
            f"{s['step_s_host_only'] * 1e3:.1f} ms, spilling {s['bytes_spilled_per_step'] / 2**20:.0f} MiB/step "
            f"{s['step_s_spill'] * 1e3:.1f} ms ({s['spill_vs_host'] * 100:+.1f}%); gradients equal: "
            f"{s['gradients_equal_host_only']}."
        )
    except Exception as e:
        lines.append(f"could not read disk_tier.json: {e}")
else:
    lines.append("no disk_tier.json (the step failed or did not run)")
hp = os.path.join(extras, "hot_path.json")
lines.append("")
lines.append("## Hot path: fixed cost per saved tensor (extras/hot_path.md has every variant)")
lines.append("")
if os.path.exists(hp):
    try:
        r = json.load(open(hp))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        for key, v in r["ratios"].items():
            ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}"
            lines.append(
                f"- {key}: {v['numerator']} {v['numerator_us']:.2f} µs / {v['denominator']} "
                f"{v['denominator_us']:.2f} µs per saved tensor = **{ratio}** (target <= 1.0)"
            )
        behind = [x["variant"] for x in r["results"] if x.get("host_behind_gpu")]
        if r["mode"] == "gpu":
            lines.append(f"- host behind the GPU (host forward time > GPU step time): {', '.join(behind) or 'none'}")
    except Exception as e:
        lines.append(f"could not read hot_path.json: {e}")
else:
    lines.append("no hot_path.json (the step failed or did not run)")
co_path = os.path.join(extras, "call_overhead.json")
lines.append("")
lines.append("## Fixed cost per checkpointed call (extras/call_overhead.md)")
lines.append("")
if os.path.exists(co_path):
    try:
        r = json.load(open(co_path))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        for x in r["rows"]:
            lines.append(
                f"- {x['arm']}: {x['over_torch_checkpoint_us']:+.1f} µs per call over torch's checkpoint "
                f"(ratio {x['ratio']:.2f} [{x['ratio_p25']:.2f}, {x['ratio_p75']:.2f}])"
            )
        made = r.get("construction_us")
        if made:
            lines.append(
                f"- making a context: co.offload(...) {made['co_offload']:.1f} µs, torch's saved_tensors_hooks "
                f"{made['saved_tensors_hooks']:.1f} µs, save_on_cpu {made['save_on_cpu']:.1f} µs"
            )
    except Exception as e:
        lines.append(f"could not read call_overhead.json: {e}")
else:
    lines.append("no call_overhead.json (the step failed or did not run)")

ov = os.path.join(extras, "overlap.json")
lines.append("")
lines.append("## Overlap (overlap.md has every strategy and column; extras/overlap.json, extras/overlap.png the plot)")
lines.append("")
if os.path.exists(ov):
    try:
        r = json.load(open(ov))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        m = r["model"]
        lines.append(
            f"{r.get('gpu_name') or 'CPU path'} · model {m['name']} ({m['num_parameters'] / 1e6:.1f} M) · "
            f"batch {r['args']['batch']} · {r['args']['dtype']} · {r.get('elapsed_s', 0):.0f} s"
        )
        lines.append("")
        lines.append(
            "| seq len | co_checkpoint_side_prefetch vs checkpoint | hf_offload vs checkpoint | ours < half of HF |"
        )
        lines.append("|---:|---:|---:|---|")
        for p in r["headline"]["per_seq"]:
            o = "-" if p["ours_overhead"] is None else f"{p['ours_overhead'] * 100:+.1f}%"
            if p["ours_overhead"] is None and p.get("ours_status") not in (None, "ok"):
                o = p["ours_status"][:80]
            h = "-" if p["hf_overhead"] is None else f"{p['hf_overhead'] * 100:+.1f}%"
            half = {None: "n/a", True: "yes", False: "NO"}[p["less_than_half_of_hf"]]
            lines.append(f"| {p['seq_len']} | {o} | {h} | {half} |")
        t = r["headline"].get("targets") or {}
        if t:
            lines.append("")
            lines.append(
                f"Targets at seq {t['at_seq_len']}: "
                + "; ".join(
                    f"{k}: {({None: 'n/a', True: 'yes', False: 'NO'})[v]}" for k, v in t.items() if k != "at_seq_len"
                )
            )
        bad = [
            f"{x['strategy']}@{x['seq_len']}: {x['status'][:120]}"
            for x in r["results"]
            if x["status"].startswith("failed")
        ]
        if bad:
            lines.append("")
            lines += [f"- FAILED {b}" for b in bad]
    except Exception as e:
        lines.append(f"could not read overlap.json: {e}")
else:
    lines.append("no overlap.json (the step failed or did not run)")

lc_dir = os.path.join(extras, "long_context")
lines.append("")
lines.append("## Long context (extras/long_context/)")
lines.append("")
mds = sorted(f for f in os.listdir(lc_dir) if f.endswith(".md")) if os.path.isdir(lc_dir) else []
if mds:
    for f in mds:
        md = open(os.path.join(lc_dir, f)).read().splitlines()
        lines += [f"From extras/long_context/{f} (first 30 lines):", ""] + md[:30]
else:
    lines.append("no long_context output (the step failed, did not run, or benchmarks/long_context.py does not exist)")

pl = os.path.join(extras, "planner", "planner_sweep.json")
lines.append("")
lines.append("## Planner sweep (extras/planner/: planner_sweep.md has every row, planner_sweep.png the plot)")
lines.append("")
if os.path.exists(pl):
    try:
        r = json.load(open(pl))
        if r["mode"] == "cpu":
            lines.append("**CPU numbers, not GPU numbers.**")
            lines.append("")
        m = r["model"]
        lines.append(
            f"TinyTransformer {m['name']} ({m['layers']} layers) · smallest budget "
            f"{r['smallest_budget_bytes'] / 2**20:.1f} MiB · "
            f"no plan {r['no_plan']['measured_peak_bytes'] / 2**20:.1f} MiB "
            f"· {r.get('elapsed_s', 0):.0f} s"
            + (f" · {r['skipped_rows']} rows skipped (budget)" if r.get("skipped_rows") else "")
        )
        lines.append("")
        lines.append(
            "| budget MiB | plan fits (measured) | plan peak vs predicted | best fitting baseline "
            "| plan time / its time |"
        )
        lines.append("|---:|---|---:|---|---:|")
        for h in r["headline"]:
            err = "-" if h["plan_peak_error"] is None else f"{h['plan_peak_error'] * 100:+.1f}%"
            ratio = "-" if h["plan_vs_best_baseline_time"] is None else f"{h['plan_vs_best_baseline_time']:.2f}"
            lines.append(
                f"| {h['budget_bytes'] / 2**20:.1f} | {h['plan_fits']} | {err} "
                f"| {h['best_baseline'] or '-'} | {ratio} |"
            )
    except Exception as e:
        lines.append(f"could not read planner_sweep.json: {e}")
else:
    lines.append("no planner_sweep.json (the step failed, was skipped or did not run)")

lines.append("")
lines.append(
    f"Files: {', '.join(sorted(set(os.listdir(out)) | {'summary.md', 'extras.tar.gz'}))}. "
    f"Logs: suite.log (everything printed), {LOGS} (the per-process test logs, crash backtraces and "
    "diagnose runs, each under a '=====' header), extras.tar.gz: " + ", ".join(sorted(os.listdir(extras)))
)
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
