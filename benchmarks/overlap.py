#!/usr/bin/env python3
"""Overlap benchmark: ckpt_offload side by side with every peer, on a built-in Llama-style decoder.

For each sequence length (short to long) the same model, the same weights and the same random
tokens go through every strategy, one after the other, in one process:

==============================  ===================================================================
``none``                        no checkpointing: every activation stays on the device
``checkpoint``                  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` per layer
``hf_offload``                  Hugging Face's ``offload=True``: every layer's checkpoint call runs
                                inside ``save_on_cpu(pin_memory=True)`` (transformers'
                                ``checkpoint_func``; copies on the compute stream)
``torchtune``                   torchtune's ``OffloadActivations`` around the checkpointed model
                                forward, output head excluded (``NoOpManager``), as its recipes do
                                (when torchtune is installed; otherwise the row says so)
``co_offload``                  ``with co.offload():`` around the plain model forward (no recompute)
``co_checkpoint_compute``       ``co.checkpoint(layer, x, offload={"stream": "compute",
                                "prefetch_bytes": 0})``: copies on the compute stream, no prefetch
``co_checkpoint_side_prefetch`` ``co.checkpoint(..., offload={"stream": "side"})``: side copy streams
                                and the default prefetch
``co_checkpoint_side_batched``  as above plus ``batch_below=256 KiB, min_bytes=4096`` (small saved
                                tensors gathered into one copy)
==============================  ===================================================================

``none`` and ``checkpoint`` always run: they are the references for the step-time ratio, for the
gradients and for the hidden-copy estimate. A strategy whose options this ckpt_offload build does
not accept yet (``prefetch_bytes``, ``batch_below``) is reported as ``unavailable: <reason>``.

Per strategy: median step time (warmup excluded) and its ratio to ``checkpoint``; peak device
memory; device memory still held after forward (the activations); host bytes reserved vs
requested and the backend allocations after the first step; achieved D2H/H2D bandwidth vs a raw
pinned ``copy_`` of the typical activation size measured in the same run; the fraction of copy
time hidden behind compute; the gradients' difference from ``none`` and from the run with the
same checkpointing. See benchmarks/README.md for every column.

Contexts (``co.offload``, torchtune) wrap the model's forward (logits); the float32 loss is computed
outside, identically for every strategy.

Usage::

    python3 benchmarks/overlap.py                              # GPU: 1b preset, seq 512..4096
    python3 benchmarks/overlap.py --quick                      # a smoke run (~seconds on CPU)
    python3 benchmarks/overlap.py --out results/ --seq-lens 1024,4096 --batch 2 --model small
    python3 benchmarks/overlap.py --device cpu --strategies co_offload,co_checkpoint_side_prefetch

Without a GPU (or with ``--device cpu``) a small configuration runs on CPU tensors (our strategies
with ``devices=["cpu"], min_bytes=0``; ``save_on_cpu`` with ``pin_memory=False``). Those are CPU
numbers: only the ratios, the byte counts and the gradient checks mean something there.

Benchmarks measure, they don't assert: the exit status is 0 unless a strategy crashed or one of
ours gave gradients that differ from the run with the same checkpointing (when that run is itself
repeatable).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.utils.checkpoint as torch_checkpoint

try:
    import ckpt_offload as co
except ImportError:  # run from a checkout without installing: benchmarks/ sits next to the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ckpt_offload as co
import torch.nn.functional as F

from ckpt_offload.demo.model import LLAMA_CONFIGS, LlamaDecoder, make_llama_config, random_tokens

KiB, MiB = 1 << 10, 1 << 20

STRATEGIES = (
    "none",
    "checkpoint",
    "hf_offload",
    "torchtune",
    "co_offload",
    "co_checkpoint_compute",
    "co_checkpoint_side_prefetch",
    "co_checkpoint_side_batched",
)
REFERENCES = ("none", "checkpoint")
OURS = ("co_offload", "co_checkpoint_compute", "co_checkpoint_side_prefetch", "co_checkpoint_side_batched")
DESCRIPTIONS = {
    "none": "no checkpointing",
    "checkpoint": "torch.utils.checkpoint.checkpoint(use_reentrant=False) per layer",
    "hf_offload": "Hugging Face offload=True: each layer's checkpoint inside save_on_cpu(pin_memory=True)",
    "torchtune": "torchtune OffloadActivations() around the checkpointed model forward, output head excluded",
    "co_offload": "with co.offload(): around the plain model forward",
    "co_checkpoint_compute": 'co.checkpoint(offload={"stream": "compute", "prefetch_bytes": 0}) per layer',
    "co_checkpoint_side_prefetch": 'co.checkpoint(offload={"stream": "side"}) per layer (default prefetch)',
    "co_checkpoint_side_batched": 'co.checkpoint(offload={"stream": "side", "batch_below": 262144, '
                                  '"min_bytes": 4096}) per layer',
}
#: The run with the same computation and no copies: the reference for the gradients' bit identity,
#: the step-time overhead and the hidden-copy estimate.
BASELINE = {
    "none": None,
    "checkpoint": None,
    "hf_offload": "checkpoint",
    "torchtune": "checkpoint",
    "co_offload": "none",
    "co_checkpoint_compute": "checkpoint",
    "co_checkpoint_side_prefetch": "checkpoint",
    "co_checkpoint_side_batched": "checkpoint",
}
#: co.offload options per strategy of ours (the device-specific defaults are added at run time).
OUR_OPTIONS = {
    "co_offload": {},
    "co_checkpoint_compute": {"stream": "compute", "prefetch_bytes": 0},
    "co_checkpoint_side_prefetch": {"stream": "side"},
    "co_checkpoint_side_batched": {"stream": "side", "batch_below": 256 * KiB, "min_bytes": 4096},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

GPU_DEFAULTS = {"model": "1b", "seq_lens": [512, 1024, 2048, 4096], "batch": 1, "steps": 6, "warmup": 2,
                "dtype": "bfloat16"}
GPU_QUICK = {"model": "small", "seq_lens": [512, 1024], "batch": 1, "steps": 3, "warmup": 1, "dtype": "bfloat16"}
CPU_DEFAULTS = {"model": "tiny", "seq_lens": [64, 128, 256], "batch": 2, "steps": 5, "warmup": 2, "dtype": "float32"}
CPU_QUICK = {"model": "tiny", "seq_lens": [64, 128], "batch": 2, "steps": 3, "warmup": 1, "dtype": "float32"}

CPU_WARNING = (
    "CPU NUMBERS, NOT GPU NUMBERS: no usable CUDA device (or --device cpu). Our strategies offload CPU "
    "tensors into a pageable pool through CPU copy 'streams' (worker threads), save_on_cpu runs with "
    "pin_memory=False (it keeps CPU tensors as they are). Step times, bandwidths and the hidden fraction say "
    "nothing about PCIe or CUDA stream overlap; the ratios, the byte counts and the gradient checks do mean "
    "something."
)


class Unavailable(Exception):
    """A strategy that cannot run here (not installed, option not supported yet, needs a GPU)."""


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _positive_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq-lens: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--seq-lens: expected positive integers, got {text!r}")
    return values


def _strategy_list(text: str) -> list[str]:
    names = [v for v in text.replace(" ", "").split(",") if v]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--strategies: unknown strategy {unknown or text!r}; choose from {', '.join(STRATEGIES)}")
    return names


def gpu_usable() -> bool:
    return bool(torch.cuda.is_available() and co.build_info()["cuda_compiled"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    co.synchronize()


def _mem_allocated(device: torch.device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _fmt(x, spec=".3f", none="-") -> str:
    return none if x is None else format(x, spec)


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


class SaveCounter:
    """Tensors and bytes that :class:`CountingSaveOnCpu` contexts sharing it copied to the host."""

    def __init__(self):
        self.tensors = 0
        self.bytes = 0


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``torch.autograd.graph.save_on_cpu`` that also counts the tensors and bytes it copied into
    ``counter`` (a :class:`SaveCounter`): the sum of the host tensors' sizes, i.e. what it asked
    the host allocator for (torch's pinned allocator rounds each request up to a power of two).

    Example::

        counter = SaveCounter()
        with CountingSaveOnCpu(counter, pin_memory=True):
            loss = model(x).sum()
        print(counter.tensors, counter.bytes)
    """

    def __init__(self, counter: SaveCounter, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        inner = self.pack_hook

        def pack(tensor):
            packed = inner(tensor)
            host = packed[1]
            counter.tensors += 1
            counter.bytes += host.numel() * host.element_size()
            return packed

        self.pack_hook = pack


def hf_checkpoint_fn(counter: SaveCounter, pin_memory: bool, device_type: str):
    """Hugging Face's ``checkpoint_func`` for ``offload=True`` (transformers' modeling_utils):
    ``with save_on_cpu(pin_memory=True): return checkpoint(function, *args, **kwargs)``, per layer,
    with ``use_reentrant=False`` (its default kwargs), counting what it copies."""

    def checkpoint_func(function, *args, **kwargs):
        with CountingSaveOnCpu(counter, pin_memory=pin_memory, device_type=device_type):
            return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    return checkpoint_func


def _torchtune_context(model):
    """torchtune's recipe setup (``get_act_offloading_ctx_manager``): ``OffloadActivations``
    around the forward, the output head under ``NoOpManager`` (its activations are needed first in
    backward). Returns (context factory, cleanup)."""
    from torchtune.training import OffloadActivations

    handles = []
    try:
        from torchtune.training import NoOpManager

        noop = NoOpManager()
        handles.append(model.lm_head.register_forward_pre_hook(lambda *a: noop.__enter__()))
        handles.append(model.lm_head.register_forward_hook(lambda *a: noop.__exit__(None, None, None)))
    except ImportError:
        pass

    def cleanup():
        for h in handles:
            h.remove()

    return OffloadActivations, cleanup


# ----------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------


class Strategy:
    """How one strategy runs a step: a context around the forward, an optional per-layer
    checkpoint function, and (ours) the fresh pool it offloads into."""

    def __init__(self, name, context_factory=None, checkpoint_fn=None, pool=None, options=None, counter=None,
                 cleanup=None):
        self.name = name
        self.context_factory = context_factory or contextlib.nullcontext
        self.checkpoint_fn = checkpoint_fn
        self.pool = pool
        self.options = options
        self.counter = counter  # SaveCounter of hf_offload
        self.cleanup = cleanup or (lambda: None)
        self.last_context = None

    def context(self):
        self.last_context = self.context_factory()
        return self.last_context


def _probe_options(name: str, options: dict) -> None:
    """Raises Unavailable when this ckpt_offload does not accept ``options`` (e.g. a key that is
    still being added), by running a 4-element CPU checkpoint / offload with them."""
    probe = {k: v for k, v in options.items() if k not in ("pool", "devices")}
    probe.update(devices=["cpu"], pool=co.HostPool(pinned=False))
    x = torch.ones(4, requires_grad=True)
    try:
        if name == "co_offload":
            with co.offload(**probe):
                y = x.exp()
        else:
            y = co.checkpoint(torch.exp, x, offload=probe)
        y.sum().backward()
        co.synchronize()
    except (TypeError, ValueError) as e:
        raise Unavailable(f"unavailable: {type(e).__name__}: {e}") from None


def build_strategy(name: str, device: torch.device, model=None) -> Strategy:
    """The :class:`Strategy` ``name`` for ``device``; raises :class:`Unavailable` with the reason."""
    on_gpu = device.type == "cuda"
    torch_ckpt = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
    if name == "none":
        return Strategy(name)
    if name == "checkpoint":
        return Strategy(name, checkpoint_fn=torch_ckpt)
    if name == "hf_offload":
        counter = SaveCounter()
        return Strategy(name, checkpoint_fn=hf_checkpoint_fn(counter, on_gpu, device.type if on_gpu else "cuda"),
                        counter=counter)
    if name == "torchtune":
        try:
            import torchtune.training  # noqa: F401
        except ImportError:
            raise Unavailable("not installed") from None
        if not on_gpu:
            raise Unavailable("unavailable: OffloadActivations needs a CUDA device")
        factory, cleanup = _torchtune_context(model)
        return Strategy(name, factory, torch_ckpt, cleanup=cleanup)
    if name in OUR_OPTIONS:
        options = dict(OUR_OPTIONS[name])
        if not on_gpu:
            # CPU tensors into a pageable pool; the tiny model's tensors are under 256 KiB.
            options["devices"] = ["cpu"]
            options.setdefault("min_bytes", 0)
        _probe_options(name, options)
        pool = co.HostPool() if on_gpu else co.HostPool(pinned=False)
        options["pool"] = pool
        if name == "co_offload":
            return Strategy(name, lambda: co.offload(**options), None, pool, options)
        return Strategy(name, None, functools.partial(co.checkpoint, offload=options), pool, options)
    raise ValueError(f"strategy: unknown name {name!r}; choose from {STRATEGIES}")


# ----------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------


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
    out = {"bytes": nbytes, "calls": calls,
           "method": "pinned copy_(non_blocking=True)" if on_gpu else "CPU memcpy copy_ (pageable)"}
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
        host = {"kind": "torch pinned host allocator" if on_gpu else "save_on_cpu, pageable (no copy on CPU)",
                "bytes_requested": requested, "tensors": measure.get("saved_tensors"),
                "d2h_bytes_per_step": requested, "h2d_bytes_per_step": requested}
        final_host = _host_stats() if host_before is not None else None
        if final_host:
            reserved = final_host.get("allocated_bytes.peak")
            host.update(
                bytes_reserved=final_host.get("allocated_bytes.current"),
                peak_bytes_reserved=reserved,
                num_backend_allocs=final_host.get("num_host_alloc"),
                backend_allocs_after_first_step=(final_host.get("num_host_alloc", 0)
                                                 - (host_after_first or {}).get("num_host_alloc", 0)),
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
                row["hidden_method"] = (
                    f"estimate: 1 - (t - t_{base}) / (bytes / raw bandwidth)"
                    + (" (CPU: worker-thread memcpy)" if device.type != "cuda" else "")
                )
            if name in OURS:
                bw["note"] = row.get("profile_note") or "needs co.profile()"
        row["bandwidth"] = bw if name not in REFERENCES else None


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------


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
        per_seq.append({
            "seq_len": seq,
            "ours_strategy": "co_checkpoint_side_prefetch",
            "ours_status": ours.get("status", "not run"),
            "ours_overhead": o,
            "hf_overhead": h,
            "ours_over_hf_overhead": (o / h) if (o is not None and h and h > 0) else None,
            "less_than_half_of_hf": (o < 0.5 * h) if (o is not None and h is not None and h > 0) else None,
        })
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
                if all(p["less_than_half_of_hf"] is not None for p in per_seq) else None),
            "bandwidth_at_least_90pct_of_raw": (
                min(bw["d2h_fraction_of_raw"], bw["h2d_fraction_of_raw"]) >= 0.9
                if bw.get("d2h_fraction_of_raw") and bw.get("h2d_fraction_of_raw") else None),
            "reserved_at_most_1_1x_requested": (host["reserved_over_requested"] <= 1.1
                                                if host.get("reserved_over_requested") else None),
            "zero_backend_allocs_after_first_step": (host["backend_allocs_after_first_step"] == 0
                                                     if host.get("backend_allocs_after_first_step") is not None
                                                     else None),
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
        f"{report['build_info'].get('pool_backend')}) · {report['date']}")
    lines.append(
        f"Model `{m['name']}` ({m['num_parameters'] / 1e6:.1f} M parameters, {m['layers']} layers, dim {m['dim']}, "
        f"{m['heads']}/{m['kv_heads']} heads, SwiGLU {m['ffn_dim']}, vocab {m['vocab']}) · {report['args']['dtype']}"
        f" · batch {report['args']['batch']} · {report['args']['steps']} timed steps after "
        f"{report['args']['warmup']} warmup · times are medians{' (CPU times)' if cpu else ''}")
    lines.append("")

    hl = report.get("headline") or {}
    lines.append("## Headline")
    lines.append("")
    if cpu:
        lines.append("CPU run: the overheads below are CPU step-time ratios, not the GPU targets.")
        lines.append("")
    lines.append("| seq len | co_checkpoint_side_prefetch overhead vs checkpoint | hf_offload overhead | "
                 "ours / HF overhead | ours < half of HF |")
    lines.append("|---:|---:|---:|---:|---|")
    for p in hl.get("per_seq", []):
        o = "-" if p["ours_overhead"] is None else f"{p['ours_overhead'] * 100:+.1f}%"
        if p["ours_overhead"] is None and p["ours_status"] != "ok":
            o = p["ours_status"]
        h = "-" if p["hf_overhead"] is None else f"{p['hf_overhead'] * 100:+.1f}%"
        lines.append(f"| {p['seq_len']} | {o} | {h} | {_fmt(p['ours_over_hf_overhead'], '.2f')} | "
                     f"{_yes(p['less_than_half_of_hf'])} |")
    t = hl.get("targets")
    if t:
        lines.append("")
        lines.append(f"Issue-4 targets at seq len {t['at_seq_len']}"
                     f"{' (CPU run: indicative only for the byte counts)' if cpu else ''}: "
                     f"within 3% of checkpoint: {_yes(t['within_3pct_of_checkpoint'])}; "
                     f"< half of HF's overhead at every length: {_yes(t['less_than_half_hf_overhead_at_every_length'])}; "
                     f">= 90% of raw bandwidth: {_yes(t['bandwidth_at_least_90pct_of_raw'])}; "
                     f"reserved <= 1.1x requested: {_yes(t['reserved_at_most_1_1x_requested'])}; "
                     f"zero backend allocations after step 1: {_yes(t['zero_backend_allocs_after_first_step'])}.")
    lines.append("")

    by_seq: dict = {}
    for r in report["results"]:
        by_seq.setdefault(r["seq_len"], []).append(r)
    for seq in sorted(by_seq):
        raw = report["raw_bandwidth"].get(str(seq)) or {}
        lines.append(f"## seq len {seq}")
        lines.append("")
        lines.append(f"Raw copy ({raw.get('method', '-')}, {_mib(raw.get('bytes'))} MiB = one layer input): "
                     f"D2H {_fmt(raw.get('d2h_gbps'), '.2f')} GB/s, H2D {_fmt(raw.get('h2d_gbps'), '.2f')} GB/s.")
        lines.append("")
        lines.append("| strategy | step ms | x checkpoint | peak MiB | resident after fwd MiB | host reserved / "
                     "requested MiB | backend allocs after step 1 | D2H GB/s (of raw) | H2D GB/s (of raw) | "
                     "copy hidden | grads vs none: max abs diff | = same-checkpointing run |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in by_seq[seq]:
            if r["status"] != "ok":
                lines.append(f"| {r['strategy']} | {r['status']} |" + " |" * 10)
                continue
            host = r.get("host") or {}
            res = host.get("peak_bytes_reserved")
            req = host.get("bytes_requested")
            host_s = "-" if not host else f"{_mib(res)} / {_mib(req)}"
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
                f"| {r['strategy']} | {r['median_step_s'] * 1e3:.2f} | {_fmt(r.get('ratio_to_checkpoint'))} | "
                f"{_mib(r.get('peak_above_start_bytes'))} | {_mib(r.get('resident_after_forward_bytes'))} | {host_s} | "
                f"{'-' if allocs is None else allocs} | {bw_cell('d2h')} | {bw_cell('h2d')} | {hidden} | {diff} | "
                f"{same} |")
        lines.append("")
    lines.append("Columns: benchmarks/README.md, section overlap.py. Peak MiB is max_memory_allocated above what "
                 "was allocated when the strategy started (weights, reference gradients). \"(est.)\": hidden "
                 "fraction estimated from step times and the raw bandwidth (no co.profile()).")
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
    fig.suptitle(f"{report.get('gpu_name') or 'CPU (not GPU numbers)'} · {m['name']} · batch "
                 f"{report['args']['batch']} · {report['args']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _public(row: dict) -> dict:
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


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short smoke run (CPU: ~seconds)")
    p.add_argument("--seq-lens", type=_positive_int_list, default=None,
                   help="comma-separated sequence lengths, e.g. 512,1024,2048,4096")
    p.add_argument("--batch", type=int, default=None, help="batch size")
    p.add_argument("--steps", type=int, default=None, help="timed steps per strategy")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before timing (>= 1; the first measures memory, bytes and gradients)")
    p.add_argument("--model", choices=tuple(LLAMA_CONFIGS), default=None,
                   help="Llama preset (GPU default 1b, CPU default tiny)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="GPU default bfloat16, CPU float32")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--strategies", type=_strategy_list, default=list(STRATEGIES),
                   help="comma-separated subset (none and checkpoint always run): " + ",".join(STRATEGIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip a sequence length when it is predicted to end after this many seconds from the "
                        "start (its rows say 'skipped')")
    p.add_argument("--out", default=None, help="write overlap.json, overlap.md, overlap.png into this folder")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if gpu_usable() else "cpu"
    elif args.device == "cuda" and not gpu_usable():
        p.error("--device cuda: no usable CUDA device here (torch.cuda.is_available() is False or ckpt_offload "
                "was built without CUDA); use --device cpu or auto")
    on_gpu = args.device == "cuda"
    defaults = (GPU_QUICK if args.quick else GPU_DEFAULTS) if on_gpu else (CPU_QUICK if args.quick else CPU_DEFAULTS)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("batch", "steps", "warmup", "layers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name}: must be >= 1, got {v}")
    cfg = LLAMA_CONFIGS[args.model]
    too_long = [s for s in args.seq_lens if s > cfg.max_seq]
    if too_long:
        p.error(f"--seq-lens: {too_long} longer than the {args.model} preset's max_seq={cfg.max_seq}")
    args.seq_lens = sorted(set(args.seq_lens))
    args.strategies = [s for s in STRATEGIES if s in REFERENCES or s in args.strategies]
    return args


def _progress(total: int, disable: bool):
    try:
        if disable:
            raise ImportError
        from tqdm import tqdm

        return tqdm(total=total, desc="overlap", unit="run", leave=False, dynamic_ncols=True)
    except ImportError:
        class _Null:
            @staticmethod
            def write(s):
                print(s)

            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Null()


def _print_row(row: dict, write) -> None:
    if row["status"] != "ok":
        write(f"  {row['strategy']:<28} {row['status']}")
        return
    host = row.get("host") or {}
    g = (row.get("grads") or {}).get("vs_none") or {}
    vr = (row.get("grads") or {}).get("vs_reference")
    write(f"  {row['strategy']:<28} {row['median_step_s'] * 1e3:9.2f} ms  x{_fmt(row.get('ratio_to_checkpoint'))}"
          f"  peak {_mib(row.get('peak_above_start_bytes'))} MiB  host req {_mib(host.get('bytes_requested'))} MiB"
          f"  grads vs none {'=' if g.get('bit_identical') else _fmt(g.get('max_abs_diff'), '.1e')}"
          + ("" if vr is None else f", vs {row['grads']['reference']} {'=' if vr['bit_identical'] else 'DIFF'}"))


def main(argv=None) -> int:
    """Runs the benchmark; returns the exit status. Example::

        main(["--quick", "--out", "/tmp/overlap"])       # CPU: a few seconds
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    old_threads = torch.get_num_threads()
    if not on_gpu:
        # torch's intra-op pool makes tiny CPU kernels slow and noisy on a 2-core machine.
        torch.set_num_threads(1)
    t_start = time.perf_counter()
    status = 0
    try:
        overrides = {"layers": args.layers} if args.layers else {}
        cfg = make_llama_config(args.model, **overrides)
        torch.manual_seed(args.seed)
        model = LlamaDecoder(cfg, seed=args.seed, device=device, dtype=dtype).train()
        report = {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),  # noqa: UP017 - Python 3.9
            "mode": "gpu" if on_gpu else "cpu",
            "warning": None if on_gpu else CPU_WARNING,
            "gpu_name": torch.cuda.get_device_name(device) if on_gpu else None,
            "torch_version": torch.__version__,
            "build_info": co.build_info(),
            "co_profile_available": hasattr(co, "profile"),
            "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                     "python": platform.python_version(), "cpus": os.cpu_count(),
                     "torch_threads": torch.get_num_threads()},
            "args": {k: v for k, v in vars(args).items()},
            "model": {**cfg.as_dict(), "num_parameters": model.num_parameters()},
            "strategies": {s: DESCRIPTIONS[s] for s in args.strategies},
            "raw_bandwidth": {},
            "results": [],
        }
        print(f"overlap: {report['gpu_name'] or 'CPU'} · model {cfg.name} ({model.num_parameters() / 1e6:.1f} M "
              f"params) · {args.dtype} · batch {args.batch} · seq {args.seq_lens} · {args.steps} steps "
              f"(+{args.warmup} warmup)" + ("" if on_gpu else " · CPU numbers, not GPU numbers"))
        bar = _progress(len(args.seq_lens) * len(args.strategies), args.no_progress)
        last = None  # (seq, seconds) of the previous length, to predict the next one
        for seq in args.seq_lens:
            elapsed = time.perf_counter() - t_start
            # The next length takes about (seq / previous seq) times as long (linear layers dominate).
            predicted = 0.0 if last is None else last[1] * 1.25 * seq / last[0]
            if args.budget_s is not None and elapsed + predicted > args.budget_s:
                for name in args.strategies:
                    report["results"].append({"seq_len": seq, "batch": args.batch, "strategy": name,
                                              "status": f"skipped: --budget-s {args.budget_s:g} s would be "
                                                        f"exceeded (predicted {elapsed + predicted:.0f} s)"})
                bar.update(len(args.strategies))
                bar.write(f"seq {seq}: {report['results'][-1]['status']}")
                continue
            t_seq = time.perf_counter()
            tokens = random_tokens(cfg.vocab, args.batch, seq, seed=args.seed, device=device)
            act_bytes = args.batch * seq * cfg.dim * torch.empty((), dtype=dtype).element_size()
            raw = raw_copy_bandwidth(act_bytes, device)
            report["raw_bandwidth"][str(seq)] = raw
            rows: dict = {}
            ref_grads: dict = {}
            for name in args.strategies:
                bar.set_postfix_str(f"seq {seq} {name}")
                try:
                    strategy = build_strategy(name, device, model)
                    try:
                        row = run_strategy(model, tokens, strategy, device, args)
                    finally:
                        strategy.cleanup()
                except Unavailable as e:
                    row = {"status": str(e)}
                except Exception as e:  # noqa: BLE001 - one strategy's crash must not lose the others
                    traceback.print_exc()
                    row = {"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                    status = 1
                    model.zero_grad(set_to_none=True)
                    if on_gpu:
                        torch.cuda.empty_cache()
                row.update(seq_len=seq, batch=args.batch, strategy=name, description=DESCRIPTIONS[name])
                if row["status"] == "ok":
                    if name in REFERENCES:
                        ref_grads[name] = row["_first_grads"]
                    row["grads"] = grads_check(name, row, ref_grads, rows)
                    row.pop("_first_grads")  # one model's worth of gradients: free it now
                rows[name] = row
                bar.update(1)
            finish_rows(rows, raw, device)
            for name in OURS:
                g = (rows.get(name) or {}).get("grads") or {}
                vr = g.get("vs_reference")
                if vr is not None and not vr["bit_identical"] and g.get("reference_repeatable"):
                    bar.write(f"overlap: {name} at seq {seq}: gradients differ from {g['reference']} "
                              f"(max abs diff {vr['max_abs_diff']:.3e})")
                    status = 1
            report["results"].extend(_public(r) for r in rows.values())
            del rows, ref_grads
            bar.write(f"seq {seq} (raw copy of {_mib(act_bytes)} MiB: D2H {raw['d2h_gbps']:.2f} GB/s, "
                  f"H2D {raw['h2d_gbps']:.2f} GB/s{'' if on_gpu else ', CPU memcpy'})")
            for r in [r for r in report["results"] if r["seq_len"] == seq]:
                _print_row(r, bar.write)
            last = (seq, time.perf_counter() - t_seq)
            report["headline"] = headline(report["results"], cpu=not on_gpu)
            report["elapsed_s"] = time.perf_counter() - t_start
            if args.out:
                write_outputs(report, args.out)  # after every length: a timeout keeps what was measured
        bar.close()
        report["headline"] = headline(report["results"], cpu=not on_gpu)
        report["elapsed_s"] = time.perf_counter() - t_start
        for p in report["headline"]["per_seq"]:
            o, h = p["ours_overhead"], p["hf_overhead"]
            print(f"headline seq {p['seq_len']}: co_checkpoint_side_prefetch vs checkpoint "
                  f"{'-' if o is None else f'{o * 100:+.1f}%'}, hf_offload "
                  f"{'-' if h is None else f'{h * 100:+.1f}%'}" + ("" if on_gpu else " (CPU times)"))
        if args.out:
            write_outputs(report, args.out)
            written = ["overlap.json", "overlap.md"] + ([] if report.get("plot") else ["overlap.png"])
            print(f"wrote {', '.join(written)} to {args.out}" + (f" (overlap.png {report['plot']})"
                                                                   if report.get("plot") else ""))
        print(f"overlap: done in {report['elapsed_s']:.1f} s")
    finally:
        torch.set_num_threads(old_threads)
    return status


if __name__ == "__main__":
    sys.exit(main())
