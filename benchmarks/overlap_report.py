"""benchmarks/overlap.py's outputs: the headline, overlap.md, overlap.png and overlap.json.

Example::

    report["headline"] = headline(report["results"], cpu=True)
    write_outputs(report, "results/")      # overlap.json, overlap.md, overlap.png
"""

from __future__ import annotations

import json
import os

from overlap_strategies import MiB

CPU_WARNING = (
    "CPU NUMBERS, NOT GPU NUMBERS: no usable CUDA device (or --device cpu). Our strategies offload CPU "
    "tensors into a pageable pool through CPU copy 'streams' (worker threads), save_on_cpu runs with "
    "pin_memory=False (it keeps CPU tensors as they are). Step times, bandwidths and the hidden fraction say "
    "nothing about PCIe or CUDA stream overlap; the ratios, the byte counts and the gradient checks do mean "
    "something."
)


def mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def fmt(x, spec=".3f", none="-") -> str:
    return none if x is None else format(x, spec)


def headline(results: list[dict], cpu: bool) -> dict:
    """Overhead of co_checkpoint_side_prefetch vs checkpoint and vs hf_offload's overhead, per
    sequence length, and the issue-4 targets at the longest one."""
    by_seq: dict = {}
    for r in results:
        by_seq.setdefault(r["seq_len"], {})[r["strategy"]] = r
    per_seq = []
    for seq in sorted(by_seq):
        rows = by_seq[seq]
        ours, hf = rows.get("co_checkpoint_side_prefetch", {}), rows.get("hf_offload", {})
        o = (ours.get("ratio_to_checkpoint") - 1.0) if ours.get("ratio_to_checkpoint") else None
        h = (hf.get("ratio_to_checkpoint") - 1.0) if hf.get("ratio_to_checkpoint") else None
        per_seq.append(
            {
                "seq_len": seq,
                "ours_strategy": "co_checkpoint_side_prefetch",
                "ours_status": ours.get("status", "not run"),
                "ours_overhead": o,
                "hf_overhead": h,
                "ours_over_hf_overhead": (o / h) if (o is not None and h and h > 0) else None,
                "less_than_half_of_hf": (o < 0.5 * h) if (o is not None and h is not None and h > 0) else None,
            }
        )
    out = {"per_seq": per_seq, "cpu": cpu}
    if per_seq:
        last = per_seq[-1]
        rows = by_seq[last["seq_len"]]
        ours = rows.get("co_checkpoint_side_prefetch", {})
        host = ours.get("host") or {}
        bw = ours.get("bandwidth") or {}
        targets = {
            "at_seq_len": last["seq_len"],
            "within_3pct_of_checkpoint": (last["ours_overhead"] <= 0.03) if last["ours_overhead"] is not None else None,
            "less_than_half_hf_overhead_at_every_length": (
                all(p["less_than_half_of_hf"] for p in per_seq)
                if all(p["less_than_half_of_hf"] is not None for p in per_seq)
                else None
            ),
            "bandwidth_at_least_90pct_of_raw": (
                min(bw["d2h_fraction_of_raw"], bw["h2d_fraction_of_raw"]) >= 0.9
                if bw.get("d2h_fraction_of_raw") and bw.get("h2d_fraction_of_raw")
                else None
            ),
            "reserved_at_most_1_1x_requested": (
                host["reserved_over_requested"] <= 1.1 if host.get("reserved_over_requested") else None
            ),
            "zero_backend_allocs_after_first_step": (
                host["backend_allocs_after_first_step"] == 0
                if host.get("backend_allocs_after_first_step") is not None
                else None
            ),
        }
        out["targets"] = targets
    return out


def _yes(v) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")


