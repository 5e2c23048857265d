"""``python -m ckpt_offload demo``, the reporting: the plain-text report of a
:func:`~ckpt_offload.demo.runner.run_demo` result, and the result as ``demo.json``.

The report leads with the recipe (device peak, bytes copied, step time against checkpointing
alone and the baseline), then offload-everything as the contrast, then the bandwidth arithmetic
that tells them apart; then offload-everything in detail: what autograd saved, what stayed on the
device and what went to the host pool, the pool's own counters, and whether the gradients and
losses are bit-identical.

Example::

    from ckpt_offload.demo import format_report, run_demo, write_json
    result = run_demo(size="tiny", steps=2, device="cpu", min_bytes=0)
    print(format_report(result))
    write_json(result, "demo_out")   # demo_out/demo.json
"""

from __future__ import annotations

import json
import os
import textwrap

from ckpt_offload.profiling.summary import saved_line

__all__ = ["DEMO_JSON", "format_report", "write_json"]

DEMO_JSON = "demo.json"


def _mib(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.2f} MiB"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _note(text: str) -> list:
    return textwrap.wrap("NOTE: " + text, width=100, subsequent_indent="      ")


def _timed_steps(steps: int) -> str:
    return f" (steps 2..{steps})" if steps > 2 else " (step 2)" if steps == 2 else ""


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f} ms"


def format_report(r: dict) -> str:
    """The plain-text report of a :func:`run_demo` result."""
    c = r["config"]
    base, off, pool = r["baseline"], r["offload"], r["pool"]
    saved = base["saved_per_step"]
    s1 = off["stats_first_step"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s1["kept_by_reason"].items()) if k not in ("parameter", "buffer"))
    devices = "default (cuda)" if c["offload_devices"] is None else c["offload_devices"]
    lines = [
        f"ckpt_offload demo: TinyTransformer '{c['size']}' (vocab {c['vocab']}, dim {c['dim']}, "
        f"{_n(c['layers'], 'layer')}, "
        f"{_n(c['heads'], 'head')}, seq {c['seq']}, batch {c['batch']}, {c['num_parameters'] / 1e6:.2f} M params), "
        f"dropout {c['dropout']}, seed {c['seed']}, {_n(c['steps'], 'step')} on {c['device']}",
        f"offload run: co.offload(devices={devices}, min_bytes={c['min_bytes']}, stream={c['stream']!r}), "
        f"a fresh co.HostPool ({pool['backend']})",
        "",
    ]
    if r["cpu_only"]:
        lines += _note(r["note"]) + [""]
    if r.get("recipe"):
        lines += _recipe_lines(r) + [""]
    lines.append("offload everything, in detail:")
    rows = [
        ("per training step", "baseline", "co.offload", ""),
        (
            "activation bytes saved by autograd",
            _mib(saved["activation_bytes"]),
            _mib(saved["activation_bytes"]),
            f"{_n(saved['activation_tensors'], 'save')}; {_mib(saved['activation_bytes_unique'])} in distinct storage",
        ),
        (
            "  kept on the device",
            _mib(r["activation_bytes_on_device_baseline"]),
            _mib(r["activation_bytes_on_device_offload"]),
            _n(r["activation_tensors_on_device_offload"], "tensor") + (f" ({reasons})" if reasons else ""),
        ),
        (
            "  copied into the pool",
            "-",
            _mib(r["bytes_offloaded_to_pool"]),
            _n(s1["tensors_offloaded"], "tensor"),
        ),
        (
            "  deduplicated (views of those)",
            "-",
            _mib(r["bytes_deduplicated"]),
            _n(s1["tensors_deduplicated"], "tensor") + ", no extra copy",
        ),
        (
            "parameter/buffer bytes saved (kept)",
            _mib(saved["parameter_bytes"] + saved["buffer_bytes"]),
            _mib(s1["kept_bytes_by_reason"].get("parameter", 0) + s1["kept_bytes_by_reason"].get("buffer", 0)),
            "never offloaded",
        ),
        (
            "reloaded in backward",
            "-",
            _mib(s1["bytes_reloaded"]),
            f"{_n(s1['tensors_reloaded'], 'copy').replace('copys', 'copies')}, {s1['tensors_reload_shared']} shared",
        ),
        ("", "", "", ""),
        ("pool (whole run)", "", "", ""),
        ("  peak in use / reserved", "-", f"{_mib(pool['peak_bytes_in_use'])} / {_mib(pool['bytes_reserved'])}", ""),
        (
            "  segments / backend allocs / allocs",
            "-",
            f"{pool['num_segments']} / {pool['num_backend_allocs']} / {pool['num_allocs']}",
            "",
        ),
        ("  in use after the run", "-", _mib(pool["bytes_in_use"]), "0 expected: nothing leaked"),
    ]
    if c["device"] == "cuda":
        rows.append(
            (
                "torch.cuda.max_memory_allocated",
                _mib(base["max_memory_allocated"]),
                _mib(off["max_memory_allocated"]),
                "whole run: weights, optimizer, activations",
            )
        )
    ratio = r["time_ratio"]
    spread = ""
    if r.get("time_ratio_min") is not None:
        spread = f" (min {r['time_ratio_min']:.2f}x, max {r['time_ratio_max']:.2f}x over steps)"
    rows += [
        (
            "median step time" + _timed_steps(c["steps"]),
            _ms(base["median_step_s"]),
            _ms(off["median_step_s"]),
            "n/a (one step)" if ratio is None else f"ratio offload/baseline median {ratio:.2f}x{spread}",
        ),
        (
            "loss (first -> last step)",
            f"{base['losses'][0]:.4f} -> {base['losses'][-1]:.4f}",
            f"{off['losses'][0]:.4f} -> {off['losses'][-1]:.4f}",
            "",
        ),
    ]
    w0 = max(len(row[0]) for row in rows)
    w1 = max(len(row[1]) for row in rows)
    w2 = max(len(row[2]) for row in rows)
    for a, b, cc, d in rows:
        lines.append(f"{a:<{w0}}  {b:>{w1}}  {cc:>{w2}}  {d}".rstrip())
    lines.append("")
    lines.append(
        "saved activations on the device at their peak (step 1, co.profile): "
        + saved_line(r["device_saved_peak_bytes"], r["saved_bytes_total"])
        + " (what autograd saved in a step, all on the device without offload)"
    )
    if r["grads_match"]:
        lines.append(f"gradients on step 1: bit-identical (torch.equal on all {r['num_grads_compared']} parameters)")
    else:
        lines.append(
            f"gradients on step 1: MISMATCH in {len(r['grad_mismatches'])} of {r['num_grads_compared']} parameters "
            f"(max |diff| {r['max_grad_abs_diff']}): {', '.join(r['grad_mismatches'][:8])}"
        )
    lines.append(
        f"losses on {'all ' if c['steps'] > 1 else ''}{_n(c['steps'], 'step')}: "
        + ("bit-identical" if r["losses_match"] else "MISMATCH (see demo.json)")
    )
    if not r["cpu_only"]:
        lines += _note(r["note"])
    return "\n".join(lines)


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _nothing_copied_lines(r: dict) -> list:
    """Why the recipe copied nothing, where it did: its block inputs are under min_bytes."""
    rc, c = r["recipe"], r["config"]
    if rc["bytes_offloaded_per_step"] or not rc.get("inputs_under_min_bytes"):
        return []
    return [
        f"  copied nothing: at size {c['size']!r} each block's input is under min_bytes={c['min_bytes']} "
        f"({_n(rc['inputs_under_min_bytes'], 'input')} kept as too_small), so here the recipe is checkpointing "
        "alone; --min-bytes 0 shows its copies, and a larger --size has inputs above the default "
        "(co.apply(model, offload={'min_bytes': 0}) in your own code)",
    ]


