#!/usr/bin/env python3
"""Long-context benchmark: 8B-class decoder layers at 8K-32K tokens, every checkpoint / offload recipe.

Decoder layers shaped like an 8B-class model (hidden 4096, 32 query / 8 key-value heads, SwiGLU
14336, RMSNorm, rotary embeddings, ``F.scaled_dot_product_attention``; ``benchmarks/llama_decoder.py``),
bf16, batch 1. The LM head (vocabulary 32000) and the float32 cross-entropy run in 4096-token chunks,
each under ``torch.utils.checkpoint``, so the logits never exceed one chunk (0.5 GB) and do not set
the peak; the head and loss run outside every arm's context, identically for all arms. A step is
forward + backward; no optimizer step (it is the same for every arm and adds only weight memory).

Arms (same weights, same tokens, one process):

=========================  ======================================================================
``none``                   no checkpointing (where it fits; ``OOM`` otherwise)
``checkpoint``             ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` per layer
                           (what Hugging Face's ``gradient_checkpointing_enable()`` does)
``checkpoint_aa``          the same arm again, measured as a second arm: the A/A pair whose ratio
                           is the noise floor printed next to every ratio
``hf_offload``             Hugging Face's ``offload=True``: ``save_on_cpu(pin_memory=True)``
                           around each layer's non-reentrant checkpoint
``torchtune``              torchtune's ``OffloadActivations`` around the checkpointed layers,
                           loaded from a torchtune wheel in ``.whl/`` of the checkout (just
                           ``torchtune/training/_activation_offloading.py``; skipped with the
                           reason when absent)
``co_checkpoint``          ``co.checkpoint`` per layer, no offload: the same-implementation baseline
``co_checkpoint_offload``  ``co.checkpoint(..., offload=True)`` per layer, defaults
``co_offload``             ``with co.offload():`` around the plain layers (no recompute)
``co_plan``                ``co.plan`` at a budget halfway between the predicted saved-activation
                           peaks of every layer checkpointed and every layer checkpointed with its
                           input offloaded
``co_checkpoint_tile``     ``co.checkpoint`` per layer with each layer's MLP tiled along the
                           sequence (``co.tile(layer.mlp, tile=...)``) and the head + loss through
                           ``co.tiled_cross_entropy`` (tiles of ``--chunk`` tokens)
``co_checkpoint_offload_`` the same with ``offload=True``: the recipe for the longest sequence
``tile``
``co_checkpoint_offload_`` and each layer's two RMSNorms tiled too
``tile_norms``
=========================  ======================================================================

Timing: CUDA events around each step, gc disabled while timing, ``--rounds`` rounds of
``--steps`` steps per arm, the arms interleaved round-robin inside each round; median and
min-max per arm; every ratio printed with the A/A pair's ratio as its noise floor. Memory:
``max_memory_allocated`` with the peak reset after ``zero_grad``; resident after forward against
the theory (layers x seq x hidden x 2 bytes for checkpointing); bytes moved per step; pinned
host bytes; host RSS growth. Correctness: the first step's gradients of every arm are compared
with the ``none`` arm's (``checkpoint``'s where ``none`` does not fit): a benchmark that measures
a wrong answer is worthless, so a mismatch makes the exit status 1. Max trainable sequence per
arm under memory caps (``--caps-gb``, via ``torch.cuda.set_per_process_memory_fraction``): the
peak is linear in the sequence length at a fixed depth (flash attention is linear in memory),
so it is fitted from measured peaks at three lengths, the cap's length predicted and, as far as
the time budget allows, verified by one step under the cap (bounded: at most two tries per arm
and cap).

**Memory per token** (``--per-token``, and at tiny shapes inside ``--quick`` when ``--arms`` has the
table's arms): on the CPU, a
32-layer decoder with the 8B-class proportions at a scaled width (hidden 256, 32 query / 8
key-value heads, SwiGLU 3.5x, bf16), the peak of torch-allocated memory of one step read from
torch.profiler's memory events at three lengths: the slope between the two longest is the arm's
bytes per token (the peak is the largest of several moments' lines, the steepest winning at long
sequences; the residual of a line through all three says whether they crossed), in hidden widths
``b / (hidden x bytes)``. From the widths, the 8B-class
stack (hidden 4096, bf16) needs ``widths x 8 KiB`` per token; with its weights and gradients, the
loss chunk and (tiled arms) one tile's working set as the fixed part, the longest sequence under
40 / 80 / 141 GB, its ratio to ``checkpoint``'s (Hugging Face's gradient checkpointing), and the
host bytes the offloaded arms need at that length against ``--host-gb``. Writes
``long_context_per_token_cpu.json`` / ``.md``.

The number of layers per length is the largest ``layers x seq`` product whose predicted run
time (FLOPs at ``--est-tflops``) fits ``--budget-s``; the run prints the arithmetic. The whole
run stops what would overrun ``--budget-s`` and says what it skipped.

Usage::

    python3 benchmarks/long_context.py --out results/            # the H200 GPU machine: ~170 s
    python3 benchmarks/long_context.py --quick --out /tmp/lc     # CPU, tiny shapes, CPU numbers
    python3 benchmarks/long_context.py --per-token --out DIR     # CPU memory per token, 8B proportions

``--quick`` (or no usable GPU) runs tiny shapes on CPU tensors in a few seconds: every arm's
code path (CUDA-only parts run their CPU equivalent or are skipped with the reason), labelled
CPU everywhere. Only its gradient checks and byte counts mean something.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import gc
import importlib.util
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
import zipfile

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _package import ROOT, co, positive_int_list, save_report
from llama_decoder import DecoderConfig, LlamaDecoder, random_tokens, rotary_tables
from overlap_measure import raw_copy_bandwidth
from overlap_strategies import SaveCounter, hf_checkpoint_fn
from ckpt_offload.planner.simulator import singles  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20

ARMS = (
    "none",
    "checkpoint",
    "checkpoint_aa",
    "hf_offload",
    "torchtune",
    "co_checkpoint",
    "co_checkpoint_offload",
    "co_offload",
    "co_plan",
    "co_checkpoint_offload_fp8",
    "co_offload_fp8",
    "co_checkpoint_tile",
    "co_checkpoint_offload_tile",
    "co_checkpoint_offload_tile_norms",
)
#: The run with the same computation and no copies (same implementation where there is one).
BASELINE = {
    "none": None,
    "checkpoint": None,
    "checkpoint_aa": "checkpoint",
    "hf_offload": "checkpoint",
    "torchtune": "checkpoint",
    "co_checkpoint": "checkpoint",
    "co_checkpoint_offload": "co_checkpoint",
    "co_offload": "none",
    "co_plan": "checkpoint",
    # Low-precision storage against the same recipe stored exactly: what the narrower copies save.
    "co_checkpoint_offload_fp8": "co_checkpoint_offload",
    "co_offload_fp8": "co_offload",
    # Tiling against the same recipe without tiles: its extra time (target: <= 5% at >= 64K tokens).
    "co_checkpoint_tile": "co_checkpoint",
    "co_checkpoint_offload_tile": "co_checkpoint_offload",
    "co_checkpoint_offload_tile_norms": "co_checkpoint_offload_tile",
}
DESCRIPTIONS = {
    "none": "no checkpointing",
    "checkpoint": "torch.utils.checkpoint.checkpoint(use_reentrant=False) per layer",
    "checkpoint_aa": "checkpoint again, as a second arm (A/A pair: the noise floor)",
    "hf_offload": "Hugging Face offload=True: save_on_cpu(pin_memory=True) around each layer's checkpoint",
    "torchtune": "torchtune OffloadActivations() around the checkpointed layers",
    "co_checkpoint": "co.checkpoint per layer, no offload",
    "co_checkpoint_offload": "co.checkpoint(offload=True) per layer, defaults",
    "co_offload": "with co.offload(): around the plain layers",
    "co_plan": "co.plan at a budget halfway between checkpoint's and checkpoint+offload's predicted peaks",
    "co_checkpoint_offload_fp8": "co.checkpoint(offload=...) per layer, inputs stored as float8_e4m3fn (lossy)",
    "co_offload_fp8": "with co.offload(store_dtype=float8_e4m3fn): around the plain layers (lossy)",
    "co_checkpoint_tile": "co.checkpoint per layer, each layer's MLP tiled (co.tile), loss co.tiled_cross_entropy",
    "co_checkpoint_offload_tile": "co.checkpoint(offload=True) per layer, MLP tiled, head + loss tiled",
    "co_checkpoint_offload_tile_norms": "co.checkpoint(offload=True) per layer, MLP and RMSNorms tiled, loss tiled",
}
#: Arms that tile (co.tile / co.tiled_cross_entropy): parameter gradients are summed over tiles, so
#: they are held to TILED_RTOL instead of bit-identity (docs/api.md, "Sequence-tiled recompute").
TILED_ARMS = {
    "co_checkpoint_tile": {"offload": False, "norms": False},
    "co_checkpoint_offload_tile": {"offload": True, "norms": False},
    "co_checkpoint_offload_tile_norms": {"offload": True, "norms": True},
}
TILED_RTOL = {"cuda": 2e-2, "cpu": 1e-5}
#: Arms that store activations in a narrower dtype (co.offload's store_dtype): not bit-exact by
#: design, so their gradients are held to this relative error instead of GRAD_RTOL, and reported.
LOSSY_ARMS = {"co_checkpoint_offload_fp8": torch.float8_e4m3fn, "co_offload_fp8": torch.float8_e4m3fn}
LOSSY_RTOL = 0.25
#: Arms whose layer inputs (and only those) are kept: resident after forward = the theory.
CHECKPOINT_ARMS = ("checkpoint", "checkpoint_aa", "co_checkpoint")
#: Gradients of bf16 GPU runs differ from run to run by the attention backward's accumulation
#: order; a wrong tensor restored gives an O(1) relative error. CPU float32 runs are exact.
GRAD_RTOL = {"cuda": 2e-2, "cpu": 1e-5}

CPU_WARNING = (
    "CPU NUMBERS, NOT GPU NUMBERS: --quick / no usable CUDA device. Tiny shapes on CPU tensors; "
    "offloads go to a pageable pool (devices=['cpu'], min_bytes=0), save_on_cpu keeps CPU tensors, "
    "CUDA-only parts are skipped with the reason. Only the gradient checks and byte counts mean "
    "something."
)

GPU_SHAPE = {"vocab": 32000, "dim": 4096, "heads": 32, "kv_heads": 8, "ffn_dim": 14336, "rope_theta": 500000.0}
CPU_SHAPE = {"vocab": 256, "dim": 64, "heads": 4, "kv_heads": 2, "ffn_dim": 176, "rope_theta": 10000.0}
GPU_DEFAULTS = {
    "seq_lens": [8192, 16384, 32768],
    "rounds": 4,
    "steps": 5,
    "chunk": 4096,
    "dtype": "bfloat16",
    "budget_s": 170.0,
    "tile": 4096,
}
CPU_QUICK = {
    "seq_lens": [64, 128],
    "rounds": 3,
    "steps": 2,
    "chunk": 32,
    "dtype": "float32",
    "budget_s": 60.0,
    "layers": 3,
    "tile": 16,
}


# --------------------------------------------------------------------------------------- model


def make_config(shape: dict, layers: int, max_seq: int) -> DecoderConfig:
    return DecoderConfig(
        "8b-class" if shape is GPU_SHAPE else "tiny",
        vocab=shape["vocab"],
        dim=shape["dim"],
        layers=layers,
        heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        ffn_dim=shape["ffn_dim"],
        max_seq=max_seq,
        rope_theta=shape["rope_theta"],
    )


def hidden_states(model: LlamaDecoder, tokens: torch.Tensor, checkpoint_fn=None) -> torch.Tensor:
    """The decoder layers of :class:`LlamaDecoder` without its head: what every arm's context wraps."""
    x = model.embed(tokens)
    cfg = model.cfg
    cos, sin = rotary_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta, device=x.device, dtype=x.dtype)
    for layer in model.layers:
        x = layer(x, cos=cos, sin=sin) if checkpoint_fn is None else checkpoint_fn(layer, x, cos=cos, sin=sin)
    return x


