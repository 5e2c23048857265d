"""The offload of a checkpoint's inputs inside a ``torch.compile(fullgraph=True)`` graph.

Note [Offload inside a compiled graph] (csrc/torch/compile_ops.cpp) says how the copies run. Here:
the two ``torch.library`` ops, ``ckpt_offload::to_host`` (a CPU tensor whose storage is a block of
ckpt_offload's pool) and ``ckpt_offload::to_device`` (a device tensor with its values again), with
fake kernels so that Dynamo, AOTAutograd and Inductor place them like any op; and
:func:`traced_checkpoint`, the checkpoint a wrapped block runs while Dynamo traces it with
``fullgraph=True``:

    h = to_host(x)                       # outside the checkpointed region: AOTAutograd saves h
    checkpoint(region, x, h)             # torch's checkpoint, traced as a higher-order op
    region(x, h): x' = attach(x, to_device(h)); return block(x')

The region's recompute in backward starts with ``to_device(h)``: the input comes back from the
pool there, and nothing saved for backward holds ``x`` (``attach`` returns ``to_device``'s values
and hands the gradient to ``x``; it never reads ``x``).
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_offload._runtime import _C

__all__ = ["pool_key", "prepare", "to_device", "to_host", "traced_checkpoint", "untraced_reason"]

# The ops name their pool by a number (an op's arguments are tensors and plain values): each pool
# gets one the first time a compiled graph offloads into it. The graph holds the number, not the
# pool: a pool the user drops is freed as before (a graph that still names it raises).
_keys = itertools.count(1)
_lock = threading.Lock()
_pools: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_KEY_ATTR = "_ckpt_offload_compile_key"


def pool_key(pool) -> int:
    """The number the ops know ``pool`` (a :class:`~ckpt_offload.HostPool`) by."""
    with _lock:
        key = pool.__dict__.get(_KEY_ATTR)
        if key is None:
            key = pool.__dict__[_KEY_ATTR] = next(_keys)
            _pools[key] = pool
        return key


def prepare(options) -> None:
    """Numbers the pool ``options`` offload into (the default pool: made now) before any trace:
    :func:`traced_checkpoint` only reads the number (Dynamo traces no lock)."""
    if options is None:
        return
    from ckpt_offload.pool import default_pool

    pool_key(options.pool if options.pool is not None else default_pool())


def _traced_key(options):
    """The number of the pool ``options`` offload into, read while Dynamo traces (guarded like
    any attribute read); None when :func:`prepare` has not numbered it."""
    from ckpt_offload import pool as pool_module

    pool = options.pool if options.pool is not None else pool_module._default_pool
    return None if pool is None else pool.__dict__.get(_KEY_ATTR)


def _pool(key: int):
    pool = _pools.get(key)
    if pool is None:
        raise RuntimeError(
            f"ckpt_offload::to_host: the pool this compiled graph offloads into (number {key}) no longer "
            "exists; keep the HostPool given in offload={'pool': ...} alive as long as the compiled model runs"
        )
    return pool


# Note [Span copies in a compiled graph] (csrc/torch/compile_ops.cpp): both ops keep the strides
# of their input, so a compiler must hand them their inputs with exactly the strides traced (an
# expanded input expanded, not made dense): torch 2.14's default for custom ops, asked for by
# name where this torch has the tag.
_EXACT_STRIDES = {}
if "tags" in inspect.signature(torch.library.custom_op).parameters and hasattr(torch.Tag, "needs_exact_strides"):
    _EXACT_STRIDES = {"tags": (torch.Tag.needs_exact_strides,)}


@torch.library.custom_op("ckpt_offload::to_host", mutates_args=(), device_types=("cpu", "cuda"), **_EXACT_STRIDES)
def to_host(x: torch.Tensor, pool: int, side_stream: bool) -> torch.Tensor:
    """A CPU copy of ``x`` in a block of the pool numbered ``pool`` (:func:`pool_key`), with
    ``x``'s sizes and strides over the span of storage ``x`` reaches: an expanded (broadcast)
    tensor takes its source's bytes, as in the eager route. The block goes back to the pool when
    the copy dies. On a GPU the copy is asynchronous (on the side stream with ``side_stream``):
    read it through :func:`to_device`."""
    return _C.compile_to_host(x, _pool(pool)._impl, side_stream)


@to_host.register_fake
def _(x, pool, side_stream):
    return x.new_empty_strided(x.shape, x.stride(), device="cpu")


@torch.library.custom_op("ckpt_offload::to_device", mutates_args=(), device_types=("cpu", "cuda"), **_EXACT_STRIDES)
def to_device(host: torch.Tensor, device: torch.device, side_stream: bool) -> torch.Tensor:
    """``host`` (a :func:`to_host` copy) on ``device`` again, with its sizes and strides, in
    stream order: the copy waits for the offload's, and the current stream waits for the copy."""
    return _C.compile_to_device(host, str(device), side_stream)


@to_device.register_fake
def _(host, device, side_stream):
    return host.new_empty_strided(host.shape, host.stride(), device=device)