def _recipe_lines(r: dict) -> list:
    """The recommended recipe first, offload-everything as the contrast, and the bandwidth
    arithmetic that tells them apart."""
    rc, bw = r["recipe"], r["bandwidth_arithmetic"]
    total = rc["saved_bytes_total"]

    def peak(n):
        return "-" if n is None else f"{_mib(n)}" + (f" ({n / total:.0%} of {_mib(total)})" if total else "")

    held = rc["device_saved_peak_bytes"]
    block = rc.get("recompute_block_bytes")
    peak_now = None if held is None or block is None else held + block
    lines = [
        "recommended: checkpointed blocks with their inputs offloaded -- co.apply(model, offload=True)",
        (
            f"  saved activations on the device at peak: {peak(peak_now)} = {_mib(held)} of inputs (co.profile) + "
            f"~{_mib(block)} for the block being recomputed; copied to the pool per step: "
            f"{_mib(rc['bytes_offloaded_per_step'])}"
        ),
        (
            f"  step time: {_x(rc['time_ratio_vs_checkpoint'])} checkpointing alone (the copies' cost), "
            f"{_x(rc['time_ratio_vs_baseline'])} the baseline (checkpointing alone: "
            f"{_x(rc['checkpoint_ratio_vs_baseline'])}, the recompute)"
        ),
        "  gradients on step 1 and every loss: "
        + ("bit-identical to the baseline" if rc["grads_match"] and rc["losses_match"] else "MISMATCH"),
        *_nothing_copied_lines(r),
        "contrast: offload every saved tensor -- with co.offload(): around the forward",
        (
            f"  saved activations on the device at peak: {peak(rc['offload_everything_device_saved_peak_bytes'])}; "
            f"copied to the pool per step: {_mib(r['bytes_offloaded_to_pool'])}"
        ),
        f"  step time: {_x(rc['offload_everything_ratio_vs_baseline'])} the baseline",
    ]
    if rc.get("max_memory_allocated") is not None:
        lines.append(
            f"torch.cuda.max_memory_allocated: baseline {_mib(r['baseline']['max_memory_allocated'])}, "
            f"checkpoint {_mib(rc['checkpoint_max_memory_allocated'])}, recommended "
            f"{_mib(rc['max_memory_allocated'])}, "
            f"offload everything {_mib(r['offload']['max_memory_allocated'])}"
        )
    lines.append(
        f"bandwidth arithmetic (D2H {bw['d2h_gbps']:.1f} GB/s, H2D {bw['h2d_gbps']:.1f} GB/s, "
        f"{bw['bandwidth_source']}):"
    )
    for name, label in (("offload_everything", "offload everything"), ("recipe", "recommended")):
        a = bw[name]
        if a["copy_over_compute"] is None:
            verdict = "no compute time to compare with (one step)"
        elif a["copy_over_compute"] > 1:
            verdict = "copy-bound: the copies alone take longer than the compute they could hide behind"
        else:
            verdict = "the copies fit behind the compute"
        lines.append(
            f"  {label}: {_mib(a['d2h_bytes'])} out + {_mib(a['h2d_bytes'])} back = {_ms(a['copy_s'])} of copies vs "
            f"{_ms(a['compute_s'])} of compute ({a['compute_of']} step): {_x(a['copy_over_compute'])}; {verdict}"
        )
    if r["cpu_only"]:
        lines.append(
            "  (CPU run: the bandwidth is memcpy in one RAM and the times are CPU times; on a GPU the same "
            "arithmetic with PCIe bandwidth decides)"
        )
    return lines


def write_json(result: dict, out_dir: str) -> str:
    """Writes ``result`` to ``out_dir/demo.json`` (creating the folder); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, DEMO_JSON)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    return path
