"""What ``co.offload(store_dtype=...)`` would store of a measured block: the engine's own rule per
saved tensor (``_C.stored_bytes``), which storages of a :class:`~ckpt_offload.planner.costs.BlockCost`
convert, and which saved tensors share one converted copy. The simulator and the solver read it to
price a plan's lossy units."""

from __future__ import annotations

import functools

import torch

from ckpt_offload._runtime import _C
from ckpt_offload.planner.costs import BlockCost

__all__ = ["converted_inputs", "converted_packs", "converted_shares", "stored_bytes"]


def stored_bytes(dtype_name: str, span: int, store_dtype) -> int | None:
    """The host bytes ``co.offload(store_dtype=store_dtype)`` stores for a saved tensor of dtype
    ``dtype_name`` spanning ``span`` bytes, or None when it stores it exactly (not a floating-point
    dtype wider than the storage): the engine's own rule (``_C.stored_bytes``), fp8's fp32 scale
    included.

    Example::

        stored_bytes("float32", 4096, torch.bfloat16)   # 2048
        stored_bytes("int64", 4096, torch.bfloat16)     # None: exact
    """
    if store_dtype is None:
        return None
    return _engine_stored_bytes(dtype_name, int(span), str(store_dtype).removeprefix("torch."))


@functools.lru_cache(maxsize=1 << 16)
def _engine_stored_bytes(dtype_name: str, span: int, store_format: str) -> int | None:
    # Cached: a plan asks for the same few (dtype, span) pairs at every evaluation of a block.
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return None  # a dtype this torch does not have: nothing the engine would convert
    return _C.stored_bytes(dtype, span, store_format)


def converted_packs(b: BlockCost, store_dtype) -> dict:
    """``{storage index: [(pack position, span bytes, stored bytes), ...]}``: the storages of ``b``
    that ``store_dtype`` converts, one entry per converted copy: the engine converts and copies
    each saved tensor of a converted storage on its own, except one whose span (first byte,
    bytes, dtype, version) is an earlier one's, which shares that copy (:func:`converted_shares`).
    A storage counts only when all its packs convert; one with an exact pack (an integer view) is
    exact. Empty when the costs were measured without dtypes."""
    return _converted(b, store_dtype)[0]


def converted_shares(b: BlockCost, store_dtype) -> dict:
    """``{pack position: the position whose converted copy it shares}`` for the packs of ``b``
    that :func:`converted_packs` leaves out: saved tensors of exactly an earlier one's span."""
    return _converted(b, store_dtype)[1]


def _converted(b: BlockCost, store_dtype):
    if store_dtype is None or len(b.pack_dtypes) != len(b.packs) or len(b.pack_spans) != len(b.packs):
        return {}, {}
    cache = b.__dict__.setdefault("_converted", {})
    if store_dtype in cache:
        return cache[store_dtype]
    starts = b.pack_starts if len(b.pack_starts) == len(b.packs) else [None] * len(b.packs)
    out, exact, shares, first = {}, set(), {}, {}
    for pos, si in enumerate(b.packs):
        if si < 0 or si in exact:
            continue
        n = stored_bytes(b.pack_dtypes[pos], b.pack_spans[pos], store_dtype)
        if n is None:
            exact.add(si)
            out.pop(si, None)
            continue
        key = None if starts[pos] is None else (si, tuple(starts[pos]), b.pack_spans[pos], b.pack_dtypes[pos])
        if key is not None and key in first:
            shares[pos] = first[key]
            continue
        if key is not None:
            first[key] = pos
        out.setdefault(si, []).append((pos, b.pack_spans[pos], n))
    shares = {p: q for p, q in shares.items() if b.packs[p] in out}
    cache[store_dtype] = out, shares
    return out, shares


def converted_inputs(b: BlockCost, store_dtype) -> list:
    """Per entry of ``b.input_sizes``: ``(span, stored bytes)`` when ``store_dtype`` converts it, else None."""
    if store_dtype is None or len(b.input_dtypes) != len(b.input_sizes):
        return [None] * len(b.input_sizes)
    out = []
    for name, span in zip(b.input_dtypes, b.input_spans):
        n = stored_bytes(name, span, store_dtype)
        out.append(None if n is None else (span, n))
    return out