class _Attach(torch.autograd.Function):
    """``attach(x, y)``: the values of ``y`` (``x``'s, reloaded), the gradient of ``x``. It never
    reads ``x``, so a recompute of the region does not need ``x``."""

    @staticmethod
    def forward(ctx, x, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _offloads(t: torch.Tensor, options) -> bool:
    if isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
        return False
    if t.device.type not in options.device_types or t.device.type not in ("cpu", "cuda"):
        return False
    return t.numel() * t.element_size() >= options.min_bytes


# Note [Keywords under fullgraph=True]
# torch's checkpoint keywords go to the traced checkpoint as they are, where torch's own checkpoint
# compiles them with fullgraph=True: preserve_rng_state, determinism_check, early_stop, debug=False,
# and context_fn (a selective-checkpoint policy) without offload. The rest cannot be traced
# faithfully, and a checkpoint given one raises under fullgraph=True with a message naming that
# keyword, why, and what to do (untraced_reason) -- never the general "what compiles" message,
# which would tell the user that what they wrote compiles:
# - debug=True: torch's checkpoint itself refuses it in a compiled graph;
# - context_fn with offload: the tensors the policy saves would stay on the device in the graph,
#   where the eager route offloads them too;
# - store_dtype: the traced region computes the forward from the reloaded input (Note [Offload
#   inside a compiled graph]), so a lossy copy would change the forward itself, where the eager
#   route rounds only what the recompute reads;
# - use_reentrant=True: torch's reentrant checkpoint has no traced form.
_TORCH_KEYWORDS_TRACED = frozenset({"preserve_rng_state", "determinism_check", "early_stop", "debug"})
_SELECTIVE_KEYWORDS = frozenset({"context_fn", "respect_saved_tensors_hooks"})

_UNTRACED = "ckpt_offload's checkpoint under torch.compile(fullgraph=True) cannot trace {what}: {why}. {fix}"
_ELSEWHERE = (
    "or compile without fullgraph (the default): each block is then compiled as a graph of its own, "
    "run inside its checkpoint, where {what} applies."
)


def untraced_reason(options, use_reentrant: bool, torch_kwargs: dict) -> str | None:
    """Why a checkpoint with these settings cannot take :func:`traced_checkpoint` -- the keyword,
    why, and what to do (Note [Keywords under fullgraph=True]) -- or None when it can."""
    if use_reentrant:
        return _UNTRACED.format(
            what="use_reentrant=True",
            why="torch's reentrant checkpoint has no traced form",
            fix="Use use_reentrant=False (the default).",
        )
    if torch_kwargs.get("debug"):
        return _UNTRACED.format(
            what="debug=True",
            why="torch's own checkpoint refuses debug=True inside a compiled graph",
            fix="Drop debug (or pass debug=False) under fullgraph=True, " + _ELSEWHERE.format(what="debug=True"),
        )
    extra = sorted(set(torch_kwargs) - _TORCH_KEYWORDS_TRACED - _SELECTIVE_KEYWORDS)
    if extra:
        return _UNTRACED.format(
            what=f"the checkpoint keyword(s) {extra}",
            why="ckpt_offload does not trace them",
            fix="Drop them under fullgraph=True, " + _ELSEWHERE.format(what="they"),
        )
    if options is not None and "context_fn" in torch_kwargs:
        return _UNTRACED.format(
            what="context_fn= (a selective-checkpoint policy) together with offload=",
            why="in a compiled graph the tensors the policy saves would stay on the device, where ckpt_offload "
            "puts them in the pool",
            fix="Drop offload= (torch's selective checkpoint alone traces), "
            + _ELSEWHERE.format(what="the policy's saved tensors are offloaded, as"),
        )
    if options is not None and options.store_dtype is not None:
        return _UNTRACED.format(
            what=f"offload={{'store_dtype': {options.store_dtype}}}",
            why="a traced checkpoint computes the block's forward from its reloaded input, so a lossy copy would "
            "change the forward itself, where store_dtype rounds only what the recompute in backward reads",
            fix="Drop store_dtype under fullgraph=True (the inputs are then stored exactly), "
            + _ELSEWHERE.format(what="store_dtype"),
        )
    if options is not None and _traced_key(options) is None:
        return _UNTRACED.format(
            what="this checkpoint's pool",
            why="it was not numbered for compiled graphs when the blocks were wrapped (in another process?)",
            fix="Wrap the blocks again in this process (handle.remove(), then co.apply).",
        )
    return None


def traced_checkpoint(forward, args, kwargs, options, torch_kwargs: dict):
    """``forward(*args, **kwargs)`` under torch's non-reentrant checkpoint, written for Dynamo to
    trace in one graph; with ``options`` (co.offload options) the tensor inputs they select wait
    in the pool between forward and backward (module docstring)."""
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    tensors = [leaves[i] for i in positions]
    offloaded = [options is not None and _offloads(t, options) for t in tensors]
    if any(offloaded):
        key = _traced_key(options)
        side = options.stream == "side"
    inputs = []
    for t, off in zip(tensors, offloaded):
        inputs.append(t)
        if off:
            inputs.append(torch.ops.ckpt_offload.to_host(t.detach(), key, side))

    def region(*given):
        it = iter(given)
        filled = list(skeleton)
        for i, off in zip(positions, offloaded):
            t = next(it)
            if off:
                back = torch.ops.ckpt_offload.to_device(next(it), t.device, side)
                t = _Attach.apply(t, back) if t.requires_grad else back
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        return forward(*a, **kw)

    return torch_checkpoint.checkpoint(region, *inputs, use_reentrant=False, **torch_kwargs)
