"""Which functions a tiled call must refuse: modules whose output at one position depends on other
positions (attention, recurrence, convolution, batch or group statistics), by class and by name;
and the module behind a function (itself, a bound method's, a partial's)."""

from __future__ import annotations

import torch

__all__ = ["mixing_reason"]


# Modules whose output at one position depends on other positions. A tiled call of them would be
# wrong, not just inexact.
def _mixing_types() -> tuple:
    types = [
        torch.nn.MultiheadAttention,
        torch.nn.RNNBase,
        torch.nn.Transformer,
        torch.nn.TransformerEncoderLayer,
        torch.nn.TransformerDecoderLayer,
        torch.nn.TransformerEncoder,
        torch.nn.TransformerDecoder,
        torch.nn.modules.conv._ConvNd,
        torch.nn.modules.batchnorm._NormBase,
        torch.nn.GroupNorm,
        torch.nn.modules.pooling._MaxPoolNd,
        torch.nn.modules.pooling._AvgPoolNd,
    ]
    return tuple(types)


_MIXING_TYPES = _mixing_types()
# Words in a module's class or attribute name that say it mixes tokens (Hugging Face's
# LlamaAttention / self_attn, GPT-2's attn, state-space mixers, recurrent cells).
_MIXING_WORDS = ("attn", "attention", "rnn", "lstm", "gru", "mamba", "ssm", "mixer", "conv")
# Hugging Face's Conv1D (GPT-2) is a Linear with its weight transposed: token-wise.
_TOKEN_WISE_CLASS_NAMES = ("Conv1D",)


def mixing_reason(module: torch.nn.Module) -> str | None:
    """Why ``module`` looks like it mixes tokens (attention, recurrence, convolution, batch or group
    statistics), or None. A module found here is refused by :func:`tiled` and ``co.tile``; anything
    else is taken on the caller's word (``token_wise=True`` skips this check).

    Example::

        mixing_reason(torch.nn.MultiheadAttention(64, 4))   # "it is a MultiheadAttention ..."
        mixing_reason(torch.nn.Linear(64, 64))              # None
    """
    for name, sub in module.named_modules():
        cls = type(sub).__name__
        where = f"its submodule {name!r} ({cls})" if name else f"it is a {cls}"
        if cls in _TOKEN_WISE_CLASS_NAMES:
            continue
        if isinstance(sub, _MIXING_TYPES):
            return f"{where}, which combines several positions of the sequence"
        last = name.rsplit(".", 1)[-1].lower()
        words = [w for w in _MIXING_WORDS if w in cls.lower() or w in last]
        if words:
            return f"{where} is named like a token-mixing module ({words[0]!r})"
    return None


def _owner_module(function):
    """The nn.Module behind ``function``: itself, the module of a bound method, or of a partial."""
    import functools

    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, torch.nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None
