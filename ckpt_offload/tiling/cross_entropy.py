"""``co.tiled_cross_entropy``: the LM head and its cross-entropy one tile of tokens at a time, never
the full logits -- :class:`~ckpt_offload.tiling.wrapper.Tiled` over :class:`_HeadLoss` with its
losses summed over tiles."""

from __future__ import annotations

import torch

from ckpt_offload._args import check_int, suggest_keywords
from ckpt_offload.tiling.mixing import _owner_module
from ckpt_offload.tiling.tiles import _check_tile
from ckpt_offload.tiling.wrapper import Tiled

__all__ = ["tiled_cross_entropy"]

_DEFAULT_HEAD_TILE_BYTES = 256 << 20  # tiled_cross_entropy's default: float32 logits of one tile


_CE_REDUCTIONS = ("mean", "sum", "none")


def _vocab_of(head) -> int | None:
    """The output width of ``head`` when it is a Linear-like module (a 2-D ``weight``), else None."""
    module = _owner_module(head)
    weight = getattr(module, "weight", None) if module is not None else None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(getattr(module, "out_features", weight.shape[0]))
    return None


class _HeadLoss:
    """One tile of :func:`tiled_cross_entropy`: the head's logits (float32) and their cross-entropy
    against the tile's labels. A module-level class, so the wrapper pickles and compiles like any."""

    def __init__(self, head, ignore_index, reduction, upcast, label_smoothing):
        self.head, self.ignore_index, self.reduction = head, ignore_index, reduction
        self.upcast, self.label_smoothing = upcast, label_smoothing

    def __call__(self, hidden, labels):
        logits = self.head(hidden)
        if self.upcast:
            logits = logits.float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


@suggest_keywords("co.tiled_cross_entropy")
def tiled_cross_entropy(
    hidden: torch.Tensor,
    head,
    labels: torch.Tensor,
    *,
    tile=None,
    tiles=None,
    ignore_index: int = -100,
    reduction: str = "mean",
    upcast: bool = True,
    label_smoothing: float = 0.0,
    measure_error: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).float(), labels)`` without the full logits: the tokens are cut
    into tiles, each tile's logits computed, reduced to its loss and dropped; backward recomputes
    each tile's logits and differentiates them (:func:`tiled` with ``reduce="sum"``). The logits of
    one tile are the most that exists at once, in forward and in backward.

    Args:
        hidden: ``(..., hidden)``: the final hidden states (after the final norm, or pass the norm
            inside ``head``).
        head: the LM head: a module (``model.lm_head``) or a callable of the hidden states (e.g.
            ``lambda h: model.lm_head(model.norm(h))``), returning ``(..., vocab)`` logits.
        labels: ``hidden.shape[:-1]`` class indices, already shifted for next-token prediction;
            ``ignore_index`` marks positions without a target.
        tile: tokens per tile (an int), or bytes of one tile's float32 logits (a size string, for a
            head whose vocabulary it can read: a Linear); default 256 MiB of logits (512 tokens at a
            128K vocabulary).
        tiles: how many tiles instead.
        reduction: ``"mean"`` (over the positions whose label is not ``ignore_index``, as torch's),
            ``"sum"`` or ``"none"`` (per position, shaped as ``labels``).
        upcast: compute the loss on float32 logits (default; Hugging Face's causal LM loss does).
        label_smoothing: as ``F.cross_entropy``'s (with ``"mean"``, averaged over every position
            that has a target, as torch averages it).
        measure_error: as :func:`tiled`'s; the wrapper's stats are not returned here: use
            ``co.tiled(...)`` directly to read them.

    Gradients equal the untiled loss's up to the summation order over tiles (the hidden states'
    gradient is computed per tile: the untiled one's wherever a row is computed the same whatever
    the number of rows; the head's weight gradient is summed over tiles in float32).

    Example::

        import ckpt_offload as co

        head = torch.nn.Linear(64, 1000, bias=False)
        hidden = torch.randn(2, 512, 64, requires_grad=True)
        labels = torch.randint(0, 1000, (2, 512))
        loss = co.tiled_cross_entropy(hidden, head, labels, tile=128)   # never a (2, 512, 1000) tensor
        loss.backward()
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise TypeError(f"hidden must be a tensor (..., hidden), got {type(hidden).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a tensor of class indices, got {type(labels).__name__}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have the shape of hidden without its last dimension, "
            f"{tuple(hidden.shape[:-1])}; got {tuple(labels.shape)}"
        )
    if reduction not in _CE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {_CE_REDUCTIONS}, got {reduction!r}")
    check_int("ignore_index", ignore_index)
    if not callable(head):
        raise TypeError(f"head must be a module or a callable returning logits, got {type(head).__name__}")
    tokens, nbytes, count = _check_tile(tile, tiles)
    n = labels.numel()
    flat_h, flat_y = hidden.reshape(n, hidden.shape[-1]), labels.reshape(n)
    if tokens is None and count is None:
        vocab = _vocab_of(head)
        if vocab is None:
            if nbytes is not None:
                raise ValueError(
                    f"tile={tile!r} gives bytes of logits per tile, but the vocabulary of head "
                    f"({type(head).__name__}) cannot be read (it is not a Linear); pass tile= as a token "
                    "count"
                )
            tokens = 1024
        else:
            tokens = max(1, (nbytes or _DEFAULT_HEAD_TILE_BYTES) // (vocab * (4 if upcast else hidden.element_size())))
    per_tile = "none" if reduction == "none" else "sum"
    wrapper = Tiled(
        _HeadLoss(head, ignore_index, per_tile, upcast, label_smoothing),
        tokens,
        tiles=count,
        dim=0,
        split={1: 0},
        reduce=None if reduction == "none" else "sum",
        out_dim=0,
        params=_params_of(head),
        token_wise=True,
        measure_error=measure_error,
        name="co.tiled_cross_entropy",
    )
    if _owner_module(head) is not None:
        wrapper._found = []  # a module: its parameters are known (Note [Parameters a tiled function reads])
    out = wrapper(flat_h, flat_y)
    if reduction == "none":
        return out.reshape(labels.shape)
    if reduction == "sum":
        return out
    return out / (flat_y != ignore_index).sum()


def _params_of(head) -> list:
    module = _owner_module(head)
    return [] if module is None else list(module.parameters())
