#!/usr/bin/env python3
"""Copy bandwidth through ckpt_offload's pool vs. a plain pinned ``copy_``.

For each size of a sweep (64 KiB .. 256 MiB by default, doubling) and each direction:

* ``raw``: what PyTorch does by itself (what ``torch.autograd.graph.save_on_cpu`` does):
  D2H ``torch.empty(shape, pin_memory=True).copy_(x, non_blocking=True)``,
  H2D ``torch.empty(shape, device="cuda").copy_(host, non_blocking=True)``.
  Both allocate their destination per call (from torch's caching host / device allocators).
* ``pool_side``: D2H ``co.offload_tensor(x, pool, stream="side")``, H2D ``handle.reload()``.
* ``pool_compute``: the same with ``stream="compute"``.

A sample is a batch of ``n`` back-to-back calls (``n`` chosen so that a sample moves at least
``--sample-bytes``, at most ``--max-calls`` calls), timed on the wall clock from a synchronized
device to ``co.synchronize()`` + ``torch.cuda.synchronize()``. The reported bandwidth is
``n * size / median(sample times)``; per-call fixed costs are therefore included, which is the
point: small tensors are dominated by them. Warmup samples are discarded (they also let the
pool and torch's allocators reserve their memory).

Also measured:

* the fixed per-call latency of one tiny copy (offload + synchronize, reload + synchronize) and
  the host-side cost per call of enqueueing many (no synchronize in between);
* the per-saved-tensor overhead of the pack/unpack path: ``x.exp().sum().backward()`` on a tiny
  tensor inside ``co.offload(min_bytes=0)`` (offloaded) and ``co.offload()`` (kept: too small)
  minus the same without any hooks;
* the "knee": the smallest size of the sweep at which the pool reaches 80% of its peak
  bandwidth, per direction and stream mode. The larger of the two side-stream knees is the suggestion for
  ``co.offload``'s ``min_bytes`` default (below it, a copy pays mostly fixed cost).

``--numa-node N`` places the pool's segments on NUMA node N (``auto``, the default: the GPU's
node on a host with several nodes; ``none``: no placement), so that two runs on a two-node
GPU machine, ``--numa-node <the GPU's node>`` and ``--numa-node <the other>``, measure local
against remote host memory. The report names the pool's node, the GPU's node and where the
pool's bytes were (``numa``); ``raw`` uses torch's own pinned memory, placed as torch places it.

Without a GPU (or with ``--device cpu``) the same sweep runs on CPU tensors (pageable pool,
CPU copy "streams", plain ``dst.copy_(x)`` into preallocated destinations as raw), at small
sizes only. Those
are CPU numbers, not GPU numbers, and the output says so on every table.

Usage::

    python3 benchmarks/bandwidth.py                    # full sweep, prints tables
    python3 benchmarks/bandwidth.py --quick            # a few sizes, fewer repeats (~seconds)
    python3 benchmarks/bandwidth.py --out results/     # also writes bandwidth.json and bandwidth.md
    python3 benchmarks/bandwidth.py --numa-node 1      # the pool's memory on NUMA node 1

Benchmarks measure, they don't assert: this script exits 0 unless something crashed or a
round trip came back with wrong values (checked once per size, outside the timed region).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import socket
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from _package import co, save_report  # noqa: E402  (the checkout's build when it has one, else the installed package)

KiB, MiB = 1 << 10, 1 << 20
METHODS = ("raw", "pool_side", "pool_compute")
DIRECTIONS = ("d2h", "h2d")
KNEE_FRACTION = 0.8
RAW_DEFINITION = {
    "cuda": "D2H torch.empty(shape, pin_memory=True).copy_(x, non_blocking=True), "
    "H2D torch.empty(shape, device='cuda').copy_(pinned, non_blocking=True); one allocation per call",
    "cpu": "dst.copy_(x) into destinations allocated once before timing, torch.set_num_threads(1) "
    "(the single-thread memcpy ceiling)",
}
CPU_WARNING = (
    "CPU NUMBERS, NOT GPU NUMBERS: no usable CUDA device (or --device cpu), so these are copies of "
    "CPU tensors into a pageable pool through CPU copy 'streams', compared with torch's CPU copy_. "
    "They say nothing about PCIe/NVLink bandwidth or CUDA stream overlap."
)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'64K', '1M', '256MiB', '4096' -> bytes."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", KiB), ("M", MiB), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], m
            break
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64K, 1M, 256M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{n} B"


def parse_numa_node(text: str):
    """'auto' | 'none' | a node number -> what co.HostPool(numa_node=...) takes."""
    t = text.strip().lower()
    if t in ("auto", "none"):
        return None if t == "none" else "auto"
    try:
        node = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a NUMA node: {text!r} (use auto, none or a node number)") from None
    if node < 0:
        raise argparse.ArgumentTypeError(f"a NUMA node is >= 0: {text!r}")
    return node


def numa_report(pool: "co.HostPool", device: torch.device) -> dict:
    """Where the pool's memory is and which node the GPU sits on (None without one)."""
    from ckpt_offload import _numa

    gpu_node = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        try:
            address = _numa.pci_address(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
        except AttributeError:
            address = None
        gpu_node = _numa.pci_device_node(address) if address else None
    s = pool.stats()
    return {
        **pool.numa,
        "bytes_by_node": s["bytes_by_node"],
        "gpu_numa_node": gpu_node,
        "memory_nodes": _numa.memory_nodes(),
    }


def size_sweep(lo: int, hi: int) -> list[int]:
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= 2
    return sizes


class Bench:
    """The device under test and how to synchronize it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        co.synchronize()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def source(self, nbytes: int) -> torch.Tensor:
        n = max(1, nbytes // 4)
        return torch.arange(n, dtype=torch.float32, device=self.device).remainder_(65521.0)

    def host_empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda)

    def device_empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)


def timed(bench: Bench, fn, prepare=None, repeats=5, warmup=2) -> list[float]:
    """Runs ``prepare()`` (untimed) then ``fn(state)`` (timed, synchronized both ends)."""
    times = []
    for i in range(warmup + repeats):
        state = prepare() if prepare else None
        bench.sync()
        t0 = time.perf_counter()
        out = fn(state)
        bench.sync()
        dt = time.perf_counter() - t0
        del out, state  # freed outside the timed region
        if i >= warmup:
            times.append(dt)
    return times


# ----------------------------------------------------------------------------------------------
# bandwidth sweep
# ----------------------------------------------------------------------------------------------


def measure_size(bench: Bench, pool: "co.HostPool", size: int, args) -> tuple[list[dict], bool]:
    x = bench.source(size)
    nbytes = x.numel() * x.element_size()
    calls = max(1, min(args.max_calls, args.sample_bytes // nbytes))
    rows = []

    def row(direction, method, times):
        med = statistics.median(times)
        rows.append(
            {
                "direction": direction,
                "method": method,
                "bytes": nbytes,
                "calls_per_sample": calls,
                "median_s": med,
                "min_s": min(times),
                "samples_s": times,
                "gbps": calls * nbytes / med / 1e9,
                "us_per_call": med / calls * 1e6,
            }
        )

    # D2H
    if bench.cuda:

        def raw_d2h(_):
            return [bench.host_empty(x).copy_(x, non_blocking=True) for _ in range(calls)]
    else:
        # CPU path: destinations allocated once (and faulted in by the warmup), so "raw" is the
        # memcpy ceiling rather than the cost of the C library's mmap/munmap per large malloc.
        host_dsts = [torch.empty_like(x) for _ in range(calls)]

        def raw_d2h(_):
            return [d.copy_(x) for d in host_dsts]

    row("d2h", "raw", timed(bench, raw_d2h, repeats=args.repeats, warmup=args.warmup))
    for mode in ("side", "compute"):

        def pool_d2h(_, mode=mode):
            return [co.offload_tensor(x, pool=pool, stream=mode) for _ in range(calls)]

        row("d2h", f"pool_{mode}", timed(bench, pool_d2h, repeats=args.repeats, warmup=args.warmup))

    # H2D
    host = bench.host_empty(x).copy_(x)

    if bench.cuda:

        def raw_h2d(_):
            return [bench.device_empty(x).copy_(host, non_blocking=True) for _ in range(calls)]
    else:
        dev_dsts = [torch.empty_like(x) for _ in range(calls)]

        def raw_h2d(_):
            return [d.copy_(host) for d in dev_dsts]

    row("h2d", "raw", timed(bench, raw_h2d, repeats=args.repeats, warmup=args.warmup))
    verified = True
    for mode in ("side", "compute"):
        handles = [co.offload_tensor(x, pool=pool, stream=mode) for _ in range(calls)]
        bench.sync()

        def pool_h2d(_, handles=handles):
            # Distinct handles: reloading one handle while its last reload is alive would share
            # that storage instead of copying.
            return [h.reload() for h in handles]

        row("h2d", f"pool_{mode}", timed(bench, pool_h2d, repeats=args.repeats, warmup=args.warmup))
        back = handles[-1].reload()
        bench.sync()
        verified = verified and torch.equal(back, x)
        del handles, back
    return rows, verified


def knee(rows: list[dict], direction: str, method: str) -> dict | None:
    pts = sorted((r["bytes"], r["gbps"]) for r in rows if r["direction"] == direction and r["method"] == method)
    if not pts:
        return None
    peak = max(g for _, g in pts)
    # The first size of the sweep that reaches 80% of the peak. Below it, fixed per-call costs
    # dominate; bandwidth may still dip above it (cache effects, the CPU path's page faults).
    at = next(b for b, g in pts if g >= KNEE_FRACTION * peak)
    peak_at = max(pts, key=lambda p: p[1])[0]
    return {
        "peak_gbps": peak,
        "peak_bytes": peak_at,
        "knee_bytes": at,
        "fraction": KNEE_FRACTION,
        "knee_at_largest_size": at == pts[-1][0],
    }


# ----------------------------------------------------------------------------------------------
# fixed costs
# ----------------------------------------------------------------------------------------------


def measure_overhead(bench: Bench, pool: "co.HostPool", args) -> dict:
    """Fixed costs of tiny copies (1 KiB) and of the autograd pack/unpack path."""
    out: dict = {"tiny_bytes": 1024}
    x = bench.source(1024)
    n_lat = 50 if args.quick else 200
    n_enq = 500 if args.quick else 2000

    def latency(fn):
        ts = []
        for _ in range(n_lat):
            bench.sync()
            t0 = time.perf_counter()
            r = fn()
            bench.sync()
            ts.append(time.perf_counter() - t0)
            del r
        return statistics.median(ts) * 1e6

    out["latency_us"] = {
        "raw_d2h": latency(lambda: bench.host_empty(x).copy_(x, non_blocking=bench.cuda)),
        "pool_side_d2h": latency(lambda: co.offload_tensor(x, pool=pool, stream="side")),
        "pool_compute_d2h": latency(lambda: co.offload_tensor(x, pool=pool, stream="compute")),
    }
    host = bench.host_empty(x).copy_(x)
    out["latency_us"]["raw_h2d"] = latency(lambda: bench.device_empty(x).copy_(host, non_blocking=bench.cuda))
    for mode in ("side", "compute"):
        h = co.offload_tensor(x, pool=pool, stream=mode)
        out["latency_us"][f"pool_{mode}_h2d"] = latency(h.reload)
        del h

    def enqueue(fn):
        """Host time per call of n back-to-back calls, without synchronizing between them."""
        ts = []
        for _ in range(3):
            bench.sync()
            t0 = time.perf_counter()
            keep = [fn() for _ in range(n_enq)]
            ts.append((time.perf_counter() - t0) / n_enq * 1e6)
            bench.sync()
            del keep
        return statistics.median(ts)

    out["enqueue_us_per_call"] = {
        "raw_d2h": enqueue(lambda: bench.host_empty(x).copy_(x, non_blocking=bench.cuda)),
        "pool_side_d2h": enqueue(lambda: co.offload_tensor(x, pool=pool, stream="side")),
        "pool_compute_d2h": enqueue(lambda: co.offload_tensor(x, pool=pool, stream="compute")),
    }

    # Autograd pack/unpack path: one saved tensor per iteration (exp saves its result).
    devices = [bench.device.type]
    xs = torch.randn(256, device=bench.device, requires_grad=True)
    n_ag = 200 if args.quick else 1000

    def autograd_loop(ctx_factory):
        ts = []
        for _ in range(5):
            bench.sync()
            t0 = time.perf_counter()
            with ctx_factory():
                for _ in range(n_ag):
                    xs.exp().sum().backward()
            bench.sync()
            ts.append((time.perf_counter() - t0) / n_ag * 1e6)
        return statistics.median(ts)

    base = autograd_loop(contextlib.nullcontext)
    offloaded = autograd_loop(lambda: co.offload(min_bytes=0, devices=devices, pool=pool))
    kept = autograd_loop(lambda: co.offload(devices=devices, pool=pool))
    out["autograd_us_per_step"] = {"no_hooks": base, "offload_min_bytes_0": offloaded, "offload_kept_too_small": kept}
    out["pack_unpack_overhead_us"] = {"offloaded": offloaded - base, "kept": kept - base}
    return out


# ----------------------------------------------------------------------------------------------
# reports
# ----------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    rows = report["results"]
    lines = []
    title = "CPU path (NOT GPU numbers)" if report["mode"] == "cpu" else f"GPU: {report['gpu_name']}"
    lines.append(f"# ckpt_offload copy bandwidth — {title}")
    lines.append("")
    if report["mode"] == "cpu":
        lines.append(f"> **{CPU_WARNING}**")
        lines.append("")
    bi = report["build_info"]
    lines.append(
        f"{report['date']} · torch {report['torch_version']} · ckpt_offload {bi['version']} "
        f"(cuda_compiled={bi['cuda_compiled']}, pool backend {report['pool_backend']}) · "
        f"{report['host']['cpu_count']} CPUs · repeats={report['args']['repeats']} (median)"
    )
    lines.append("")
    lines.append(
        "GB/s = 1e9 bytes/s, wall clock from a synchronized device to `co.synchronize()` + "
        "`torch.cuda.synchronize()`, per-call costs included. ratio = pool / raw (>1: pool faster)."
    )
    lines.append("")
    lines.append(f"raw = {report['raw_definition']}")
    numa = report["numa"]
    lines.append("")
    lines.append(
        f"Pool NUMA node: {numa['numa_node']} ({numa['reason']}); the pool's bytes by node at the end: "
        f"{numa['bytes_by_node']}; the GPU's node: {numa['gpu_numa_node']}; nodes with memory: {numa['memory_nodes']}."
    )
    for direction in DIRECTIONS:
        lines.append("")
        name = "D2H (device -> host, offload)" if direction == "d2h" else "H2D (host -> device, reload)"
        lines.append(f"## {name}")
        lines.append("")
        lines.append("| size | calls/sample | raw GB/s | pool side GB/s | side/raw | pool compute GB/s | compute/raw |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|")
        by = {(r["bytes"], r["method"]): r for r in rows if r["direction"] == direction}
        for size in sorted({r["bytes"] for r in rows}):
            raw = by.get((size, "raw"))
            side = by.get((size, "pool_side"))
            comp = by.get((size, "pool_compute"))
            if not (raw and side and comp):
                continue
            lines.append(
                f"| {fmt_size(size)} | {raw['calls_per_sample']} | {raw['gbps']:.2f} | {side['gbps']:.2f} | "
                f"{side['gbps'] / raw['gbps']:.2f} | {comp['gbps']:.2f} | {comp['gbps'] / raw['gbps']:.2f} |"
            )
    lines.append("")
    lines.append(f"## Knee: the smallest size that reaches {int(KNEE_FRACTION * 100)}% of the peak bandwidth")
    lines.append("")
    lines.append("| direction | method | peak GB/s | peak at | knee |")
    lines.append("|---|---|---:|---:|---:|")
    for key, k in report["knees"].items():
        if k is None:
            continue
        direction, method = key.split("/")
        note = " (only at the largest size: sweep further)" if k["knee_at_largest_size"] else ""
        lines.append(
            f"| {direction} | {method} | {k['peak_gbps']:.2f} | {fmt_size(k['peak_bytes'])} | "
            f"{fmt_size(k['knee_bytes'])}{note} |"
        )
    lines.append("")
    sugg = report["suggested_min_bytes"]
    lines.append(
        f"Suggested `co.offload(min_bytes=...)` (the larger side-stream knee): "
        f"**{fmt_size(sugg) if sugg else 'n/a'}** ({sugg} bytes); "
        f"current default {fmt_size(bi['default_min_bytes'])}."
        + (" (CPU numbers: do not use this to choose the GPU default.)" if report["mode"] == "cpu" else "")
    )
    ov = report["overhead"]
    if ov is None:
        lines.append("")
        lines.append(f"All round trips verified: {report['verified']}.")
        lines.append("")
        return "\n".join(lines)
    lines.append("")
    lines.append(f"## Fixed costs (tiny tensor, {ov['tiny_bytes']} bytes)")
    lines.append("")
    lines.append("| what | µs |")
    lines.append("|---|---:|")
    for k, v in ov["latency_us"].items():
        lines.append(f"| latency, one call + synchronize: {k} | {v:.1f} |")
    for k, v in ov["enqueue_us_per_call"].items():
        lines.append(f"| host time per call, back-to-back: {k} | {v:.2f} |")
    for k, v in ov["autograd_us_per_step"].items():
        lines.append(f"| `x.exp().sum().backward()` per step: {k} | {v:.1f} |")
    for k, v in ov["pack_unpack_overhead_us"].items():
        lines.append(f"| pack+unpack overhead per saved tensor: {k} | {v:.1f} |")
    lines.append("")
    lines.append(f"All round trips verified: {report['verified']}.")
    lines.append("")
    return "\n".join(lines)


def print_table(report: dict) -> None:
    if report["mode"] == "cpu":
        print("\n*** " + CPU_WARNING + " ***\n")
    print(markdown(report))
    if report["mode"] == "cpu":
        print("*** CPU NUMBERS, NOT GPU NUMBERS ***")


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", help="directory to write bandwidth.json and bandwidth.md into")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (x4 steps) and repeats: a smoke run")
    ap.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: CUDA when usable, else the CPU path"
    )
    ap.add_argument("--min-size", type=parse_size, default=None, help="smallest size (default 64K)")
    ap.add_argument(
        "--max-size",
        type=parse_size,
        default=None,
        help="largest size (default 256M on GPU, 16M on the CPU path; --quick: 64M / 4M)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed samples per point (default 7, --quick 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed samples per point (default 2)")
    ap.add_argument(
        "--sample-bytes",
        type=parse_size,
        default=None,
        help="bytes a sample moves at least (default 64M on GPU, 16M on CPU; --quick: a quarter)",
    )
    ap.add_argument("--max-calls", type=int, default=256, help="most calls in one sample (default 256)")
    ap.add_argument(
        "--numa-node",
        type=parse_numa_node,
        default="auto",
        help="NUMA node of the pool's memory: auto (default: the GPU's node where the host has "
        "several), none, or a node number (run once per node to compare local and remote)",
    )
    ap.add_argument("--skip-overhead", action="store_true", help="skip the fixed-cost measurements")
    args = ap.parse_args(argv)

    gpu_ok = torch.cuda.is_available() and co.build_info()["gpu_available"]
    if args.device == "cuda" and not gpu_ok:
        print(
            "bandwidth.py: --device cuda but no usable CUDA device / CUDA build of ckpt_offload "
            f"(torch.cuda.is_available()={torch.cuda.is_available()}, build_info={co.build_info()})",
            file=sys.stderr,
        )
        return 2
    mode = "cuda" if (args.device in ("auto", "cuda") and gpu_ok) else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if mode == "cuda" else torch.device("cpu")

    if args.min_size is None:
        args.min_size = 64 * KiB
    if args.max_size is None:
        if mode == "cuda":
            args.max_size = 64 * MiB if args.quick else 256 * MiB
        else:
            args.max_size = 4 * MiB if args.quick else 16 * MiB
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.sample_bytes is None:
        args.sample_bytes = (64 * MiB if mode == "cuda" else 16 * MiB) // (4 if args.quick else 1)
    sizes = size_sweep(args.min_size, args.max_size)
    if args.quick:
        sizes = sizes[::2] if len(sizes) > 2 else sizes
        if sizes[-1] != args.max_size and args.max_size >= args.min_size:
            sizes.append(args.max_size)

    # The CPU test suite may set an injected copy delay through the environment: not here.
    delay_before = co._C.testing.cpu_copy_delay_us()
    co._C.testing.set_cpu_copy_delay_us(0)

    threads_before = torch.get_num_threads()
    if mode == "cpu":
        # The pool copies with one memcpy per call; torch's copy_ splits large copies over its
        # intra-op thread pool, whose wake-ups can cost more than the copy on small VMs (seen:
        # 0.01 GB/s at 256 KiB on 2 vCPUs). One thread makes raw the plain memcpy ceiling.
        torch.set_num_threads(1)

    bench = Bench(device)
    pool = co.HostPool(numa_node=args.numa_node)  # pinned on a GPU, pageable otherwise
    if mode == "cpu":
        print("\n*** " + CPU_WARNING + " ***\n", flush=True)
    else:
        print(f"bandwidth.py: GPU {torch.cuda.get_device_name(device)}, pool backend {pool.backend}", flush=True)
    print(f"bandwidth.py: pool NUMA node {pool.numa['numa_node']} ({pool.numa['reason']})", flush=True)

    results, verified = [], True
    t_start = time.perf_counter()
    for size in sizes:
        rows, ok = measure_size(bench, pool, size, args)
        verified = verified and ok
        results += rows
        brief = "  ".join(f"{r['direction']}/{r['method']} {r['gbps']:.2f}" for r in rows)
        print(f"  {fmt_size(size):>8}: {brief} GB/s{'' if ok else '  ROUND TRIP WRONG'}", flush=True)
    overhead = None if args.skip_overhead else measure_overhead(bench, pool, args)

    knees = {f"{d}/{m}": knee(results, d, m) for d in DIRECTIONS for m in METHODS}
    side_knees = [knees[f"{d}/pool_side"]["knee_bytes"] for d in DIRECTIONS if knees.get(f"{d}/pool_side")]
    suggested = max(k for k in side_knees if k) if any(side_knees) else None

    info = co.build_info()
    report = {
        "benchmark": "ckpt_offload bandwidth",
        "mode": mode,
        "warning": CPU_WARNING if mode == "cpu" else None,
        "raw_definition": RAW_DEFINITION[mode],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu_name": torch.cuda.get_device_name(device) if mode == "cuda" else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "build_info": info,
        "pool_backend": pool.backend,
        "pool_stats_end": pool.stats(),
        "numa": numa_report(pool, device),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "args": {k: v for k, v in vars(args).items()},
        "sizes": sizes,
        "results": results,
        "knees": knees,
        "suggested_min_bytes": suggested,
        "overhead": overhead,
        "verified": verified,
        "cpu_copy_delay_us_before": delay_before,
        "torch_num_threads": torch.get_num_threads(),
        "elapsed_s": time.perf_counter() - t_start,
    }
    co._C.testing.set_cpu_copy_delay_us(delay_before)
    torch.set_num_threads(threads_before)

    print_table(report)
    if args.out:
        save_report(args.out, "bandwidth", report, markdown(report))
        print(f"wrote {os.path.join(args.out, 'bandwidth.json')} and bandwidth.md")
    if not verified:
        print("bandwidth.py: a round trip through the pool came back with WRONG VALUES", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
