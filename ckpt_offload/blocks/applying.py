"""``co.apply``: checkpoint a model's repeated blocks -- every ``every_n_layers``-th one, or in
segments -- with their inputs optionally offloaded and their MLPs optionally tiled."""

from __future__ import annotations

import math

import torch

from ckpt_offload._args import check_int
from ckpt_offload._units import Unit
from ckpt_offload.blocks.handle import check_not_applied
from ckpt_offload.blocks.install import install_units
from ckpt_offload.blocks.select import select_blocks
from ckpt_offload.checkpointing import check_checkpoint_keywords, check_reentrant
from ckpt_offload.options import as_options, check_offloads_something
from ckpt_offload.tile_model import as_tile_options, tile_blocks

__all__ = ["apply"]


# Note [The last block's input]
# Every checkpointed block's input goes to the host pool, the last one's too, although backward
# needs it first (prefetch starts after the first unpack, so its reload is always on demand: one
# stall of one input's bytes over the host link per step, ~5 ms for 256 MiB at 55 GB/s, about
# 0.1-0.2% of such a model's step). DeepSpeed keeps it on the device (keep_last_count=1). Here
# co.checkpoint cannot tell which call is a step's last (only deferring every input's copy to the
# next call could, holding each input a block longer), and co.apply could (its last block) at the
# cost of one input's device bytes from that block's forward through the loss, where the logits
# often set the peak. Not measured on a GPU against that cost yet, so the default stays, and the
# memory formula in docs/api.md holds exactly. See docs/api.md, "The last block's input".
def apply(
    model: torch.nn.Module,
    layers=None,
    every_n_layers: int = 1,
    offload=False,
    segments=None,
    tile=None,
    **checkpoint_kwargs,
):
    """Checkpoints the repeated blocks of ``model``: block ``i`` recomputes in backward when
    ``i % every_n_layers == 0`` (Hugging Face's rule), optionally with its inputs offloaded.

    Args:
        model: any ``nn.Module``.
        layers: which blocks: ``None`` finds the ``nn.ModuleList``/``nn.Sequential`` of blocks
            of one class (2 or more) holding the most parameters -- never a mixture-of-experts
            list (a name with "expert") -- and warns when another list holds nearly as many; a
            module class selects every submodule of it; a predicate ``layers(name, module) -> bool``
            selects what it accepts (outermost matches only).
        every_n_layers: checkpoint one block in ``every_n_layers`` (>= 1), starting with the first.
        offload: as in :func:`~ckpt_offload.checkpoint`.
        segments: ``None`` (default) checkpoints blocks one by one; ``"sqrt"`` (Chen et al.) or an
            int k groups the n blocks into about sqrt(n) (or k) runs of consecutive blocks, each
            checkpointed as one (only its first input is kept), through the planner's segments
            (blocks must be chained through their first argument). Not with ``every_n_layers`` or
            checkpoint keywords.
        tile: ``None`` (default) or a :class:`~ckpt_offload.TileOptions` (``True``, an int of
            positions per tile, a size string, a dict of its fields): every block's MLP found by
            structure (a child named ``mlp``/``feed_forward``/``ffn`` or whose class is named like an
            MLP) and its norms run as :func:`ckpt_offload.tiled` along the sequence, and a Hugging
            Face causal LM's head is fused with its loss (docs/api.md, "Sequence-tiled recompute").
        **checkpoint_kwargs: ``use_reentrant``, ``preserve_rng_state``, ``context_fn``,
            ``determinism_check``, ``debug``, ``early_stop``.

    The blocks' parameters and ``state_dict()`` keys do not change: only the blocks' ``forward``
    is wrapped, and the wrapper checkpoints only in training mode with gradients enabled (in
    ``eval()`` or under ``torch.no_grad()`` it calls the block directly). The wrapped model can
    be deep-copied, pickled, ``torch.save``-d and replicated by ``nn.DataParallel``: each copy
    checkpoints its own blocks, with its own weights.

    Returns:
        a :class:`CheckpointHandle`; ``handle.remove()`` restores the model.

    Example::

        handle = co.apply(model, every_n_layers=2, offload=True)
        loss = model(x).sum(); loss.backward()
        handle.remove()
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_int("every_n_layers", every_n_layers, minimum=1)
    options = as_options(offload)
    tiles = as_tile_options(tile)
    check_checkpoint_keywords(
        checkpoint_kwargs, "co.apply", own=("layers", "every_n_layers", "offload", "segments", "tile")
    )
    use_reentrant = check_reentrant(checkpoint_kwargs.pop("use_reentrant", None), options)
    if options is not None:
        check_offloads_something(options.devices, "co.apply(offload=...)")
    check_not_applied(model)
    kind = "recompute" if options is None else "recompute_offload"
    if segments is not None:
        if every_n_layers != 1 or checkpoint_kwargs or use_reentrant:
            raise ValueError("segments= cannot be combined with every_n_layers, use_reentrant or checkpoint keywords")
        named = select_blocks(model, layers)
        units = [Unit(s, e, kind) for s, e in _segment_units(len(named), segments)]
        return _with_tiles(install_units(model, named, units, options, route="co.apply"), model, named, tiles)
    named = select_blocks(model, layers)
    units = [Unit(i, i, kind if i % every_n_layers == 0 else "keep") for i in range(len(named))]
    # co.apply's checkpoints are co.checkpoint's (no profiler range of the planner's).
    handle = install_units(
        model,
        named,
        units,
        options,
        every_n_layers=every_n_layers,
        use_reentrant=use_reentrant,
        torch_kwargs=checkpoint_kwargs,
        ranged=False,
        route="co.apply",
    )
    return _with_tiles(handle, model, named, tiles)


def _segment_units(n: int, segments) -> list:
    """``co.apply(segments=...)``: ``"sqrt"`` -> round(sqrt(n)) runs of consecutive blocks (Chen et
    al.), an int k -> exactly k runs; as (start, end) pairs.

    Example::

        _segment_units(9, 6)   # [(0, 1), (2, 3), (4, 5), (6, 6), (7, 7), (8, 8)]
    """
    if segments == "sqrt":
        k = max(1, round(math.sqrt(n)))
    elif isinstance(segments, str):
        raise ValueError(f"segments must be 'sqrt', an int >= 1 or None, got {segments!r}")
    else:
        k = check_int("segments", segments, minimum=1)
        if k > n:
            raise ValueError(f"segments ({k}) cannot exceed the number of blocks ({n})")
    # k runs whose lengths differ by at most one, the longer ones first (a ceil(n / k) step would
    # give fewer than k runs: 9 blocks in 6 segments would be 5 runs of 2, 2, 2, 2, 1).
    out, start = [], 0
    for i in range(k):
        length = n // k + (1 if i < n % k else 0)
        out.append((start, start + length - 1))
        start += length
    return out


def _with_tiles(handle, model, named, tiles, route="co.apply"):
    """``handle`` with ``tile=``'s parts tiled (``handle.tiles``); removed again if that fails."""
    if tiles is None:
        return handle
    try:
        handle.tiles = tile_blocks(model, named, tiles, route)
    except BaseException:
        handle.remove()
        raise
    return handle