def _chunk_loss(h, targets, norm, head):
    logits = head(norm(h)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def chunked_loss(model: LlamaDecoder, h: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean next-token cross-entropy, the head and loss of ``chunk`` tokens at a time under a
    non-reentrant checkpoint: only ``h`` is saved, one chunk's logits exist at a time."""
    total = None
    for i in range(0, h.shape[1], chunk):
        part = torch_checkpoint.checkpoint(
            _chunk_loss, h[:, i : i + chunk], targets[:, i : i + chunk], model.norm, model.lm_head, use_reentrant=False
        )
        total = part if total is None else total + part
    return total / targets.numel()


# --------------------------------------------------------------------------------------- torchtune


def find_torchtune_wheel(root: str = ROOT) -> str | None:
    """The newest ``torchtune-*.whl`` in ``root/.whl/`` (an ignored folder of the checkout)."""
    folder = os.path.join(root, ".whl")
    wheels = (
        sorted(f for f in os.listdir(folder) if f.startswith("torchtune-") and f.endswith(".whl"))
        if os.path.isdir(folder)
        else []
    )
    return os.path.join(folder, wheels[-1]) if wheels else None


_TT_MODULE = "torchtune/training/_activation_offloading.py"
# The imports of that module that would pull in the whole package (torchao, torchtune.modules,
# torchtune.utils) and what stands in for them: nothing the offloading path uses.
_TT_STUBS = {
    "import torchao": "class torchao:\n    __version__ = '0'",
    "from torchao.dtypes.nf4tensor import NF4Tensor": "class NF4Tensor:\n    pass",
    "from torchtune.modules import TiedLinear": "class TiedLinear:\n    pass",
    "from torchtune.utils import get_logger": (
        "import logging\ndef get_logger(level):\n    return logging.getLogger('torchtune')"
    ),
}


def load_torchtune_offloading(wheel: str):
    """``torchtune.training._activation_offloading`` loaded from ``wheel`` without importing the
    torchtune package (its ``__init__`` imports torchao and much more). Raises RuntimeError
    with the reason when the module's imports are not the ones this loader replaces."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(_TT_MODULE).decode()
    for line, stub in _TT_STUBS.items():
        if line + "\n" not in source:
            raise RuntimeError(f"{os.path.basename(wheel)}: {_TT_MODULE} has no line {line!r}; update _TT_STUBS")
        source = source.replace(line + "\n", stub + "\n", 1)
    try:
        import psutil  # noqa: F401
    except ImportError:
        source = source.replace(
            "import psutil\n",
            "class psutil:\n    @staticmethod\n    def virtual_memory():\n"
            "        class _V:\n            percent = 0.0\n        return _V()\n",
            1,
        )
    spec = importlib.util.spec_from_loader("_torchtune_activation_offloading", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{wheel}!{_TT_MODULE}", "exec"), module.__dict__)  # noqa: S102 - a local wheel
    return module


# --------------------------------------------------------------------------------------- arms


class Skipped(Exception):
    """An arm that cannot run here; the message is the reason its row shows."""


def _cpu_options(pool=None, stream: str = "side") -> dict:
    """Offload options for CPU tensors. ``stream="compute"``: copies inline, so that a source is freed
    when its copy is made, whatever else keeps the machine busy (the per-token table's peaks)."""
    return {
        "devices": ["cpu"],
        "min_bytes": 0,
        "pool": pool if pool is not None else co.HostPool(pinned=False),
        "stream": stream,
    }


class Arm:
    """One arm at one length: a context around the layers, a per-layer checkpoint function,
    ``enter``/``exit`` around each round (the plan installs itself), where its bytes go, and the
    head + loss it runs (``chunked_loss`` unless the arm tiles it)."""

    def __init__(
        self, name, context=None, checkpoint_fn=None, pool=None, counter=None, enter=None, exit=None, loss_fn=None
    ):
        self.name = name
        self.context = context or contextlib.nullcontext
        self.checkpoint_fn = checkpoint_fn
        self.pool = pool  # a co.HostPool whose bytes_in_use counts this arm's offloads
        self.counter = counter  # hf_offload's SaveCounter
        self.enter = enter or (lambda: None)
        self.exit = exit or (lambda: None)
        self.loss_fn = loss_fn or chunked_loss
        self.info: dict = {}


class NormHead(torch.nn.Module):
    """The final norm and the LM head as one module: the head ``co.tiled_cross_entropy`` tiles
    (a module, so its parameters are known without the first-call check)."""

    def __init__(self, model: LlamaDecoder):
        super().__init__()
        self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, h):
        return self.lm_head(self.norm(h))


def tiled_loss(model: LlamaDecoder, h: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The mean next-token cross-entropy through ``co.tiled_cross_entropy``: tiles of ``chunk``
    tokens, the logits of one tile at a time (the same as :func:`chunked_loss` keeps)."""
    return co.tiled_cross_entropy(h, NormHead(model), targets, tile=chunk)


def tiled_arm(name: str, model, on_gpu: bool, tile: int, cpu_stream: str = "side") -> Arm:
    """An arm of TILED_ARMS: co.checkpoint per layer (offload or not), each layer's MLP (and
    norms) tiled by ``co.tile`` while the arm is entered, the loss tiled."""
    how = TILED_ARMS[name]
    options = (True if on_gpu else _cpu_options(co.default_pool(), cpu_stream)) if how["offload"] else False
    handles = []

    def enter():
        for layer in model.layers:
            handles.append(co.tile(layer.mlp, tile=tile))
            if how["norms"]:
                handles.append(co.tile(layer.input_norm, tile=tile))
                handles.append(co.tile(layer.post_attn_norm, tile=tile))

    def exit_():
        while handles:
            handles.pop().remove()

    arm = Arm(
        name,
        checkpoint_fn=functools.partial(co.checkpoint, offload=options),
        enter=enter,
        exit=exit_,
        pool=co.default_pool() if how["offload"] else None,
        loss_fn=tiled_loss,
    )
    arm.info["tile"] = tile
    return arm


def build_arm(
    name: str,
    model,
    tokens,
    chunk: int,
    device: torch.device,
    plan_cache: dict,
    tile: int | None = None,
    cpu_stream: str = "side",
) -> Arm:
    on_gpu = device.type == "cuda"
    torch_ckpt = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
    if name == "none":
        return Arm(name)
    if name in ("checkpoint", "checkpoint_aa"):
        return Arm(name, checkpoint_fn=torch_ckpt)
    if name == "hf_offload":
        counter = SaveCounter()
        return Arm(name, checkpoint_fn=hf_checkpoint_fn(counter, on_gpu, "cuda"), counter=counter)
    if name == "torchtune":
        wheel = find_torchtune_wheel()
        if wheel is None:
            raise Skipped(
                "skipped: no torchtune-*.whl in .whl/ of the checkout (pip download torchtune --no-deps -d .whl)"
            )
        module = load_torchtune_offloading(wheel)
        if not on_gpu:
            raise Skipped(
                f"skipped: OffloadActivations needs CUDA (its constructor takes torch.cuda streams); "
                f"loaded from {os.path.basename(wheel)}"
            )
        # One instance entered every step, as torchtune's recipes do (its streams live as long).
        ctx = module.OffloadActivations()
        arm = Arm(name, context=lambda: ctx, checkpoint_fn=torch_ckpt)
        arm.info["wheel"] = os.path.basename(wheel)
        return arm
    if name == "co_checkpoint":
        return Arm(name, checkpoint_fn=co.checkpoint)
    if name == "co_checkpoint_offload":
        # offload=True uses the default pool; no other arm uses it, so its counters are this arm's.
        options = True if on_gpu else _cpu_options(co.default_pool(), cpu_stream)
        return Arm(name, checkpoint_fn=functools.partial(co.checkpoint, offload=options), pool=co.default_pool())
    if name == "co_offload":
        pool = co.HostPool() if on_gpu else co.HostPool(pinned=False)
        options = {"pool": pool} if on_gpu else _cpu_options(pool)
        return Arm(name, context=lambda: co.offload(**options), pool=pool)
    if name == "co_plan":
        return plan_arm(model, tokens, chunk, device, plan_cache)
    if name in TILED_ARMS:
        return tiled_arm(name, model, on_gpu, tile or model.cfg.dim, cpu_stream)
    if name in LOSSY_ARMS:
        pool = co.HostPool() if on_gpu else co.HostPool(pinned=False)
        options = dict({"pool": pool} if on_gpu else _cpu_options(pool), store_dtype=LOSSY_ARMS[name])
        if name == "co_offload_fp8":
            return Arm(name, context=lambda: co.offload(**options), pool=pool)
        return Arm(name, checkpoint_fn=functools.partial(co.checkpoint, offload=options), pool=pool)
    raise ValueError(f"arm: unknown name {name!r}; choose from {ARMS}")


def plan_arm(model, tokens, chunk, device, plan_cache) -> Arm:
    """``co.plan`` at a budget halfway between the predicted peaks of saved activations of two
    recipes on the plan's own cost model: every layer recomputed (checkpoint) and every layer
    recomputed with its input offloaded. Both come from ``co.planner.simulate``."""
    on_gpu = device.type == "cuda"
    pool = co.HostPool() if on_gpu else co.HostPool(pinned=False)
    offload = {"pool": pool} if on_gpu else {"pool": pool, "devices": ["cpu"], "min_bytes": 0}

    def step():
        h = hidden_states(model, tokens[:, :-1])
        chunked_loss(model, h, tokens[:, 1:], chunk).backward()

    t0 = time.perf_counter()
    first = co.plan(model, step, budget=1 << 62, offload=offload)
    cm = first.costs
    n = len(model.layers)
    ck = co.planner.simulate(cm, singles(["recompute"] * n)).peak_bytes
    ck_off = co.planner.simulate(cm, singles(["recompute_offload"] * n)).peak_bytes
    budget = int((ck + ck_off) // 2)
    try:
        plan = co.plan(model, step, budget=budget, costs=cm, offload=offload)
    except co.planner.InfeasibleBudget as e:
        budget = e.minimum
        plan = co.plan(model, step, budget=budget, costs=cm, offload=offload)
    model.zero_grad(set_to_none=True)
    handle = {}

    def enter():
        handle["h"] = plan.apply()

    def exit_():
        h = handle.pop("h", None)
        if h is not None:
            h.remove()

    arm = Arm("co_plan", pool=pool, enter=enter, exit=exit_)
    kinds = {}
    for kind in plan.choices.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    arm.info.update(
        budget_bytes=budget,
        checkpoint_predicted_peak_bytes=ck,
        checkpoint_offload_predicted_peak_bytes=ck_off,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_step_s=plan.predicted_step_seconds,
        choices=kinds,
        planning_s=time.perf_counter() - t0,
    )
    return arm


# --------------------------------------------------------------------------------------- measuring


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    co.synchronize()


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _torch_pinned_bytes() -> int | None:
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:  # noqa: BLE001 - older torch / no CUDA
        return None


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_step(
    model, tokens, arm: Arm, chunk: int, device: torch.device, measure: dict | None = None, keep_grads: bool = False
) -> float:
    """One forward + backward of ``arm``; returns its time in seconds (CUDA events on a GPU).
    With ``measure``: fills resident-after-forward, bytes moved, the loss. ``keep_grads``: the
    gradients are zeroed in place, not freed, so the step allocates none (the per-token table)."""
    on_gpu = device.type == "cuda"
    model.zero_grad(set_to_none=not keep_grads)
    if measure is not None:
        _sync(device)
        before = torch.cuda.memory_allocated(device) if on_gpu else None
        pool_before = arm.pool.stats()["bytes_in_use"] if arm.pool is not None else None
        # hf_offload and torchtune copy into torch's pinned host allocator: its in-use bytes grow
        pinned_before = _torch_pinned_bytes() if on_gpu and arm.name in ("hf_offload", "torchtune") else None
        if arm.counter is not None:
            arm.counter.tensors = arm.counter.bytes = 0
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    with arm.context():
        h = hidden_states(model, tokens[:, :-1], arm.checkpoint_fn)
    loss = arm.loss_fn(model, h, tokens[:, 1:], chunk)
    del h
    if measure is not None:
        _sync(device)
        if on_gpu:
            measure["resident_after_forward_bytes"] = torch.cuda.memory_allocated(device) - before
        now = _torch_pinned_bytes() if pinned_before is not None else None
        if now is not None:
            measure["pinned_in_use_after_forward_bytes"] = now - pinned_before
        if arm.pool is not None:
            measure["bytes_moved_d2h"] = arm.pool.stats()["bytes_in_use"] - pool_before
        elif arm.counter is not None:
            measure["bytes_moved_d2h"] = arm.counter.bytes
        elif now is not None:
            measure["bytes_moved_d2h"] = now - pinned_before
    loss.backward()
    if on_gpu:
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
    else:
        elapsed = time.perf_counter() - t0
    co.synchronize()
    if measure is not None:
        measure["loss"] = float(loss.detach().float())
    return elapsed


def grads_to_cpu(model) -> dict:
    return {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}


def reference_grads(model, device) -> tuple[dict, int]:
    """A copy of the model's gradients for the other arms to compare with, and the device bytes
    it takes: on the device when under a tenth of its memory (comparing through a host copy
    would cost a pageable H2D of every gradient per arm), else on the host."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    nbytes = sum(g.numel() * g.element_size() for g in grads.values())
    if device.type == "cuda" and nbytes < torch.cuda.get_device_properties(device).total_memory // 10:
        return {n: g.detach().clone() for n, g in grads.items()}, nbytes
    return grads_to_cpu(model), 0


def compare_with_reference(model, ref: dict | None, rtol: float) -> dict | None:
    """Worst relative L2 error per parameter of the model's gradients against ``ref`` (on the
    CPU), computed on the device one parameter at a time; ``ok`` when it is at most ``rtol``."""
    if ref is None:
        return None
    worst, same, name_worst = 0.0, True, None
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if grads.keys() != ref.keys():
        return {
            "ok": False,
            "bit_identical": False,
            "max_rel_err": float("inf"),
            "rtol": rtol,
            "note": "different parameters have gradients",
        }
    for n, g in grads.items():
        r = ref[n].to(g.device, non_blocking=False)
        if not torch.equal(g, r):
            same = False
            err = ((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
            if err > worst:
                worst, name_worst = err, n
    return {"ok": worst <= rtol, "bit_identical": same, "max_rel_err": worst, "worst_param": name_worst, "rtol": rtol}


def _summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


# --------------------------------------------------------------------------------------- time model


def layer_flops(cfg_shape: dict, seq: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of one layer's forward + backward + recompute-free step at
    batch 1: 6 x parameters x tokens, and causal attention 2 x seq^2 x dim forward, 2.5x that in
    backward."""
    d, f, h, kv = cfg_shape["dim"], cfg_shape["ffn_dim"], cfg_shape["heads"], cfg_shape["kv_heads"]
    hd = d // h
    params = 2 * d * d + 2 * d * kv * hd + 3 * d * f
    return 6.0 * params * seq, 3.5 * 2.0 * seq * seq * d


def estimate_step_s(shape: dict, layers: int, seq: int, tflops: float, attn_tflops: float, recompute: bool) -> float:
    mm, attn = layer_flops(shape, seq)
    if recompute:  # the recomputed forward: a third of the matmuls, 2/7 of attention
        mm, attn = mm * 4 / 3, attn * 9 / 7
    head = 6.0 * shape["vocab"] * shape["dim"] * seq * 4 / 3
    return (layers * (mm / (tflops * 1e12) + attn / (attn_tflops * 1e12))) + head / (tflops * 1e12)


def calibrate(args, device, dtype, shape) -> dict:
    """Measured step times of a one-layer model: ``checkpoint`` at the shortest and the longest
    length (the FLOP model's error at each: ``scale``) and ``co_offload`` against ``none`` at the
    shortest (how much slower a copy-bound arm is: ``offload_factor``). About two seconds."""
    lo, hi = min(args.seq_lens), max(args.seq_lens)
    model = LlamaDecoder(make_config(shape, 1, hi), seed=args.seed, device=device, dtype=dtype).train()
    out = {"scale": {}, "measured_s": {}}

    def timed(name, seq):
        tokens = random_tokens(model.cfg.vocab, 1, seq, seed=args.seed, device=device)
        arm = build_arm(name, model, tokens, args.chunk, device, {})
        run_step(model, tokens, arm, args.chunk, device)  # warm-up
        t = statistics.median(run_step(model, tokens, arm, args.chunk, device) for _ in range(2))
        model.zero_grad(set_to_none=True)
        return t

    for seq in sorted({lo, hi}):
        t = timed("checkpoint", seq)
        out["measured_s"][f"checkpoint@{seq}"] = t
        out["scale"][seq] = t / estimate_step_s(shape, 1, seq, args.est_tflops, args.est_attn_tflops, True)
    t_none, t_off = timed("none", lo), timed("co_offload", lo)
    out["measured_s"].update({f"none@{lo}": t_none, f"co_offload@{lo}": t_off})
    out["offload_factor"] = max(1.0, t_off / t_none)
    return out  # the model goes with this frame; the caller's next _cleanup returns its memory


def _scale_at(cal: dict, seq: int) -> float:
    """The calibration's scale at ``seq``, interpolated in log(seq) between its two lengths."""
    pts = sorted(cal["scale"].items())
    if len(pts) == 1 or seq <= pts[0][0]:
        return pts[0][1]
    (s0, k0), (s1, k1) = pts[0], pts[-1]
    if seq >= s1:
        return k1
    f = math.log(seq / s0) / math.log(s1 / s0)
    return k0 + f * (k1 - k0)


#: Fewer layers than this leave nothing to overlap: the last layer's input is needed first in backward.
MIN_LAYERS = 2


def choose_layers(args, shape: dict, n_arms: int, cal: dict | None = None) -> tuple[dict, dict]:
    """Layers per length, for a timed part (every arm's ``rounds x steps + 1`` steps, ``co_offload``
    counted ``offload_factor`` times) within 75% of the budget (the rest: calibration, planning,
    the max-sequence search, warm-up): every length starts at MIN_LAYERS, then a layer goes to
    the length whose step is the shortest, while the total fits (the shortest step as long as it
    can be: GPU-bound). Step times come from the FLOP model scaled by ``cal`` (:func:`calibrate`),
    or the FLOP model alone. Returns ({seq: layers}, the arithmetic)."""
    steps = args.rounds * args.steps + 1
    factor = (cal or {}).get("offload_factor", 3.0)
    weight = (n_arms - 1 + factor) if "co_offload" in args.arms else n_arms
    share = 0.75 * args.budget_s

    def est(layers, seq):
        k = _scale_at(cal, seq) if cal else 1.0
        return k * estimate_step_s(shape, layers, seq, args.est_tflops, args.est_attn_tflops, True)

    layers = {seq: MIN_LAYERS for seq in args.seq_lens}

    def total():
        return sum(steps * weight * est(layers[s], s) for s in args.seq_lens)

    while True:
        seq = min((s for s in args.seq_lens if layers[s] < 32), key=lambda s: est(layers[s], s), default=None)
        if seq is None:
            break
        layers[seq] += 1
        if total() > share:
            layers[seq] -= 1
            break
    per_seq = {str(s): est(layers[s], s) for s in args.seq_lens}
    why = {
        "share_s": share,
        "steps_per_arm": steps,
        "arm_weight": weight,
        "offload_factor": factor,
        "per_seq_step_s": per_seq,
        "predicted_timed_s": total(),
        "below_200ms": [s for s, t in per_seq.items() if t < 0.2],
        "assumes": (
            "FLOP model scaled by a measured one-layer calibration"
            if cal
            else f"{args.est_tflops:g} TFLOPS matmul, {args.est_attn_tflops:g} TFLOPS attention (estimate)"
        ),
    }
    return layers, why


# --------------------------------------------------------------------------------------- one length


def run_length(seq: int, layers: int, args, device, dtype, report, deadline: float) -> tuple[dict, int]:
    """Every arm at one length: warm-up step (memory, bytes, gradients), then the timed rounds.
    Returns (the length's result, exit status)."""
    on_gpu = device.type == "cuda"
    shape = GPU_SHAPE if on_gpu and not args.quick else CPU_SHAPE
    cfg = make_config(shape, layers, seq)
    model = LlamaDecoder(cfg, seed=args.seed, device=device, dtype=dtype).train()
    tokens = random_tokens(cfg.vocab, 1, seq, seed=args.seed, device=device)
    elt = torch.empty((), dtype=dtype).element_size()
    theory = layers * seq * cfg.dim * elt
    result = {
        "seq_len": seq,
        "layers": layers,
        "num_parameters": model.num_parameters(),
        "theory_resident_bytes": theory,
        "theory_note": "layers x seq x hidden x bytes: the layer inputs checkpointing keeps",
        "arms": {},
        "status": 0,
    }
    status = 0
    rtol = GRAD_RTOL[device.type]
    arms: dict = {}
    plan_cache: dict = {}
    ref_grads = None
    ref_name = None
    ref_device_bytes = 0  # the reference gradients' copy on the device: not the arm's memory
    rows = result["arms"]
    _sync(device)
    base_alloc = torch.cuda.memory_allocated(device) if on_gpu else None

    # warm-up round: builds each arm, measures memory, bytes, gradients
    for name in args.arms:
        row = rows[name] = {"description": DESCRIPTIONS[name], "baseline": BASELINE[name]}
        if time.perf_counter() > deadline:
            row["status"] = f"skipped: --budget-s {args.budget_s:g} s reached"
            continue
        try:
            arm = build_arm(name, model, tokens, args.chunk, device, plan_cache, tile=args.tile)
        except Skipped as e:
            row["status"] = str(e)
            continue
        except Exception as e:  # noqa: BLE001
            if not _is_oom(e):
                traceback.print_exc()
                status = 1
            row["status"] = "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:200]}"
            _cleanup(model, device)
            continue
        row.update(arm.info)
        rss0 = _rss_bytes()  # around the warm-up step: where host buffers are first allocated
        measure: dict = {}
        try:
            arm.enter()
            try:
                row["warmup_step_s"] = run_step(model, tokens, arm, args.chunk, device, measure)
            finally:
                arm.exit()
        except Exception as e:  # noqa: BLE001
            if not _is_oom(e):
                traceback.print_exc()
                status = 1
            row["status"] = "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:200]}"
            _cleanup(model, device)
            continue
        row.update(status="ok", **measure)
        rss1 = _rss_bytes()
        row["host_rss_growth_bytes"] = None if rss0 is None or rss1 is None else rss1 - rss0
        if on_gpu:
            row["warmup_peak_bytes"] = torch.cuda.max_memory_allocated(device) - ref_device_bytes
        if name in CHECKPOINT_ARMS and row.get("resident_after_forward_bytes") is not None:
            row["resident_over_theory"] = row["resident_after_forward_bytes"] / theory
        if ref_grads is None and name in ("none", "checkpoint"):
            (ref_grads, ref_device_bytes), ref_name = reference_grads(model, device), name
            row["grads"] = {"reference": name, "ok": True, "note": "this arm is the reference"}
        else:
            arm_rtol = LOSSY_RTOL if name in LOSSY_ARMS else TILED_RTOL[device.type] if name in TILED_ARMS else rtol
            g = compare_with_reference(model, ref_grads, arm_rtol)
            row["grads"] = dict(g or {"ok": None, "note": "no reference arm ran"}, reference=ref_name)
            if g is not None and not g["ok"]:
                status = 1
                print(
                    f"long_context: seq {seq} {name}: gradients differ from {ref_name} "
                    f"(max relative error {g['max_rel_err']:.3e} > {arm_rtol:g})"
                )
        arms[name] = arm
        model.zero_grad(set_to_none=True)
    del ref_grads  # before timing: the timed peaks hold nothing but the arm's own memory
    _cleanup(model, device)

    # timed rounds, round-robin
    times = {name: [] for name in arms}
    peaks = {name: 0 for name in arms}
    rounds_done = 0
    for _ in range(args.rounds):
        predicted = sum(args.steps * statistics.median(times[n] or [rows[n]["warmup_step_s"]]) for n in arms)
        if rounds_done and time.perf_counter() + predicted > deadline:
            result["rounds_note"] = (
                f"stopped after {rounds_done} of {args.rounds} rounds: the next would end past "
                f"--budget-s {args.budget_s:g} s"
            )
            break
        gc.collect()  # once per round: a full collection costs ~0.1-1 s in a process that imported dynamo
        gc.disable()
        for name in list(arms):
            arm = arms[name]
            try:
                arm.enter()
                try:
                    for _ in range(args.steps):
                        times[name].append(run_step(model, tokens, arm, args.chunk, device))
                        if on_gpu:
                            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
                finally:
                    arm.exit()
            except Exception as e:  # noqa: BLE001
                if not _is_oom(e):
                    traceback.print_exc()
                    status = 1
                rows[name]["status"] = "OOM" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:200]}"
                del arms[name]
                _cleanup(model, device)
        gc.enable()
        rounds_done += 1
    result["rounds_done"] = rounds_done

    for name, arm in arms.items():
        row = rows[name]
        row.update(_summary(times[name]), step_times_s=times[name])
        row["per_round_median_s"] = [
            statistics.median(times[name][i : i + args.steps]) for i in range(0, len(times[name]), args.steps)
        ]
        if on_gpu:
            row["peak_bytes"] = peaks[name] or row.get("warmup_peak_bytes")
            row["peak_above_weights_bytes"] = row["peak_bytes"] - base_alloc
        if arm.pool is not None:
            s = arm.pool.stats()
            row["pinned_host_bytes"] = s.get("peak_bytes_reserved")
            row["pool_backend"] = s.get("backend")
        elif name in ("hf_offload", "torchtune"):
            # torch's pinned allocator is shared by both: what this arm held after its forward
            row["pinned_host_bytes"] = row.get("pinned_in_use_after_forward_bytes")
        if arm.pool is not None and arm.pool is not co.default_pool():
            co.synchronize()
            arm.pool.empty_cache()
    finish_ratios(rows)
    del arms, model, tokens
    _cleanup(None, device)
    return result, status


def _cleanup(model, device):
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def finish_ratios(rows: dict) -> None:
    """Ratios to ``checkpoint`` and to each arm's baseline, each with the A/A noise floor next to it."""
    t = {n: r.get("median_s") for n, r in rows.items() if r.get("status") == "ok" and r.get("median_s")}
    aa = (t["checkpoint_aa"] / t["checkpoint"]) if "checkpoint_aa" in t and "checkpoint" in t else None
    noise = abs(aa - 1.0) if aa is not None else None
    for name, row in rows.items():
        if name not in t:
            continue
        row["ratio_to_checkpoint"] = t[name] / t["checkpoint"] if "checkpoint" in t else None
        base = BASELINE[name]
        row["ratio_to_baseline"] = t[name] / t[base] if base in t else None
        row["aa_ratio"] = aa
        row["noise_floor"] = noise


# --------------------------------------------------------------------------------------- max sequence


def fit_linear(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """Least-squares ``peak = a + b * seq`` through ``(seq, peak)`` points; None under 2 lengths."""
    if len({s for s, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(p for _, p in points) / n
    sxx = sum((s - mx) ** 2 for s, _ in points)
    b = sum((s - mx) * (p - my) for s, p in points) / sxx
    return my - b * mx, b


def predict_max_seq(fit: tuple[float, float], cap_bytes: int, multiple: int = 1024) -> int | None:
    """The longest multiple of ``multiple`` whose fitted peak is at most ``cap_bytes``."""
    a, b = fit
    if b <= 0:
        return None
    s = int((cap_bytes - a) / b) // multiple * multiple
    return max(0, s)


MAX_SEQ_ARMS = (
    "none",
    "checkpoint",
    "hf_offload",
    "torchtune",
    "co_checkpoint",
    "co_checkpoint_offload",
    "co_offload",
    "co_checkpoint_offload_tile",
    "co_checkpoint_offload_tile_norms",
    "co_checkpoint_tile",
)
#: Which verifications the time budget goes to first: the recipe this project recommends and the
#: ones a user compares it with.
VERIFY_ORDER = (
    "co_checkpoint_offload_tile",
    "checkpoint",
    "co_checkpoint_offload",
    "hf_offload",
    "torchtune",
    "co_checkpoint",
    "none",
    "co_offload",
    "co_checkpoint_offload_tile_norms",
    "co_checkpoint_tile",
)
#: Offloaded bytes may take at most this share of the host's memory (pinned memory cannot swap).
HOST_SHARE = 0.6


def _host_total_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def max_seq_search(args, device, dtype, layers: int, seq0: int, deadline: float) -> dict:
    """Per arm and cap: peaks (and bytes moved to the host) measured at seq0/4, seq0/2 and seq0
    on a ``layers``-layer model, a linear fit, the predicted longest sequence under the cap (and
    under HOST_SHARE of the host's memory for the bytes an arm offloads), then, in VERIFY_ORDER
    while the time budget allows, one step under ``set_per_process_memory_fraction`` at the
    prediction (at most two tries: the prediction, then 90% of it)."""
    out = {
        "layers": layers,
        "caps_gb": args.caps_gb,
        "arms": {},
        "method": (
            f"peak = a + b*seq fitted at 3 lengths on {layers} layers; the cap's length verified by one "
            f"step under torch.cuda.set_per_process_memory_fraction while the time budget allows"
        ),
    }
    if device.type != "cuda":
        out["status"] = "skipped: CPU run (needs torch.cuda.set_per_process_memory_fraction and max_memory_allocated)"
        return out
    total = torch.cuda.get_device_properties(device).total_memory
    host = _host_total_bytes()
    cfg = make_config(GPU_SHAPE, layers, 1 << 20)
    model = LlamaDecoder(cfg, seed=args.seed, device=device, dtype=dtype).train()
    lengths = sorted({max(1024, seq0 // 4), max(1024, seq0 // 2), seq0})
    step_s: dict = {}
    if "co_plan" in args.arms:
        out["arms"]["co_plan"] = {"status": "skipped: a plan is made for one length and one budget"}
    for name in MAX_SEQ_ARMS:
        if name not in args.arms:
            continue
        row = out["arms"][name] = {}
        if time.perf_counter() > deadline:
            row["status"] = f"skipped: --budget-s {args.budget_s:g} s reached"
            continue
        points, moved = [], []
        try:
            # one arm for every length: its pool's pinned segments are allocated once (pinning
            # tens of GB takes seconds)
            arm = build_arm(name, model, None, args.chunk, device, {}, tile=args.tile)
            arm.enter()
            try:
                for s in lengths:
                    tokens = random_tokens(cfg.vocab, 1, s, seed=args.seed, device=device)
                    _cleanup(model, device)
                    measure: dict = {}
                    step_s[(name, s)] = run_step(model, tokens, arm, args.chunk, device, measure)
                    points.append((s, torch.cuda.max_memory_allocated(device)))
                    moved.append((s, measure.get("bytes_moved_d2h") or 0))
                    del tokens
                    model.zero_grad(set_to_none=True)
            finally:
                arm.exit()
            del arm
        except Skipped as e:
            row["status"] = str(e)
            continue
        except Exception as e:  # noqa: BLE001
            row["status"] = "OOM while fitting" if _is_oom(e) else f"failed: {type(e).__name__}: {str(e)[:200]}"
            _cleanup(model, device)
            continue
        fit = fit_linear(points)
        host_fit = fit_linear(moved)
        row.update(status="ok", points=points, fit_bytes=fit, host_bytes_points=moved, caps={})
        host_limit = None
        if host and host_fit and host_fit[1] > 0:
            host_limit = predict_max_seq(host_fit, int(HOST_SHARE * host))
            row["host_limited_max_seq"] = host_limit
        for cap_gb in args.caps_gb:
            pred = predict_max_seq(fit, int(cap_gb * 1e9))
            cell = row["caps"][str(cap_gb)] = {"predicted_max_seq": pred, "verified": None}
            if pred and host_limit is not None and host_limit < pred:
                cell["predicted_max_seq"] = host_limit
                cell["limited_by"] = f"host memory ({HOST_SHARE:.0%} of {host / 1e9:.0f} GB for offloaded bytes)"
    for name in VERIFY_ORDER:
        row = out["arms"].get(name) or {}
        if row.get("status") != "ok":
            continue
        for cap_gb in sorted(args.caps_gb):
            cell = row["caps"][str(cap_gb)]
            pred = cell["predicted_max_seq"]
            if not pred:
                continue
            for attempt in (pred, pred * 9 // 10 // 1024 * 1024):
                ref = lengths[-1]
                est = step_s[(name, ref)] * (
                    estimate_step_s(GPU_SHAPE, layers, attempt, args.est_tflops, args.est_attn_tflops, name != "none")
                    / estimate_step_s(GPU_SHAPE, layers, ref, args.est_tflops, args.est_attn_tflops, name != "none")
                )
                if time.perf_counter() + 2 * est > deadline:
                    cell["verified"] = (
                        f"not verified: a step at {attempt} takes ~{est:.0f} s (estimate), past --budget-s"
                    )
                    break
                ok = _try_under_cap(model, name, attempt, int(cap_gb * 1e9), total, args, device)
                cell.setdefault("tries", []).append({"seq": attempt, "fits": ok})
                if ok:
                    cell["verified"] = attempt
                    break
            else:
                cell["verified"] = "OOM at both tries"
    del model
    _cleanup(None, device)
    return out


def _try_under_cap(model, name, seq, cap, total, args, device) -> bool:
    tokens = random_tokens(model.cfg.vocab, 1, seq, seed=args.seed, device=device)
    _cleanup(model, device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        arm = build_arm(name, model, tokens, args.chunk, device, {}, tile=args.tile)
        arm.enter()
        try:
            run_step(model, tokens, arm, args.chunk, device)
        finally:
            arm.exit()
        return True
    except Exception as e:
        if not _is_oom(e):
            raise
        return False
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        del tokens
        _cleanup(model, device)


# --------------------------------------------------------------------------------------- memory per token

#: The arms of the memory-per-token table: Hugging Face's gradient checkpointing (torch's checkpoint
#: per layer), ours with the inputs offloaded, and the tiled recipes.
PER_TOKEN_ARMS = (
    "checkpoint",
    "co_checkpoint_offload",
    "co_checkpoint_tile",
    "co_checkpoint_offload_tile",
    "co_checkpoint_offload_tile_norms",
)
#: The per-token model at the 8B-class proportions (32 query / 8 key-value heads, SwiGLU 3.5x the
#: hidden size, a vocabulary 7.8x it, as 32000 is of 4096) at a hidden size a CPU steps in seconds.
#: The lengths lie within one of the ranges torch's CPU flash attention splits queries the same in
#: (192-767 tokens: blocks of 64; from 768: 256), whose buffers differ in size: across two ranges the
#: peaks are not one line (measured: a step of ~1 MB between 512 and 768 tokens at hidden 64).
#: Small tiles and loss chunks, so that the moments of the step whose peak does not grow with the
#: sequence (one tile's working set, one chunk's logits) weigh little beside those that do.
PER_TOKEN_FULL = {
    "layers": 32,
    "dim": 256,
    "seq_lens": [1024, 1536, 2048],
    "tile": 16,
    "chunk": 16,
    "dtype": "bfloat16",
}
PER_TOKEN_QUICK = {"layers": 2, "dim": 64, "seq_lens": [256, 512], "tile": 16, "chunk": 32, "dtype": "bfloat16"}
#: The memory caps the table predicts the longest sequence under (GB: 1e9 bytes).
PREDICT_CAPS_GB = (40.0, 80.0, 141.0)
PREDICT_LAYERS = 32
#: Loss bytes per token of one chunk on the GPU: bf16 logits, their float32 copy, its gradient and
#: the bf16 gradient (an estimate of the loss chunk's working set).
LOSS_BYTES_PER_LOGIT = 2 + 4 + 4 + 2


def per_token_shape(dim: int) -> dict:
    """GPU_SHAPE's proportions at hidden size ``dim`` (a multiple of 64)."""
    scale = dim / GPU_SHAPE["dim"]
    return {
        "vocab": max(64, round(GPU_SHAPE["vocab"] * scale / 64) * 64),
        "dim": dim,
        "heads": GPU_SHAPE["heads"],
        "kv_heads": GPU_SHAPE["kv_heads"],
        "ffn_dim": round(GPU_SHAPE["ffn_dim"] * scale),
        "rope_theta": GPU_SHAPE["rope_theta"],
    }


def profiler_peak_bytes(step) -> int:
    """The most bytes torch's CPU allocator held during ``step()`` above what it held when the step
    began, from torch.profiler's memory events: a measure independent of ckpt_offload's counters
    (the host pool allocates its own memory, so offloaded bytes are not counted; reloads are)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            totals = [e["args"]["Total Allocated"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    return max(totals) - totals[0] if totals else 0


def per_token_settings(args) -> dict:
    base = dict(PER_TOKEN_QUICK if args.quick and not args.per_token else PER_TOKEN_FULL)
    for key, value in (
        ("layers", args.per_token_layers),
        ("dim", args.per_token_dim),
        ("seq_lens", args.per_token_seq_lens),
        ("tile", args.per_token_tile),
        ("chunk", args.per_token_chunk),
    ):
        if value is not None:
            base[key] = sorted(set(value)) if key == "seq_lens" else value
    return base


def per_token_table(args) -> dict:
    """Peak bytes per token of each PER_TOKEN_ARMS arm, measured on the CPU (module docstring),
    and what they predict for the 8B-class stack."""
    st = per_token_settings(args)
    shape = per_token_shape(st["dim"])
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[st["dtype"]]
    elt = torch.empty((), dtype=dtype).element_size()
    device = torch.device("cpu")
    t0 = time.perf_counter()
    points = {name: [] for name in PER_TOKEN_ARMS}
    moved = {name: [] for name in PER_TOKEN_ARMS}
    status = {}
    for seq in st["seq_lens"]:
        cfg = make_config(shape, st["layers"], seq)
        model = LlamaDecoder(cfg, seed=args.seed, device=device, dtype=dtype).train()
        tokens = random_tokens(cfg.vocab, 1, seq, seed=args.seed, device=device)
        for name in PER_TOKEN_ARMS:
            if status.get(name, "ok") != "ok":
                continue
            try:
                # Copies inline (compute stream): a CPU copy thread behind a busy machine would hold
                # its sources longer than a GPU's copy engine does. No prefetch then: a GPU's window
                # holds one or two layer inputs more.
                arm = build_arm(name, model, tokens, st["chunk"], device, {}, tile=st["tile"], cpu_stream="compute")
                arm.enter()
                try:
                    measure: dict = {}
                    # Warm-up (and bytes moved); the gradients exist from here on and are zeroed in
                    # place: the peak is activations and temporaries, not the gradients' allocation.
                    run_step(model, tokens, arm, st["chunk"], device, measure, keep_grads=True)
                    peak = profiler_peak_bytes(
                        lambda m=model, t=tokens, a=arm: run_step(m, t, a, st["chunk"], device, keep_grads=True)
                    )
                finally:
                    arm.exit()
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                status[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                continue
            status[name] = "ok"
            points[name].append((seq, peak))
            moved[name].append((seq, measure.get("bytes_moved_d2h") or 0))
            print(
                f"long_context: per token: seq {seq} {name}: peak {peak:,} bytes, moved {moved[name][-1][1]:,} bytes",
                flush=True,
            )
        del model, tokens
        gc.collect()
    width = st["dim"] * elt
    arms = {}
    for name in PER_TOKEN_ARMS:
        if status.get(name) != "ok":
            arms[name] = {"status": status.get(name, "not run")}
            continue
        # The peak is the largest of several moments' lines (a + b * seq); at longer sequences the
        # steepest wins, so the slope between the two longest lengths is the bytes per token, and
        # the least-squares fit's residual says whether the lines crossed within the lengths.
        a, b_fit = fit_linear(points[name])
        residual = max(abs(p - (a + b_fit * s)) / p for s, p in points[name])
        (s0, p0), (s1, p1) = points[name][-2:]
        b = (p1 - p0) / (s1 - s0)
        host = fit_linear(moved[name])
        arms[name] = {
            "status": "ok",
            "description": DESCRIPTIONS[name],
            "points": points[name],
            "bytes_moved_points": moved[name],
            "bytes_per_token": b,
            "fit_bytes_per_token": b_fit,
            "intercept_bytes": a,
            "fit_max_residual": residual,
            "widths_per_token": b / width,
            "host_bytes_per_token": host[1] if host else 0.0,
            "host_widths_per_token": (host[1] if host else 0.0) / width,
        }
    out = {
        "settings": st,
        "shape": shape,
        "elapsed_s": None,
        "arms": arms,
        "method": (
            f"{st['layers']}-layer decoder at hidden {st['dim']} ({shape['heads']} query / "
            f"{shape['kv_heads']} KV heads, SwiGLU {shape['ffn_dim']}, vocabulary {shape['vocab']}), "
            f"{st['dtype']}, batch 1, on the CPU; peak of torch-allocated memory of one forward + backward "
            f"(after a warm-up step) from "
            f"torch.profiler memory events at {st['seq_lens']} tokens, bytes per token = the slope between "
            f"the two longest (fit residual: of the least-squares line through all); widths = "
            f"b / (hidden x {elt} bytes); tiled arms: MLP tiles of {st['tile']} positions, loss tiles of "
            f"{st['chunk']} tokens (the other arms: chunks of {st['chunk']} tokens)"
        ),
    }
    out["prediction"] = predict_8b(arms, args)
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def predict_8b(arms: dict, args) -> dict:
    """The longest sequence of the 32-layer 8B-class stack (GPU_SHAPE, bf16) under each cap, from the
    measured widths per token; the fixed part: weights and gradients (bf16), one loss chunk, and for a
    tiled arm one tile's working set (the widths tiling removed, over one tile)."""
    cfg = make_config(GPU_SHAPE, PREDICT_LAYERS, 1 << 20)
    elt, dim = 2, GPU_SHAPE["dim"]
    weights = cfg.num_parameters() * elt
    chunk = GPU_DEFAULTS["chunk"]
    tile = args.tile if args.tile and not args.quick else GPU_DEFAULTS["tile"]
    loss_chunk = chunk * GPU_SHAPE["vocab"] * LOSS_BYTES_PER_LOGIT
    untiled_of = {
        "co_checkpoint_tile": "checkpoint",
        "co_checkpoint_offload_tile": "co_checkpoint_offload",
        "co_checkpoint_offload_tile_norms": "co_checkpoint_offload",
    }
    out = {
        "layers": PREDICT_LAYERS,
        "shape": dict(GPU_SHAPE),
        "dtype": "bfloat16",
        "weights_bytes": weights,
        "grads_bytes": weights,
        "loss_chunk_bytes": loss_chunk,
        "loss_chunk_tokens": chunk,
        "tile": tile,
        "host_gb": args.host_gb,
        "host_share": HOST_SHARE,
        "caps_gb": list(PREDICT_CAPS_GB),
        "arms": {},
        "assumes": (
            f"per token: the CPU-measured widths x {dim} x {elt} bytes; fixed: weights + gradients "
            f"({2 * weights / 1e9:.1f} GB), one loss chunk of {chunk} tokens x vocabulary "
            f"{GPU_SHAPE['vocab']} x {LOSS_BYTES_PER_LOGIT} bytes ({loss_chunk / 1e9:.2f} GB), tiled arms "
            f"one tile of {tile} positions x the widths tiling removed; no optimizer state; host: "
            f"{HOST_SHARE:.0%} of {args.host_gb:g} GB for offloaded bytes (--host-gb)"
        ),
    }
    base = None
    for name, r in arms.items():
        if r.get("status") != "ok":
            continue
        per_token = r["widths_per_token"] * dim * elt
        host_per_token = r["host_widths_per_token"] * dim * elt
        fixed = 2 * weights + loss_chunk
        src = untiled_of.get(name)
        tile_ws = 0.0
        if src in arms and arms[src].get("status") == "ok":
            tile_ws = max(0.0, arms[src]["widths_per_token"] - r["widths_per_token"]) * dim * elt * tile
        fixed += tile_ws
        row = {
            "bytes_per_token": per_token,
            "host_bytes_per_token": host_per_token,
            "fixed_bytes": fixed,
            "tile_working_set_bytes": tile_ws,
            "caps": {},
        }
        for cap in PREDICT_CAPS_GB:
            s = predict_max_seq((fixed, per_token), int(cap * 1e9)) or 0  # None: no bytes per token measured
            host_bytes = host_per_token * s
            row["caps"][str(cap)] = {
                "max_seq": s,
                "host_bytes": host_bytes,
                "disk_tier": host_bytes > HOST_SHARE * args.host_gb * 1e9,
            }
        out["arms"][name] = row
        if name == "checkpoint":
            base = row
    for row in out["arms"].values():
        row["per_token_ratio_to_checkpoint"] = (
            base["bytes_per_token"] / row["bytes_per_token"] if base and row["bytes_per_token"] > 0 else None
        )
        for cap, cell in row["caps"].items():
            b = base["caps"][cap]["max_seq"] if base else None
            cell["ratio_to_checkpoint"] = cell["max_seq"] / b if b else None
    return out


def format_per_token(pt: dict) -> list:
    """The memory-per-token section of the markdown report."""
    lines = [
        "## Memory per token (CPU-measured) and the longest sequence of the 8B-class stack",
        "",
        f"Measured: {pt['method']}. {pt['elapsed_s']:.0f} s.",
        "",
        "| arm | bytes / token | widths / token | x checkpoint | fit residual | host bytes / token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    arms = pt["arms"]
    ck = arms.get("checkpoint", {}).get("bytes_per_token")
    for name, r in arms.items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | {r.get('status')} | | | | |")
            continue
        ratio = f"{ck / r['bytes_per_token']:.2f}" if ck else "-"
        lines.append(
            f"| {name} | {r['bytes_per_token']:,.0f} | {r['widths_per_token']:.2f} | {ratio} | "
            f"{r['fit_max_residual']:.1e} | {r['host_bytes_per_token']:,.0f} |"
        )
    pr = pt["prediction"]
    caps = pr["caps_gb"]
    lines += [
        "",
        f"Predicted for {pr['layers']} layers of hidden {pr['shape']['dim']} (bf16): {pr['assumes']}.",
        "",
        "| arm | GB / 1K tokens | fixed GB | "
        + " | ".join(f"{c:g} GB: longest seq (x ckpt), host GB" for c in caps)
        + " |",
        "|---|---:|---:|" + "---:|" * len(caps),
    ]
    for name, row in pr["arms"].items():
        cells = []
        for c in caps:
            cell = row["caps"][str(c)]
            ratio = "-" if cell["ratio_to_checkpoint"] is None else f"{cell['ratio_to_checkpoint']:.2f}x"
            disk = " **disk tier**" if cell["disk_tier"] else ""
            cells.append(f"{cell['max_seq']:,} ({ratio}), {cell['host_bytes'] / 1e9:.0f}{disk}")
        lines.append(
            f"| {name} | {row['bytes_per_token'] * 1024 / 1e9:.3f} | {row['fixed_bytes'] / 1e9:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    return lines


# --------------------------------------------------------------------------------------- report


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _gib(x) -> str:
    """Bytes in GiB, or MiB / KiB below one (the CPU run's sizes)."""
    if x is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x} B"


def _ratio(x, noise) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" + ("" if noise is None else f" (±{noise * 100:.1f}%)")


def format_markdown(report: dict) -> str:
    cpu = report["mode"] == "cpu"
    lines = ["# Long-context benchmark: checkpoint and offload recipes" + (" (CPU)" if cpu else ""), ""]
    if cpu:
        lines += [f"> **{CPU_WARNING}**", ""]
    lines.append(
        f"{report.get('gpu_name') or 'CPU'} · torch {report['torch_version']} · ckpt_offload "
        f"{report['build_info'].get('version')} · {report['date']} · {report['elapsed_s']:.0f} s"
    )
    lines.append(f"Model: {report['model_note']}. Loss: {report['loss_note']}. Step: {report['step_note']}.")
    lw = report["layers_why"]
    lines.append(f"Layers: {report['layers_per_seq']} ({lw})")
    lines.append(f"Timing: {report['timing_note']}. Ratios: (±x%) is the A/A pair's |ratio - 1|, the noise floor.")
    lines.append("")
    for res in report["results"]:
        if "skipped" in res:
            lines += [f"## seq {res['seq_len']}: {res['skipped']}", ""]
            continue
        lines.append(
            f"## seq {res['seq_len']} · {res['layers']} layers · {res['num_parameters'] / 1e6:.1f} M "
            f"parameters · {res.get('rounds_done')} rounds"
            + (f" ({res['rounds_note']})" if res.get("rounds_note") else "")
        )
        lines.append("")
        lines.append(f"Theory (checkpointing keeps the layer inputs): {_gib(res['theory_resident_bytes'])}.")
        lines.append("")
        lines.append(
            "| arm | median ms (min-max) | x checkpoint | x baseline | peak | resident after fwd "
            "(/ theory) | moved D2H /step | pinned host | RSS growth | grads vs reference |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, r in res["arms"].items():
            if r.get("status") != "ok":
                lines.append(f"| {name} | {r.get('status')} |" + " |" * 8)
                continue
            g = r.get("grads") or {}
            gcell = (
                "reference"
                if g.get("note") == "this arm is the reference"
                else (
                    "-"
                    if g.get("ok") is None
                    else (
                        "= (bit-identical)"
                        if g.get("bit_identical")
                        else f"{'ok' if g['ok'] else 'WRONG'} ({g['max_rel_err']:.1e} rel)"
                    )
                )
            )
            res_cell = _gib(r.get("resident_after_forward_bytes"))
            if r.get("resident_over_theory"):
                res_cell += f" ({r['resident_over_theory']:.3f})"
            base = r.get("baseline")
            lines.append(
                f"| {name} | {_ms(r.get('median_s'))} ({_ms(r.get('min_s'))}-{_ms(r.get('max_s'))}) | "
                f"{_ratio(r.get('ratio_to_checkpoint'), r.get('noise_floor'))} | "
                f"{_ratio(r.get('ratio_to_baseline'), r.get('noise_floor'))}{'' if not base else ' vs ' + base} | "
                f"{_gib(r.get('peak_bytes'))} | {res_cell} | {_gib(r.get('bytes_moved_d2h'))} | "
                f"{_gib(r.get('pinned_host_bytes'))} | {_gib(r.get('host_rss_growth_bytes'))} | {gcell} |"
            )
        plan = res["arms"].get("co_plan") or {}
        if plan.get("budget_bytes"):
            lines.append("")
            lines.append(
                f"co_plan: budget {_gib(plan['budget_bytes'])} of saved activations (checkpoint "
                f"{_gib(plan['checkpoint_predicted_peak_bytes'])}, checkpoint+offload "
                f"{_gib(plan['checkpoint_offload_predicted_peak_bytes'])}, predicted); choices "
                f"{plan['choices']}; predicted step {_ms(plan['predicted_step_s'])} ms, measured "
                f"{_ms(plan.get('median_s'))} ms."
            )
        lines.append("")
    ms = report.get("max_seq") or {}
    lines.append("## Max trainable sequence under a memory cap")
    lines.append("")
    if ms.get("status"):
        lines.append(ms["status"])
    else:
        lines.append(f"{ms.get('layers')} layers; {ms.get('method')}.")
        lines.append("")
        caps = ms.get("caps_gb") or []
        lines.append("| arm | " + " | ".join(f"{c:g} GB: predicted / verified" for c in caps) + " |")
        lines.append("|---|" + "---|" * len(caps))
        for name, r in (ms.get("arms") or {}).items():
            if r.get("status") != "ok":
                lines.append(f"| {name} | {r.get('status')} |" + " |" * (len(caps) - 1))
                continue
            cells = []
            for c in caps:
                cell = r["caps"].get(str(c)) or {}
                cells.append(f"{cell.get('predicted_max_seq')} / {cell.get('verified')}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    if report.get("per_token"):
        lines += format_per_token(report["per_token"])
    if report.get("skipped"):
        lines.append("Skipped by the budget: " + "; ".join(report["skipped"]))
    return "\n".join(lines) + "\n"


def write_plot(report: dict, path: str) -> str | None:
    """Peak memory against step time, one point per arm and length. None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    cpu = report["mode"] == "cpu"
    fig, ax = plt.subplots(figsize=(9, 6))
    markers = "osD^v<>px*"
    labelled = set()
    for res in report["results"]:
        for i, (name, r) in enumerate((res.get("arms") or {}).items()):
            if r.get("status") != "ok":
                continue
            label = None if name in labelled else name
            labelled.add(name)
            y = r.get("peak_bytes") if not cpu else r.get("bytes_moved_d2h") or 0
            ax.scatter(
                r["median_s"] * 1e3, (y or 0) / GiB, marker=markers[i % len(markers)], color=f"C{i}", label=label
            )
            ax.annotate(str(res["seq_len"]), (r["median_s"] * 1e3, (y or 0) / GiB), fontsize=6)
    ax.set_xlabel("median step time (ms)" + (" - CPU times" if cpu else ""))
    ax.set_ylabel(
        "bytes moved to the host per step (GiB) - CPU: no device memory" if cpu else "peak device memory (GiB)"
    )
    ax.set_title(f"{report.get('gpu_name') or 'CPU (not GPU numbers)'} · long context · label = seq len")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(report: dict, out: str) -> None:
    save_report(out, "long_context", report, format_markdown(report))
    why = write_plot(report, os.path.join(out, "long_context.png"))
    report["plot"] = f"not written: {why}" if why else "long_context.png"


# --------------------------------------------------------------------------------------- main


def _float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _arm_list(text: str) -> list[str]:
    names = [v for v in text.replace(" ", "").split(",") if v]
    unknown = [n for n in names if n not in ARMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--arms: unknown arm {unknown or text!r}; choose from {', '.join(ARMS)}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="CPU, tiny shapes, every arm's code path, seconds")
    p.add_argument("--out", default=None, help="write long_context.json, .md and .png into this folder")
    p.add_argument("--seq-lens", type=positive_int_list, default=None, help="default 8192,16384,32768")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers at every length (default: the most the budget allows, per length)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per arm per round (default 5)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per loss chunk (default 4096)")
    p.add_argument(
        "--tile",
        type=int,
        default=None,
        help="positions per MLP tile of the tiled arms (default 4096, the hidden size; CPU 16)",
    )
    p.add_argument(
        "--per-token",
        action="store_true",
        help="only the CPU memory-per-token table at the 8B-class proportions (see the module docstring)",
    )
    p.add_argument("--per-token-layers", type=int, default=None, help="layers of the per-token model (default 32)")
    p.add_argument("--per-token-dim", type=int, default=None, help="hidden size of the per-token model (default 256)")
    p.add_argument(
        "--per-token-seq-lens",
        type=positive_int_list,
        default=None,
        help="lengths the per-token peaks are measured at (default 1024,1536,2048)",
    )
    p.add_argument("--per-token-tile", type=int, default=None, help="MLP tile of the per-token model (default 32)")
    p.add_argument("--per-token-chunk", type=int, default=None, help="loss chunk of the per-token model (default 64)")
    p.add_argument(
        "--host-gb",
        type=float,
        default=128.0,
        help="host memory the predictions assume for the GPU machine, GB (default 128); "
        f"{HOST_SHARE:.0%} of it may hold offloaded bytes",
    )
    p.add_argument("--arms", type=_arm_list, default=list(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument(
        "--caps-gb",
        type=_float_list,
        default=[80.0, 40.0],
        help="memory caps of the max-sequence search, GB (default 80,40; empty: no search)",
    )
    p.add_argument("--budget-s", type=float, default=None, help="whole-run time budget (default 170 s)")
    p.add_argument("--est-tflops", type=float, default=600.0, help="matmul TFLOPS the layer count assumes")
    p.add_argument("--est-attn-tflops", type=float, default=400.0, help="attention TFLOPS the layer count assumes")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    gpu = co.build_info()["gpu_available"]  # CUDA tensors can be offloaded here (ckpt_offload's one test of it)
    if args.device == "auto":
        args.device = "cuda" if gpu and not args.quick else "cpu"
    elif args.device == "cuda" and not gpu:
        p.error("--device cuda: no usable CUDA device (or ckpt_offload built without CUDA); use --device cpu")
    if args.device == "cpu":
        args.quick = True  # the 8B-class shapes are GPU shapes: CPU always runs the tiny ones
    defaults = CPU_QUICK if args.quick else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for name in ("layers", "rounds", "steps", "chunk", "tile"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name}: must be >= 1, got {v}")
    args.seq_lens = sorted(set(args.seq_lens))
    args.arms = [a for a in ARMS if a in args.arms]
    return args


def main(argv=None) -> int:
    """Runs the benchmark; returns the exit status (1: an arm crashed or its gradients are wrong).

    Example::

        main(["--quick", "--out", "/tmp/long_context"])     # CPU: seconds
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    shape = CPU_SHAPE if args.quick else GPU_SHAPE
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    old_threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)  # tiny CPU kernels: the intra-op pool only adds noise on a few cores
    status = 0
    try:
        if args.per_token:
            return run_per_token(args)
        arithmetic = None
        if args.layers:
            layers = {s: args.layers for s in args.seq_lens}
            why = f"--layers {args.layers}"
        else:
            cal = calibrate(args, device, dtype, shape)
            layers, arithmetic = choose_layers(args, shape, len(args.arms), cal)
            arithmetic["calibration"] = cal
            why = (
                f"the timed part within 75% of --budget-s {args.budget_s:g} ({arithmetic['share_s']:.0f} s): "
                f"{arithmetic['steps_per_arm']} steps x {arithmetic['arm_weight']:.1f} arm-equivalents (co_offload "
                f"counts {arithmetic['offload_factor']:.1f}, measured) x the step, layers added where the step is "
                f"shortest; predicted steps "
                f"{ {k: round(v, 3) for k, v in arithmetic['per_seq_step_s'].items()} } s, timed part "
                f"{arithmetic['predicted_timed_s']:.0f} s; at least {MIN_LAYERS} layers (with one, nothing "
                f"overlaps a reload); {arithmetic['assumes']}"
                + (
                    f"; step under 200 ms at {arithmetic['below_200ms']}: raise --budget-s for more layers"
                    if arithmetic["below_200ms"]
                    else ""
                )
            )
        report = {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),  # noqa: UP017
            "mode": "gpu" if on_gpu else "cpu",
            "warning": None if on_gpu else CPU_WARNING,
            "gpu_name": torch.cuda.get_device_name(device) if on_gpu else None,
            "torch_version": torch.__version__,
            "build_info": co.build_info(),
            "host": {
                "hostname": socket.gethostname(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "args": vars(args),
            "arms": {a: DESCRIPTIONS[a] for a in args.arms},
            "baselines": {a: BASELINE[a] for a in args.arms},
            "model_note": (
                f"{'8B-class' if not args.quick else 'tiny CPU'} decoder layers: hidden {shape['dim']}, "
                f"{shape['heads']} query / {shape['kv_heads']} KV heads, SwiGLU {shape['ffn_dim']}, "
                f"RMSNorm, RoPE, SDPA; {args.dtype}; batch 1"
            ),
            "loss_note": (
                f"vocabulary {shape['vocab']}; LM head + float32 cross-entropy in {args.chunk}-token "
                f"chunks, each under torch.utils.checkpoint (logits never exceed one chunk), outside "
                f"every arm's context; the tiled arms: co.tiled_cross_entropy in tiles of {args.chunk} "
                f"tokens, their MLPs in tiles of {args.tile} positions"
            ),
            "step_note": "forward + backward, no optimizer step (same for every arm; adds only weight memory)",
            "timing_note": (
                f"{'CUDA events' if on_gpu else 'perf_counter (CPU)'} per step, gc disabled, "
                f"{args.rounds} rounds x {args.steps} steps per arm interleaved round-robin after one "
                f"warm-up step per arm (memory, bytes, gradients); median and min-max"
            ),
            "layers_per_seq": {str(k): v for k, v in layers.items()},
            "layers_why": why,
            "layers_arithmetic": arithmetic,
            "results": [],
            "skipped": [],
        }
        print(f"long_context: {report['gpu_name'] or 'CPU (CPU numbers, not GPU numbers)'} · {report['model_note']}")
        print(f"long_context: layers {report['layers_per_seq']}: {why}")
        if on_gpu:
            raw = raw_copy_bandwidth(64 * MiB, device)
            report["raw_bandwidth"] = raw
            print(
                f"long_context: raw pinned copy 64 MiB: D2H {raw['d2h_gbps']:.1f} GB/s, H2D {raw['h2d_gbps']:.1f} GB/s"
            )
        # leave time for the max-sequence search after the timed lengths
        reserve = 0.15 * args.budget_s if (on_gpu and args.caps_gb) else 0.0
        last = None
        for seq in args.seq_lens:
            now = time.perf_counter()
            # the calibrated prediction; else the previous length's time scaled by the FLOP model
            # (CPU: tiny shapes, host-bound: as is)
            if arithmetic is not None:
                predicted = (
                    arithmetic["steps_per_arm"] * arithmetic["arm_weight"] * arithmetic["per_seq_step_s"][str(seq)]
                )
            else:
                predicted = (
                    0.0
                    if last is None
                    else last[1]
                    * (
                        1.0
                        if not on_gpu
                        else (
                            estimate_step_s(shape, layers[seq], seq, args.est_tflops, args.est_attn_tflops, True)
                            / estimate_step_s(
                                shape, layers[last[0]], last[0], args.est_tflops, args.est_attn_tflops, True
                            )
                        )
                    )
                )
            if (last is not None or arithmetic is not None) and now + predicted > deadline - reserve:
                msg = (
                    f"seq {seq} skipped: predicted {predicted:.0f} s would end past --budget-s {args.budget_s:g} "
                    f"(less {reserve:.0f} s kept for the max-sequence search)"
                )
                report["results"].append({"seq_len": seq, "layers": layers[seq], "skipped": msg})
                report["skipped"].append(msg)
                print(f"long_context: {msg}")
                continue
            t_seq = time.perf_counter()
            res, st = run_length(seq, layers[seq], args, device, dtype, report, deadline - reserve)
            status |= st
            res["elapsed_s"] = time.perf_counter() - t_seq
            report["results"].append(res)
            last = (seq, res["elapsed_s"])
            _print_length(res)
            report["elapsed_s"] = time.perf_counter() - t_start
            if args.out:
                write_outputs(report, args.out)  # after every length: a timeout keeps what was measured
        deepest = max(layers.values())
        seq0 = min(s for s in args.seq_lens if layers[s] == deepest)
        report["max_seq"] = (
            max_seq_search(args, device, dtype, deepest, seq0, deadline)
            if args.caps_gb
            else {"status": "skipped: --caps-gb is empty"}
        )
        if report["max_seq"].get("status"):
            print(f"long_context: max sequence: {report['max_seq']['status']}")
        if not on_gpu and set(PER_TOKEN_ARMS) <= set(args.arms):
            report["per_token"] = per_token_table(args)
            _print_per_token(report["per_token"])
        report["elapsed_s"] = time.perf_counter() - t_start
        if args.out:
            write_outputs(report, args.out)
            print(f"long_context: wrote long_context.json, long_context.md, {report['plot']} to {args.out}")
        print(f"long_context: done in {report['elapsed_s']:.1f} s (budget {args.budget_s:g} s), exit status {status}")
    finally:
        torch.set_num_threads(old_threads)
    return status


def run_per_token(args) -> int:
    """``--per-token``: the memory-per-token table alone, written as ``long_context_per_token_cpu``."""
    torch.set_num_threads(1)
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),  # noqa: UP017
        "mode": "cpu",
        "torch_version": torch.__version__,
        "build_info": co.build_info(),
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "command": "python3 benchmarks/long_context.py " + " ".join(sys.argv[1:]),
        "args": vars(args),
    }
    report["per_token"] = pt = per_token_table(args)
    _print_per_token(pt)
    failed = [n for n, r in pt["arms"].items() if r.get("status") != "ok"]
    if args.out:
        md = [
            "# Long-context memory per token (CPU-measured, 8B-class proportions)",
            "",
            f"CPU numbers: {report['date']}, torch {report['torch_version']}, `{report['command']}`.",
            "",
        ]
        md += format_per_token(pt)
        save_report(args.out, "long_context_per_token_cpu", report, "\n".join(md) + "\n")
        print(f"long_context: wrote long_context_per_token_cpu.json and .md to {args.out}")
    return 1 if failed else 0


def _print_per_token(pt: dict) -> None:
    print(f"long_context: memory per token ({pt['method']}), {pt['elapsed_s']:.0f} s")
    for name, r in pt["arms"].items():
        if r.get("status") != "ok":
            print(f"  {name:<34} {r.get('status')}")
            continue
        row = pt["prediction"]["arms"].get(name, {})
        caps = "  ".join(
            f"{c}GB {cell['max_seq']:>9,} ({(cell['ratio_to_checkpoint'] or 0):.2f}x)"
            f"{' disk' if cell['disk_tier'] else ''}"
            for c, cell in row.get("caps", {}).items()
        )
        print(
            f"  {name:<34} {r['bytes_per_token']:>10,.0f} B/token = {r['widths_per_token']:6.2f} widths  "
            f"(fit residual {r['fit_max_residual']:.1e})  8B-class: {caps}"
        )


def _print_length(res: dict) -> None:
    print(
        f"seq {res['seq_len']} · {res['layers']} layers · {res.get('rounds_done')} rounds · theory "
        f"{_gib(res['theory_resident_bytes'])}"
    )
    for name, r in res["arms"].items():
        if r.get("status") != "ok":
            print(f"  {name:<22} {r.get('status')}")
            continue
        g = r.get("grads") or {}
        print(
            f"  {name:<22} {_ms(r.get('median_s')):>9} ms ({_ms(r.get('min_s'))}-{_ms(r.get('max_s'))})  "
            f"x ckpt {_ratio(r.get('ratio_to_checkpoint'), r.get('noise_floor'))}  "
            f"x {r.get('baseline') or '-'} {_ratio(r.get('ratio_to_baseline'), r.get('noise_floor'))}  "
            f"peak {_gib(r.get('peak_bytes'))}  moved {_gib(r.get('bytes_moved_d2h'))}  "
            f"grads {'reference' if g.get('note') else ('=' if g.get('bit_identical') else g.get('ok'))}"
        )


if __name__ == "__main__":
    sys.exit(main())
