"""What benchmarks/overlap.py measures: raw copy bandwidth, one strategy's steps, the gradient checks.

:func:`run_strategy` runs warmup and timed steps of one strategy and returns its row;
:func:`finish_rows` adds the numbers that compare the strategies of one sequence length.

Example::

    raw = raw_copy_bandwidth(1 << 20, torch.device("cpu"))
    row = run_strategy(model, tokens, build_strategy("checkpoint", device), device, args)
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time

import torch
import torch.nn.functional as F
from overlap_strategies import BASELINE, OURS, REFERENCES, MiB, Strategy

import ckpt_offload as co


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    co.synchronize()


def _mem_allocated(device: torch.device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _host_stats():
    """torch's pinned host allocator counters (CUDA), or None."""
    try:
        return dict(torch.cuda.host_memory_stats())
    except Exception:  # noqa: BLE001 - older torch / no CUDA: the row says "-"
        return None


def _reset_torch_host_allocator() -> None:
    for name in ("_host_emptyCache", "_cuda_resetPeakHostMemoryStats"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            with contextlib.suppress(Exception):
                fn()


def raw_copy_bandwidth(nbytes: int, device: torch.device, min_bytes_moved: int = 256 * MiB, max_calls: int = 64):
    """GB/s of a raw torch ``copy_`` of ``nbytes`` each way: D2H into a pinned tensor, H2D from
    it (``non_blocking=True``), destinations allocated once. On CPU: a plain memcpy ``copy_``."""
    on_gpu = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.fill_(1)
    calls = max(2, min(max_calls, math.ceil(min_bytes_moved / max(nbytes, 1))))
    if not on_gpu:
        calls = max(2, min(calls, 16))
    out = {
        "bytes": nbytes,
        "calls": calls,
        "method": "pinned copy_(non_blocking=True)" if on_gpu else "CPU memcpy copy_ (pageable)",
    }
    for direction, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        for _ in range(2):
            dst.copy_(src, non_blocking=on_gpu)
        _sync(device)
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                dst.copy_(src, non_blocking=on_gpu)
            _sync(device)
            samples.append(time.perf_counter() - t0)
        out[f"{direction}_gbps"] = calls * nbytes / statistics.median(samples) / 1e9
    del host, dev
    if on_gpu:
        _reset_torch_host_allocator()
    return out


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare_grads(a: dict | None, b: dict | None) -> dict | None:
    """``{"max_abs_diff", "bit_identical"}`` between two gradient dicts (None if either is)."""
    if a is None or b is None:
        return None
    if a.keys() != b.keys():
        return {"max_abs_diff": float("inf"), "bit_identical": False, "note": "different parameters have grads"}
    worst, same = 0.0, True
    for k in a:
        if not torch.equal(a[k], b[k]):
            same = False
            worst = max(worst, (a[k].float() - b[k].float()).abs().max().item())
    return {"max_abs_diff": worst, "bit_identical": same}


def _pool_stats(strategy: Strategy):
    return dict(strategy.pool.stats()) if strategy.pool is not None else None


def _profile_totals(step, strategy: Strategy):
    """Runs one step under ``co.profile()`` and returns its totals, or (None, reason)."""
    if not hasattr(co, "profile"):
        return None, "co.profile() does not exist in this build"
    try:
        # The strategy's own pool, so the totals' pool numbers describe it.
        with co.profile(pools=strategy.pool) if strategy.pool is not None else co.profile() as prof:
            step()
        totals = dict(prof.to_dict()["totals"])
    except Exception as e:  # noqa: BLE001 - the profiler is new: a failure must not lose the other numbers
        return None, f"co.profile() failed: {type(e).__name__}: {e}"
    if not (totals.get("d2h_bytes") or totals.get("h2d_bytes")):
        return None, "co.profile() recorded no copies"
    return totals, None


def run_strategy(model, tokens, strategy: Strategy, device: torch.device, args) -> dict:
    """Warmup (the first warmup step measures memory, bytes and gradients), timed steps, then
    one profiled step for ours. Returns the row (without the cross-strategy numbers)."""
    row = {"status": "ok"}
    on_gpu = device.type == "cuda"
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
        _reset_torch_host_allocator()
        torch.cuda.reset_peak_memory_stats(device)
    model.zero_grad(set_to_none=True)
    _sync(device)
    start_alloc = _mem_allocated(device)
    host_before = _host_stats() if on_gpu and strategy.name in ("hf_offload", "torchtune") else None

    def step(measure: dict | None = None):
        model.zero_grad(set_to_none=True)
        if measure is not None:
            _sync(device)
            before = _mem_allocated(device)
        if strategy.counter is not None:
            strategy.counter.tensors = strategy.counter.bytes = 0
        with strategy.context():
            logits = model(tokens[:, :-1], checkpoint_fn=strategy.checkpoint_fn)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        del logits
        if measure is not None:
            _sync(device)  # the side-stream copies are done and their sources released
            after = _mem_allocated(device)
            measure["resident_after_forward_bytes"] = None if before is None else after - before
            measure["pool_after_forward"] = _pool_stats(strategy)
            ctx = strategy.last_context
            if strategy.counter is not None:
                measure["saved_tensors"], measure["saved_bytes"] = strategy.counter.tensors, strategy.counter.bytes
            elif ctx is not None and hasattr(ctx, "stats") and strategy.name in OURS:
                with contextlib.suppress(Exception):
                    measure["context_stats"] = dict(ctx.stats())
        loss.backward()
        _sync(device)
        return loss.detach()

    # first step: memory, bytes, gradients
    measure: dict = {}
    loss0 = step(measure)
    row["loss"] = float(loss0.float().item())
    row["resident_after_forward_bytes"] = measure.get("resident_after_forward_bytes")
    first_grads = _grads(model)
    pool_after_first = _pool_stats(strategy)
    host_after_first = _host_stats() if host_before is not None else None
    for _ in range(max(0, args.warmup - 1)):
        step()

    times = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()  # ends with a synchronize
        times.append(time.perf_counter() - t0)
    row["step_times_s"] = times
    row["median_step_s"] = statistics.median(times)
    last_grads = _grads(model)
    row["repeatable"] = compare_grads(first_grads, last_grads)["bit_identical"]
    del last_grads

    peak = torch.cuda.max_memory_allocated(device) if on_gpu else None
    row["peak_device_bytes"] = peak
    row["peak_above_start_bytes"] = None if peak is None else peak - start_alloc

    # host memory
    host = {}
    if strategy.pool is not None:
        final = _pool_stats(strategy)
        after_fwd = measure.get("pool_after_forward") or {}
        requested = after_fwd.get("bytes_requested")
        host = {
            "kind": f"ckpt_offload pool ({final.get('backend')})",
            "bytes_requested": requested,
            "bytes_in_use_after_forward": after_fwd.get("bytes_in_use"),
            "bytes_reserved": final.get("bytes_reserved"),
            "peak_bytes_reserved": final.get("peak_bytes_reserved"),
            "peak_bytes_in_use": final.get("peak_bytes_in_use"),
            "num_backend_allocs": final.get("num_backend_allocs"),
            "backend_allocs_after_first_step": final.get("num_backend_allocs", 0)
            - pool_after_first.get("num_backend_allocs", 0),
            "reserved_over_requested": (final.get("peak_bytes_reserved") / requested) if requested else None,
            "d2h_bytes_per_step": requested,
            "h2d_bytes_per_step": requested,
        }
        if "context_stats" in measure:
            host["context_stats"] = measure["context_stats"]
    elif strategy.name in ("hf_offload", "torchtune"):
        requested = measure.get("saved_bytes")
        host = {
            "kind": "torch pinned host allocator" if on_gpu else "save_on_cpu, pageable (no copy on CPU)",
            "bytes_requested": requested,
            "tensors": measure.get("saved_tensors"),
            "d2h_bytes_per_step": requested,
            "h2d_bytes_per_step": requested,
        }
        final_host = _host_stats() if host_before is not None else None
        if final_host:
            reserved = final_host.get("allocated_bytes.peak")
            host.update(
                bytes_reserved=final_host.get("allocated_bytes.current"),
                peak_bytes_reserved=reserved,
                num_backend_allocs=final_host.get("num_host_alloc"),
                backend_allocs_after_first_step=(
                    final_host.get("num_host_alloc", 0) - (host_after_first or {}).get("num_host_alloc", 0)
                ),
                reserved_over_requested=(reserved / requested) if reserved and requested else None,
            )
    row["host"] = host or None

    # bandwidth and overlap from co.profile() (ours only; a separate, untimed step)
    row["profile"] = None
    if strategy.name in OURS:
        totals, why = _profile_totals(step, strategy)
        row["profile"] = totals
        row["profile_note"] = why

    if strategy.pool is not None:
        co.synchronize()
        strategy.pool.empty_cache()
    if on_gpu:
        _reset_torch_host_allocator()
    row["_first_grads"] = first_grads
    return row


def grads_check(name: str, row: dict, ref_grads: dict, rows: dict) -> dict:
    """The first step's gradients vs ``none``'s and vs the baseline's (same checkpointing)."""
    base = BASELINE[name]
    grads = row.get("_first_grads")
    return {
        "vs_none": compare_grads(grads, ref_grads.get("none")),
        "reference": base,
        "vs_reference": compare_grads(grads, ref_grads.get(base)) if base else None,
        "reference_repeatable": rows.get(base, {}).get("repeatable") if base else None,
    }


def finish_rows(rows: dict, raw: dict, device: torch.device) -> None:
    """Cross-strategy numbers of one sequence length: ratios, overhead vs the baseline, bandwidth
    vs raw, hidden fraction. ``rows`` maps strategy -> row (modified in place)."""
    ck = rows.get("checkpoint", {}).get("median_step_s")
    for name, row in rows.items():
        if row.get("status") != "ok":
            continue
        t = row["median_step_s"]
        row["ratio_to_checkpoint"] = t / ck if ck else None
        base = BASELINE[name]
        tb = rows.get(base, {}).get("median_step_s") if base else None
        row["baseline"] = base
        row["overhead_vs_baseline"] = (t / tb - 1.0) if tb else None

        # bandwidth and hidden copy time
        host = row.get("host") or {}
        prof = row.get("profile") or None
        bw = {"raw_d2h_gbps": raw.get("d2h_gbps"), "raw_h2d_gbps": raw.get("h2d_gbps")}
        if prof:
            bw["method"] = "co.profile()"
            for d in ("d2h", "h2d"):
                g = prof.get(f"{d}_gbps")
                bw[f"{d}_gbps"] = g
                bw[f"{d}_fraction_of_raw"] = (g / raw[f"{d}_gbps"]) if g and raw.get(f"{d}_gbps") else None
            row["hidden_fraction"] = prof.get("hidden_fraction")
            row["hidden_method"] = "co.profile()"
        else:
            bw["method"] = None
            bw["d2h_gbps"] = bw["h2d_gbps"] = None
            d2h, h2d = host.get("d2h_bytes_per_step"), host.get("h2d_bytes_per_step")
            row["hidden_fraction"], row["hidden_method"] = None, None
            if d2h and h2d and tb and raw.get("d2h_gbps") and raw.get("h2d_gbps"):
                copy_s = d2h / (raw["d2h_gbps"] * 1e9) + h2d / (raw["h2d_gbps"] * 1e9)
                row["copy_seconds_at_raw_bandwidth"] = copy_s
                row["hidden_fraction"] = min(1.0, max(0.0, 1.0 - (t - tb) / copy_s))
                row["hidden_method"] = f"estimate: 1 - (t - t_{base}) / (bytes / raw bandwidth)" + (
                    " (CPU: worker-thread memcpy)" if device.type != "cuda" else ""
                )
            if name in OURS:
                bw["note"] = row.get("profile_note") or "needs co.profile()"
        row["bandwidth"] = bw if name not in REFERENCES else None
