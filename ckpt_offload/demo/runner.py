"""``python -m ckpt_offload demo``, the running: train the built-in transformer plainly, with the
recommended recipe, and with everything offloaded, and gather every number into one JSON-able
result (``report.py`` words it).

Four training runs with the same seed, the same data and dropout on: a plain one (``baseline``);
every block checkpointed (``checkpoint``, ``co.apply(model)``); the recommended recipe, every
block checkpointed with its input offloaded (``recipe_run``, ``co.apply(model, offload=...)``);
and every saved tensor offloaded (``offload``, forward passes inside :class:`ckpt_offload.offload`).
Besides each run's device peak, bytes copied and step times, the result holds the bandwidth
arithmetic that tells them apart: bytes copied each way per step over the link's GB/s (measured by
co.profile), against the compute those copies could hide behind. Then, for offload-everything, how
many activation bytes autograd saved, how many stayed on the device and how many went to the host
pool, the pool's own counters, and whether the gradients of the first step and the losses of
every step are bit-identical in every run (they must be: offloading changes where a saved tensor
waits, never its bytes; the checkpoint's recompute restores the RNG state).

How the bytes are counted, so the two columns are comparable:

* baseline: a counting ``torch.autograd.graph.saved_tensors_hooks`` on the first step sorts every
  saved tensor into parameter (its storage is a parameter's), buffer, or activation, and sums the
  bytes of the storage span it reaches, the way ckpt_offload's packer measures a tensor.
* offload: ``ctx.stats()`` after the first step. "Kept on the device" is ``bytes_kept`` less the
  parameters and buffers (those are never offloaded and are reported on their own row).

Both are per-save sums for one training step: a tensor saved by two autograd nodes counts twice.

Example::

    from ckpt_offload.demo import run_demo, format_report
    result = run_demo(size="tiny", steps=3, device="cpu", min_bytes=0)
    print(format_report(result))
    assert result["grads_match"]
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import sys
import time

import torch

from ckpt_offload._info import build_info
from ckpt_offload._runtime import _C, gpu_usable, synchronize
from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_batch, make_config
from ckpt_offload.offloading import offload
from ckpt_offload.options import DEFAULT_MIN_BYTES
from ckpt_offload.pool import HostPool

__all__ = ["run_demo", "default_device", "gpu_usable"]


def default_device() -> str:
    """``"cuda"`` when :func:`gpu_usable`, else ``"cpu"``."""
    return "cuda" if gpu_usable() else "cpu"


class _SavedBytesCounter:
    """A saved-tensor hook pair that counts, by kind, what autograd saves and changes nothing."""

    def __init__(self, model: torch.nn.Module, min_bytes: int):
        self.min_bytes = min_bytes
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.buffer_storages = {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.counts = {"parameter": [0, 0], "buffer": [0, 0], "activation": [0, 0], "activation_small": [0, 0]}
        self.unique = {}  # storage data_ptr -> (lo, hi) byte range over every save of it

    def pack(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        ptr = t.untyped_storage().data_ptr() if t.layout == torch.strided else None
        if isinstance(t, torch.nn.Parameter) or ptr in self.param_storages:
            kind, nbytes = "parameter", t.numel() * t.element_size()
        elif ptr in self.buffer_storages:
            kind, nbytes = "buffer", t.numel() * t.element_size()
        else:
            kind, nbytes = "activation", _C.span_bytes(t)
            if nbytes < self.min_bytes:
                self.counts["activation_small"][0] += 1
                self.counts["activation_small"][1] += nbytes
            lo = t.storage_offset() * t.element_size()
            old = self.unique.get(ptr, (lo, lo + nbytes))
            self.unique[ptr] = (min(old[0], lo), max(old[1], lo + nbytes))
        self.counts[kind][0] += 1
        self.counts[kind][1] += nbytes
        # A detached alias, not t itself: an output saved by its own node would otherwise form
        # a reference cycle and keep the graph (and its memory) alive until the next gc.
        return t.detach()

    @staticmethod
    def unpack(t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def result(self) -> dict:
        c = self.counts
        return {
            "saved_tensors": sum(v[0] for k, v in c.items() if k != "activation_small"),
            "activation_tensors": c["activation"][0],
            "activation_bytes": c["activation"][1],
            "activation_bytes_unique": sum(hi - lo for lo, hi in self.unique.values()),
            "activation_tensors_below_min_bytes": c["activation_small"][0],
            "activation_bytes_below_min_bytes": c["activation_small"][1],
            "parameter_tensors": c["parameter"][0],
            "parameter_bytes": c["parameter"][1],
            "buffer_tensors": c["buffer"][0],
            "buffer_bytes": c["buffer"][1],
        }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class SimpleAdam:
    """Plain Adam, enough for a demo. Not torch.optim: its first use imports torch._dynamo,
    which costs seconds of start-up on a small CPU (most of a tiny demo's run time)."""

    def __init__(self, params, lr: float = 3e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.addcdiv_(m, (v / c2).sqrt_().add_(self.eps), value=-self.lr / c1)


def progress_range(n: int, label: str, progress: bool):
    """range(n) with a tqdm progress bar on stderr when asked and tqdm is installed, plain otherwise."""
    if progress:
        try:
            from tqdm import tqdm

            return _warnings_above(tqdm(range(n), desc=label, unit="step", file=sys.stderr))
        except ImportError:
            pass
    return range(n)


def _warnings_above(bar):
    """Iterates ``bar``; a warning shown meanwhile is printed above the bar (tqdm.write), not into
    the middle of its line."""
    import warnings

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        bar.write(
            warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"),
            file=getattr(bar, "fp", None) or sys.stderr,
        )

    warnings.showwarning = show
    try:
        yield from bar
    finally:
        warnings.showwarning = shown
        bar.close()


def _train(
    cfg,
    batches,
    device: str,
    seed: int,
    offload_ctx=None,
    min_bytes: int = 0,
    progress: bool = False,
    pool=None,
    apply_kwargs=None,
    label=None,
) -> dict:
    """One training run. With ``offload_ctx`` every forward runs inside it; with ``apply_kwargs``
    the blocks are checkpointed by ``co.apply(model, **apply_kwargs)``; either way the first step
    (left out of the step-time figures) runs under co.profile for the device peak of saved
    activations. Without either, the first step's forward runs under a counting hook. Returns
    losses, times, first-step grads, counts."""
    from ckpt_offload.blocks.applying import apply
    from ckpt_offload.profiling import profile

    torch.manual_seed(seed)  # dropout draws: identical sequence in every run
    model = TinyTransformer(**cfg.model_kwargs(), seed=seed).to(device)
    model.train()
    handle = apply(model, **apply_kwargs) if apply_kwargs is not None else None
    opt = SimpleAdam(model.parameters(), lr=3e-3)
    counter = None if (offload_ctx is not None or handle is not None) else _SavedBytesCounter(model, min_bytes)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, times, first_grads, first_stats, first_totals = [], [], None, None, None
    label = label or ("baseline" if offload_ctx is None else "co.offload")
    profiled = offload_ctx is not None or (handle is not None and pool is not None)
    for step in progress_range(len(batches), label, progress):
        tokens = batches[step]
        prof = profile(pools=[pool]) if (profiled and step == 0) else contextlib.nullcontext()
        if offload_ctx is not None:
            ctx = offload_ctx
        elif step == 0 and counter is not None:
            ctx = counter.hooks()
        else:
            ctx = contextlib.nullcontext()
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        with prof as report:
            with ctx:
                loss = lm_loss(model, tokens)
            loss.backward()
        if report is not None:
            first_totals = report.totals()
        if step == 0:
            first_grads = {
                name: (None if p.grad is None else p.grad.detach().clone()) for name, p in model.named_parameters()
            }
            if offload_ctx is not None:
                first_stats = offload_ctx.stats()
            elif handle is not None:
                first_stats = handle.stats()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out = {
        "losses": losses,
        "step_times_s": times,
        "median_step_s": statistics.median(times[1:]) if len(times) > 1 else None,
        "max_memory_allocated": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "first_grads": first_grads,
        "num_parameters": model.num_parameters(),
    }
    if handle is not None:
        handle.remove()
        out["stats_first_step"] = first_stats
        if first_totals is not None:
            out["profile_totals"] = dict(first_totals)
            out["device_saved_peak_bytes"] = first_totals["device_saved_peak_bytes"]
            out["saved_total_bytes"] = first_totals["saved_total_bytes"]
    elif counter is not None:
        out["saved_per_step"] = counter.result()
    else:
        out["profile_totals"] = dict(first_totals)
        out["stats_first_step"] = first_stats
        out["device_saved_peak_bytes"] = first_totals["device_saved_peak_bytes"]
        out["pool_peak_bytes"] = first_totals["pool_peak_bytes"]
        out["saved_total_bytes"] = first_totals["saved_total_bytes"]
        out["stats_total"] = offload_ctx.stats()
    return out


def _compare_grads(a: dict, b: dict) -> tuple:
    """(all equal, names that differ, max |difference|; None when a shape or a None grad differs)."""
    mismatched, max_diff = [], 0.0
    for name, ga in a.items():
        gb = b.get(name)
        if ga is None or gb is None:
            if ga is not gb:
                mismatched.append(name)
                max_diff = None
            continue
        if not torch.equal(ga, gb):
            mismatched.append(name)
            if ga.shape != gb.shape:
                max_diff = None
            elif max_diff is not None:
                max_diff = max(max_diff, (ga.double() - gb.double()).abs().max().item())
    return not mismatched, mismatched, max_diff


def run_demo(
    size: str = "small",
    steps: int = 8,
    device: str | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    stream: str = "side",
    seed: int = 0,
    prefetch_bytes: int | None = None,
    progress: bool = False,
) -> dict:
    """Runs the baseline and the offloaded training, returns every number as a JSON-able dict.

    ``device`` None picks :func:`default_device`. On ``"cuda"`` the context is
    ``co.offload(devices=None)`` (the default: CUDA tensors); on ``"cpu"`` it is
    ``co.offload(devices=["cpu"])``, which copies CPU tensors into the host pool. The pool is a
    fresh :class:`ckpt_offload.HostPool` so its counters describe this run alone.

    Keys include ``grads_match`` (first step, every parameter, ``torch.equal``),
    ``losses_match`` (every step, exact), ``activation_bytes_on_device_baseline``,
    ``activation_bytes_on_device_offload``, ``bytes_offloaded_to_pool``, ``pool``,
    ``time_ratio`` (median offload / baseline step time, steps after the first; None for one
    step), ``time_ratio_min`` / ``time_ratio_max`` (its spread over those steps),
    ``device_saved_peak_bytes`` (the most saved-activation bytes the offload run held on the device
    at once, first step, measured by co.profile), ``saved_bytes_total`` (what autograd saved in a
    step, counted the same way: the pool's bytes plus the device's at the end of forward, the
    device peak without offload), ``baseline``, ``offload``, ``config``, ``cpu_only``
    and ``note``. ``prefetch_bytes`` is co.offload's (None: the automatic window); ``progress``
    shows a progress bar on stderr.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = default_device() if device is None else device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not gpu_usable():
        raise RuntimeError(
            "device='cuda' needs a CUDA GPU and a CUDA build of ckpt_offload "
            f"(torch.cuda.is_available()={torch.cuda.is_available()}, "
            f"cuda_compiled={build_info()['cuda_compiled']}); use device='cpu'"
        )
    cfg = make_config(size)
    batches = [make_batch(cfg, seed=seed * 100_003 + i, device=device) for i in range(steps)]

    base = _train(cfg, batches, device, seed, min_bytes=min_bytes, progress=progress)

    pool = HostPool()
    devices = None if device == "cuda" else ["cpu"]
    ctx = offload(min_bytes=min_bytes, stream=stream, devices=devices, pool=pool, prefetch_bytes=prefetch_bytes)
    off = _train(cfg, batches, device, seed, offload_ctx=ctx, progress=progress, pool=pool)
    synchronize()
    pool.synchronize()
    pool_stats = pool.stats()

    # The recommended recipe: every block checkpointed, its input offloaded (co.apply(model,
    # offload=True) on a GPU), and the same checkpointing without offload, the recompute's share.
    ckpt = _train(cfg, batches, device, seed, progress=progress, apply_kwargs={}, label="checkpoint")
    recipe_pool = HostPool()
    recipe_options = {"pool": recipe_pool, "min_bytes": min_bytes, "stream": stream, "prefetch_bytes": prefetch_bytes}
    if devices is not None:
        recipe_options["devices"] = devices
    rec = _train(
        cfg,
        batches,
        device,
        seed,
        progress=progress,
        pool=recipe_pool,
        apply_kwargs={"offload": recipe_options},
        label="recipe",
    )
    synchronize()
    recipe_pool.synchronize()

    base_grads, off_grads = base.pop("first_grads"), off.pop("first_grads")
    grads_match, mismatched, max_grad_diff = _compare_grads(base_grads, off_grads)
    losses_match = base["losses"] == off["losses"]
    recipe = _recipe_summary(base, ckpt, rec, off, base_grads, recipe_pool.stats(), cfg.layers)

    saved = base["saved_per_step"]
    s1 = off["stats_first_step"]
    kept_bytes_by_reason = s1["kept_bytes_by_reason"]
    kept_activation_bytes = (
        s1["bytes_kept"] - kept_bytes_by_reason.get("parameter", 0) - kept_bytes_by_reason.get("buffer", 0)
    )
    kept_activation_tensors = (
        s1["tensors_kept"] - s1["kept_by_reason"].get("parameter", 0) - s1["kept_by_reason"].get("buffer", 0)
    )
    ratio = ratio_min = ratio_max = None
    if base["median_step_s"] and off["median_step_s"] is not None:
        ratio = off["median_step_s"] / base["median_step_s"]
        per_step = [o / b for o, b in zip(off["step_times_s"][1:], base["step_times_s"][1:]) if b > 0]
        if per_step:
            ratio_min, ratio_max = min(per_step), max(per_step)

    cpu_only = device == "cpu"
    if cpu_only:
        note = (
            "No GPU was used: this run offloaded CPU tensors (co.offload(devices=['cpu'])) by copying them "
            f"into a {pool_stats['backend']} host pool in the same RAM. The byte counts and the gradient/loss "
            "equality are real results of the offload machinery; 'kept on the device' means kept in place on "
            "the CPU. The time ratio is CPU copy overhead (memcpy on a worker thread), not GPU behaviour: no "
            "PCIe transfer, no overlap with GPU compute, and no device memory is saved."
        )
    else:
        note = (
            f"CUDA run: saved CUDA activations were copied to a {pool_stats['backend']} host pool "
            f"(stream={stream!r}) and reloaded in backward."
        )
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_info": build_info(),
        "config": {
            **cfg.as_dict(),
            "size": size,
            "steps": steps,
            "device": device,
            "seed": seed,
            "min_bytes": min_bytes,
            "stream": stream,
            "prefetch_bytes": prefetch_bytes,
            "offload_devices": devices,
            "num_parameters": base["num_parameters"],
            "torch_threads": torch.get_num_threads(),
        },
        "cpu_only": cpu_only,
        "note": note,
        "grads_match": grads_match,
        "grad_mismatches": mismatched,
        "max_grad_abs_diff": max_grad_diff,
        "num_grads_compared": len(base_grads),
        "losses_match": losses_match,
        "activation_bytes_saved_per_step": saved["activation_bytes"],
        "activation_bytes_on_device_baseline": saved["activation_bytes"],
        "activation_bytes_on_device_offload": kept_activation_bytes,
        "activation_tensors_on_device_offload": kept_activation_tensors,
        "bytes_offloaded_to_pool": s1["bytes_offloaded"],
        "bytes_deduplicated": s1["bytes_deduplicated"],
        "time_ratio": ratio,
        "time_ratio_min": ratio_min,
        "time_ratio_max": ratio_max,
        "device_saved_peak_bytes": off["device_saved_peak_bytes"],
        "saved_bytes_total": off["saved_total_bytes"],
        "pool": pool_stats,
        "baseline": base,
        "offload": off,
        "recipe": recipe,
        "checkpoint": ckpt,
        "recipe_run": rec,
        "bandwidth_arithmetic": _bandwidth_arithmetic(base, ckpt, rec, off, device),
    }
    return result


def _median_ratio(a: dict, b: dict):
    return (a["median_step_s"] / b["median_step_s"]) if (a["median_step_s"] and b["median_step_s"]) else None


def _recipe_summary(base, ckpt, rec, off, base_grads, pool_stats, layers: int) -> dict:
    """The recommended recipe's numbers against the baseline, checkpointing alone and offload-everything.

    ``device_saved_peak_bytes`` is co.profile's count: the saved tensors ckpt_offload holds (the
    blocks' inputs, reloaded). The block being recomputed in backward holds its own activations
    on top (torch's checkpoint saves them, not ckpt_offload): about one block's share of what
    autograd saves in a step, ``recompute_block_bytes``."""
    ck_grads, rec_grads = ckpt.pop("first_grads"), rec.pop("first_grads")
    g_ok, g_bad, _ = _compare_grads(base_grads, rec_grads)
    ck_ok, _, _ = _compare_grads(base_grads, ck_grads)
    s1 = rec["stats_first_step"]
    return {
        "how": "co.apply(model, offload=True): every block checkpointed, its input offloaded",
        "grads_match": g_ok and ck_ok,
        "grad_mismatches": g_bad,
        "losses_match": base["losses"] == rec["losses"] == ckpt["losses"],
        "bytes_offloaded_per_step": s1["bytes_offloaded"],
        "bytes_reloaded_per_step": s1["bytes_reloaded"],
        "inputs_under_min_bytes": s1["kept_by_reason"].get("too_small", 0),
        "device_saved_peak_bytes": rec.get("device_saved_peak_bytes"),
        "offload_everything_device_saved_peak_bytes": off.get("device_saved_peak_bytes"),
        "saved_bytes_total": off.get("saved_total_bytes"),
        "recompute_block_bytes": (off["saved_total_bytes"] // layers) if off.get("saved_total_bytes") else None,
        "time_ratio_vs_baseline": _median_ratio(rec, base),
        "time_ratio_vs_checkpoint": _median_ratio(rec, ckpt),
        "checkpoint_ratio_vs_baseline": _median_ratio(ckpt, base),
        "offload_everything_ratio_vs_baseline": _median_ratio(off, base),
        "max_memory_allocated": rec["max_memory_allocated"],
        "checkpoint_max_memory_allocated": ckpt["max_memory_allocated"],
        "pool_peak_bytes_in_use": pool_stats["peak_bytes_in_use"],
        "pool_bytes_in_use_after": pool_stats["bytes_in_use"],
    }


#: The host link assumed when no copy was timed (a PCIe 4.0 x16 link moves about 25 GB/s).
STATED_GBPS = 25.0


def _bandwidth_arithmetic(base, ckpt, rec, off, device) -> dict:
    """Why offload-everything is copy-bound and the recipe is not: bytes each way per step over
    the link's bandwidth (co.profile's measured D2H / H2D GB/s of the offload run, else
    STATED_GBPS) against the compute it could hide behind (the same step without copies)."""
    totals = off.get("profile_totals") or {}
    d2h, h2d = totals.get("d2h_gbps") or 0.0, totals.get("h2d_gbps") or 0.0
    measured = d2h > 0 and h2d > 0
    if not measured:
        d2h = h2d = STATED_GBPS
    source = (
        "measured by co.profile on step 1" + (" (CPU memcpy, not a host link)" if device == "cpu" else "")
        if measured
        else f"stated: {STATED_GBPS:g} GB/s, no copy was timed"
    )
    out = {"d2h_gbps": d2h, "h2d_gbps": h2d, "bandwidth_source": source}
    for name, run, compute in (("offload_everything", off, base), ("recipe", rec, ckpt)):
        s1 = run["stats_first_step"]
        copy_s = s1["bytes_offloaded"] / (d2h * 1e9) + s1["bytes_reloaded"] / (h2d * 1e9)
        compute_s = compute["median_step_s"]
        out[name] = {
            "d2h_bytes": s1["bytes_offloaded"],
            "h2d_bytes": s1["bytes_reloaded"],
            "copy_s": copy_s,
            "compute_s": compute_s,
            "compute_of": "baseline" if compute is base else "checkpoint",
            "copy_over_compute": (copy_s / compute_s) if compute_s else None,
            "floor_ratio": (max(copy_s, compute_s) / compute_s) if compute_s else None,
        }
    return out