def format_markdown(report: dict) -> str:
    cpu = report["mode"] == "cpu"
    lines = ["# Overlap benchmark: ckpt_offload side by side", ""]
    if cpu:
        lines += [f"> **{CPU_WARNING}**", ""]
    m = report["model"]
    lines.append(
        f"{report.get('gpu_name') or 'CPU'} · torch {report['torch_version']} · ckpt_offload "
        f"{report['build_info'].get('version')} (cuda_compiled={report['build_info'].get('cuda_compiled')}, pool "
        f"{report['build_info'].get('pool_backend')}) · {report['date']}"
    )
    lines.append(
        f"Model `{m['name']}` ({m['num_parameters'] / 1e6:.1f} M parameters, {m['layers']} layers, dim {m['dim']}, "
        f"{m['heads']}/{m['kv_heads']} heads, SwiGLU {m['ffn_dim']}, vocab {m['vocab']}) · {report['args']['dtype']}"
        f" · batch {report['args']['batch']} · {report['args']['steps']} timed steps after "
        f"{report['args']['warmup']} warmup · times are medians{' (CPU times)' if cpu else ''}"
    )
    lines.append("")

    hl = report.get("headline") or {}
    lines.append("## Headline")
    lines.append("")
    if cpu:
        lines.append("CPU run: the overheads below are CPU step-time ratios, not the GPU targets.")
        lines.append("")
    lines.append(
        "| seq len | co_checkpoint_side_prefetch overhead vs checkpoint | hf_offload overhead | "
        "ours / HF overhead | ours < half of HF |"
    )
    lines.append("|---:|---:|---:|---:|---|")
    for p in hl.get("per_seq", []):
        o = "-" if p["ours_overhead"] is None else f"{p['ours_overhead'] * 100:+.1f}%"
        if p["ours_overhead"] is None and p["ours_status"] != "ok":
            o = p["ours_status"]
        h = "-" if p["hf_overhead"] is None else f"{p['hf_overhead'] * 100:+.1f}%"
        lines.append(
            f"| {p['seq_len']} | {o} | {h} | {fmt(p['ours_over_hf_overhead'], '.2f')} | "
            f"{_yes(p['less_than_half_of_hf'])} |"
        )
    t = hl.get("targets")
    if t:
        lines.append("")
        lines.append(
            f"Issue-4 targets at seq len {t['at_seq_len']}"
            f"{' (CPU run: indicative only for the byte counts)' if cpu else ''}: "
            f"within 3% of checkpoint: {_yes(t['within_3pct_of_checkpoint'])}; "
            f"< half of HF's overhead at every length: {_yes(t['less_than_half_hf_overhead_at_every_length'])}; "
            f">= 90% of raw bandwidth: {_yes(t['bandwidth_at_least_90pct_of_raw'])}; "
            f"reserved <= 1.1x requested: {_yes(t['reserved_at_most_1_1x_requested'])}; "
            f"zero backend allocations after step 1: {_yes(t['zero_backend_allocs_after_first_step'])}."
        )
    lines.append("")

    by_seq: dict = {}
    for r in report["results"]:
        by_seq.setdefault(r["seq_len"], []).append(r)
    for seq in sorted(by_seq):
        raw = report["raw_bandwidth"].get(str(seq)) or {}
        lines.append(f"## seq len {seq}")
        lines.append("")
        lines.append(
            f"Raw copy ({raw.get('method', '-')}, {mib(raw.get('bytes'))} MiB = one layer input): "
            f"D2H {fmt(raw.get('d2h_gbps'), '.2f')} GB/s, H2D {fmt(raw.get('h2d_gbps'), '.2f')} GB/s."
        )
        lines.append("")
        lines.append(
            "| strategy | step ms | x checkpoint | peak MiB | resident after fwd MiB | host reserved / "
            "requested MiB | backend allocs after step 1 | D2H GB/s (of raw) | H2D GB/s (of raw) | "
            "copy hidden | grads vs none: max abs diff | = same-checkpointing run |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in by_seq[seq]:
            if r["status"] != "ok":
                lines.append(f"| {r['strategy']} | {r['status']} |" + " |" * 10)
                continue
            host = r.get("host") or {}
            res = host.get("peak_bytes_reserved")
            req = host.get("bytes_requested")
            host_s = "-" if not host else f"{mib(res)} / {mib(req)}"
            if host and host.get("reserved_over_requested"):
                host_s += f" ({host['reserved_over_requested']:.2f}x)"
            allocs = host.get("backend_allocs_after_first_step")
            bw = r.get("bandwidth") or {}

            def bw_cell(d, bw=bw):
                g = bw.get(f"{d}_gbps")
                if g is None:
                    return "-"
                f = bw.get(f"{d}_fraction_of_raw")
                return f"{g:.1f} ({f * 100:.0f}%)" if f else f"{g:.1f}"

            hidden = "-" if r.get("hidden_fraction") is None else f"{r['hidden_fraction'] * 100:.0f}%"
            if r.get("hidden_method") and r["hidden_method"] != "co.profile()":
                hidden += " (est.)"
            g = r.get("grads") or {}
            vn = g.get("vs_none") or {}
            diff = "-" if not vn else ("0 (bit-identical)" if vn["bit_identical"] else f"{vn['max_abs_diff']:.2e}")
            vr = g.get("vs_reference")
            same = "-" if vr is None else ("yes" if vr["bit_identical"] else f"NO ({vr['max_abs_diff']:.2e})")
            if vr is not None and g.get("reference"):
                same += f" vs {g['reference']}"
                if g.get("reference_repeatable") is False:
                    same += " (reference not repeatable)"
            lines.append(
                f"| {r['strategy']} | {r['median_step_s'] * 1e3:.2f} | {fmt(r.get('ratio_to_checkpoint'))} | "
                f"{mib(r.get('peak_above_start_bytes'))} | {mib(r.get('resident_after_forward_bytes'))} | {host_s} | "
                f"{'-' if allocs is None else allocs} | {bw_cell('d2h')} | {bw_cell('h2d')} | {hidden} | {diff} | "
                f"{same} |"
            )
        lines.append("")
    lines.append(
        "Columns: benchmarks/README.md, section overlap.py. Peak MiB is max_memory_allocated above what "
        'was allocated when the strategy started (weights, reference gradients). "(est.)": hidden '
        "fraction estimated from step times and the raw bandwidth (no co.profile())."
    )
    return "\n".join(lines) + "\n"


def write_plot(report: dict, path: str) -> str | None:
    """overlap.png: step-time ratio to checkpoint and peak memory vs seq len. Returns None when
    written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    cpu = report["mode"] == "cpu"
    series: dict = {}
    for r in report["results"]:
        if r["status"] == "ok":
            series.setdefault(r["strategy"], []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name, rows in series.items():
        rows = sorted(rows, key=lambda r: r["seq_len"])
        xs = [r["seq_len"] for r in rows]
        ax1.plot(xs, [r.get("ratio_to_checkpoint") or float("nan") for r in rows], marker="o", label=name)
        if cpu:
            ys = [((r.get("host") or {}).get("bytes_requested") or 0) / MiB for r in rows]
        else:
            ys = [(r.get("peak_above_start_bytes") or 0) / MiB for r in rows]
        ax2.plot(xs, ys, marker="o", label=name)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.grid(True, alpha=0.3)
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_ylabel("step time / checkpoint step time")
    ax1.set_title("step-time ratio" + (" (CPU times)" if cpu else ""))
    ax2.set_ylabel("host bytes requested per step (MiB)" if cpu else "peak device memory above start (MiB)")
    ax2.set_title("host bytes per step (CPU: no device memory)" if cpu else "peak device memory")
    ax1.legend(fontsize=7)
    m = report["model"]
    fig.suptitle(
        f"{report.get('gpu_name') or 'CPU (not GPU numbers)'} · {m['name']} · batch "
        f"{report['args']['batch']} · {report['args']['dtype']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def public_row(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def write_outputs(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "overlap.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "overlap.md"), "w") as f:
        f.write(format_markdown(report))
    why = write_plot(report, os.path.join(out, "overlap.png"))
    if why:
        report["plot"] = f"not written: {why}"
