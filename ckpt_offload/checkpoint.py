"""Recompute (gradient checkpointing) with the checkpoint's inputs optionally offloaded.

``co.checkpoint`` is a drop-in for ``torch.utils.checkpoint.checkpoint`` (non-reentrant). With
``offload=...`` the tensors the checkpoint keeps for backward -- its inputs, including those
passed by keyword or inside lists, tuples and dicts, which torch's checkpoint keeps on the
device -- wait in the host pool instead.
"""

from __future__ import annotations

import inspect
import math
import threading
from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_offload._args import check_int
from ckpt_offload.offload import offload as offload_context

__all__ = ["checkpoint", "checkpoint_sequential", "apply", "CheckpointHandle", "offload_options"]

# _checkpoint, _check_reentrant and _TORCH_KEYWORDS are shared with integrations/hf.py.
_OFFLOAD_KEYS = ("min_bytes", "stream", "devices", "pool", "on_full", "prefetch_bytes", "batch_below", "batch_bytes")
# Keywords of torch's checkpoint that this torch has (the rest of **kwargs go to the function).
# preserve_rng_state is one in every torch, but before 2.14 it is read from **kwargs, not named
# in the signature.
_TORCH_KEYWORDS = ("preserve_rng_state",) + tuple(
    name
    for name in ("context_fn", "determinism_check", "debug", "early_stop", "respect_saved_tensors_hooks")
    if name in inspect.signature(torch_checkpoint.checkpoint).parameters
)


def offload_options(offload, *, name: str = "offload") -> dict | None:
    """Normalizes an ``offload=`` argument: False/None -> None, True -> {}, a dict -> checked copy."""
    if offload is None or offload is False:
        return None
    if offload is True:
        return {}
    if isinstance(offload, dict):
        unknown = sorted(set(offload) - set(_OFFLOAD_KEYS))
        if unknown:
            raise TypeError(f"{name}: unknown co.offload option(s) {unknown}; allowed: {list(_OFFLOAD_KEYS)}")
        return dict(offload)
    raise TypeError(
        f"{name} must be False, True, or a dict of co.offload options ({', '.join(_OFFLOAD_KEYS)}); "
        f"got {type(offload).__name__}"
    )


_local = threading.local()


def _context_for(options: dict) -> offload_context:
    """One co.offload context per thread and option set, reused by every checkpoint so that its
    deduplication table spans layers (weakly: it holds no tensor)."""
    cache = getattr(_local, "contexts", None)
    if cache is None:
        cache = _local.contexts = {}
    devices = options.get("devices")
    key = (
        options.get("min_bytes"),
        options.get("stream"),
        tuple(devices) if isinstance(devices, (list, tuple)) else devices,
        id(options.get("pool")),  # the cached context holds the pool, so its id stays unique
        options.get("on_full"),
        options.get("prefetch_bytes"),
        options.get("batch_below"),
        options.get("batch_bytes"),
    )
    ctx = cache.get(key)
    if ctx is None:
        ctx = cache[key] = offload_context(**options)
        ctx._keep_dedup = True
    if ctx._hooks is not None:
        # A checkpoint nested inside another one's forward: the shared context is active.
        ctx = offload_context(**options)
    return ctx


def checkpoint(function: Callable, *args: Any, offload=False, use_reentrant: bool | None = None, **kwargs: Any):
    """Runs ``function(*args, **kwargs)`` without keeping its activations; backward recomputes them.

    A drop-in for ``torch.utils.checkpoint.checkpoint`` with non-reentrant semantics: it accepts
    and honours ``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug`` and
    ``early_stop`` (where the installed torch has them); every other keyword goes to
    ``function``. Gradients equal those without checkpointing, dropout included (the RNG state
    is restored for the recompute).

    Args:
        function: the callable to checkpoint (a module, or a function of tensors).
        offload: ``False`` (default), ``True``, or a dict of :class:`ckpt_offload.offload`
            options (``{"devices": ["cpu"], "min_bytes": 0}``). When on, the tensors the
            checkpoint keeps for backward (its inputs) live in the host pool between forward and
            backward -- also those passed by keyword and inside lists, tuples and dicts. An input
            shared by every layer (a rotary table, a mask) is stored once.
        use_reentrant: ``False`` (default) or ``True`` (torch's reentrant variant, which
            cannot offload: ``offload`` must then be off).

    Example::

        def block(x, *, mask):
            return layer(x, mask)

        y = co.checkpoint(block, x, mask=mask, offload=True)
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    options = offload_options(offload)
    torch_kwargs = {k: kwargs.pop(k) for k in _TORCH_KEYWORDS if k in kwargs}
    return _checkpoint(function, args, kwargs, options, _check_reentrant(use_reentrant, options), torch_kwargs)


def _check_reentrant(use_reentrant, options) -> bool:
    if use_reentrant is None:
        return False
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be True or False, got {use_reentrant!r}")
    if use_reentrant and options is not None:
        raise ValueError(
            "offload needs use_reentrant=False: the reentrant checkpoint keeps its inputs outside "
            "autograd's saved tensors, so they could not be offloaded. Pass use_reentrant=False "
            "(the default of co.checkpoint), or offload=False."
        )
    return use_reentrant


def _checkpoint(function, args, kwargs, options, use_reentrant: bool, torch_kwargs: dict):
    if use_reentrant or options is None:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **torch_kwargs, **kwargs)
    # Every tensor input becomes a positional argument of torch's checkpoint, which saves those
    # through the active saved-tensor hooks (ours). The closure keeps only the non-tensor
    # leaves: a tensor in it would stay on the device until backward.
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    del leaves, args, kwargs

    def run(*inputs):
        filled = list(skeleton)
        for i, t in zip(positions, inputs):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        return function(*a, **kw)

    with _context_for(options):
        return torch_checkpoint.checkpoint(run, *tensors, use_reentrant=False, **torch_kwargs)


def checkpoint_sequential(functions, segments, input, offload=False, use_reentrant: bool | None = None,
                          **kwargs):
    """Like ``torch.utils.checkpoint.checkpoint_sequential``: splits ``functions`` (an
    ``nn.Sequential`` or a list of modules/functions run one after another) into ``segments``
    chunks, checkpoints every chunk but the last, and returns the output. ``segments="sqrt"`` is
    Chen et al.'s rule: round(sqrt(n)) chunks for n functions. ``offload`` and the checkpoint
    keywords are as in :func:`checkpoint`.

    Example::

        out = co.checkpoint_sequential(model.layers, 4, x, offload=True)
        out = co.checkpoint_sequential(model.layers, "sqrt", x)
    """
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    try:
        functions = list(functions)
    except TypeError:
        raise TypeError(f"functions must be an nn.Sequential or a list of callables, got {type(functions).__name__}") \
            from None
    if not functions:
        raise ValueError("functions is empty")
    for i, f in enumerate(functions):
        if not callable(f):
            raise TypeError(f"functions[{i}] is not callable ({type(f).__name__})")
    if segments == "sqrt":
        segments = max(1, round(math.sqrt(len(functions))))
    elif isinstance(segments, str):
        raise ValueError(f"segments must be an int >= 1 or 'sqrt', got {segments!r}")
    check_int("segments", segments, minimum=1)
    if segments > len(functions):
        raise ValueError(f"segments ({segments}) cannot exceed the number of functions ({len(functions)})")

    def run_range(start, end):
        def forward(x):
            for j in range(start, end + 1):
                x = functions[j](x)
            return x

        return forward

    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(run_range(start, end), input, offload=offload, use_reentrant=use_reentrant, **kwargs)
    return run_range(end + 1, len(functions) - 1)(input)




# --- wrapping the repeated blocks of a model -------------------------------------------------


class CheckpointHandle:
    """Returned by :func:`apply`: which blocks are checkpointed, and :meth:`remove` to undo it."""

    def __init__(self, model: torch.nn.Module, blocks: list, names: list, every_n_layers: int):
        self._model = model
        self._blocks = blocks
        self.names = names  #: qualified names of the checkpointed blocks
        self.every_n_layers = every_n_layers
        self.removed = False

    def remove(self) -> None:
        """Restores every wrapped block's own ``forward``. Calling it twice is harmless."""
        if self.removed:
            return
        for block in self._blocks:
            block.__dict__.pop("forward", None)
            block.__dict__.pop("_ckpt_offload_wrapped", None)
        if getattr(self._model, "_ckpt_offload_handle", None) is self:
            del self._model._ckpt_offload_handle
        self.removed = True

    def __repr__(self) -> str:
        return f"CheckpointHandle({len(self.names)} blocks, every_n_layers={self.every_n_layers}, removed={self.removed})"


def _largest_block_list(model: torch.nn.Module):
    best, best_key = None, None
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(mod.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        key = (len(children), size)
        if best_key is None or key > best_key:
            prefix = f"{name}." if name else ""
            best, best_key = [(prefix + n, c) for n, c in children], key
    return best or []


def _select_blocks(model: torch.nn.Module, layers):
    if layers is None:
        found = _largest_block_list(model)
        what = "a list of identical blocks (an nn.ModuleList or nn.Sequential of one class, 2 or more)"
    elif isinstance(layers, type) and issubclass(layers, torch.nn.Module):
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, layers) and m is not model]
        what = f"a submodule of class {layers.__name__}"
    elif callable(layers):
        found = [(n, m) for n, m in model.named_modules() if m is not model and layers(n, m)]
        what = "a submodule for which layers(name, module) is true"
    else:
        raise TypeError(
            "layers must be None, an nn.Module subclass, or a predicate layers(name, module) -> bool; "
            f"got {type(layers).__name__}"
        )
    # A match nested inside another match would be checkpointed twice: keep the outermost.
    outer = []
    for name, mod in found:
        if not any(name.startswith(o + ".") for o, _ in outer):
            outer.append((name, mod))
    if not outer:
        raise ValueError(
            f"co.apply found no {what} in {type(model).__name__}. Pass layers=<the block class> "
            "(for example layers=type(model.layers[0])) or a predicate layers=lambda name, module: ..."
        )
    return outer


def apply(model: torch.nn.Module, layers=None, every_n_layers: int = 1, offload=False, segments=None,
          **checkpoint_kwargs):
    """Checkpoints the repeated blocks of ``model``: block ``i`` recomputes in backward when
    ``i % every_n_layers == 0`` (Hugging Face's rule), optionally with its inputs offloaded.

    Args:
        model: any ``nn.Module``.
        layers: which blocks: ``None`` finds the longest ``nn.ModuleList``/``nn.Sequential`` of
            blocks of one class; a module class selects every submodule of it; a predicate
            ``layers(name, module) -> bool`` selects what it accepts (outermost matches only).
        every_n_layers: checkpoint one block in ``every_n_layers`` (>= 1), starting with the first.
        offload: as in :func:`checkpoint`.
        segments: ``None`` (default) checkpoints blocks one by one; ``"sqrt"`` (Chen et al.) or an
            int k groups the n blocks into about sqrt(n) (or k) runs of consecutive blocks, each
            checkpointed as one (only its first input is kept), through the planner's segments
            (blocks must be chained through their first argument). Not with ``every_n_layers`` or
            checkpoint keywords.
        **checkpoint_kwargs: ``use_reentrant``, ``preserve_rng_state``, ``context_fn``,
            ``determinism_check``, ``debug``, ``early_stop``.

    The blocks' parameters and ``state_dict()`` keys do not change: only the blocks' ``forward``
    is wrapped, and the wrapper checkpoints only in training mode with gradients enabled (in
    ``eval()`` or under ``torch.no_grad()`` it calls the block directly).

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
    options = offload_options(offload)
    use_reentrant = _check_reentrant(checkpoint_kwargs.pop("use_reentrant", None), options)
    unknown = sorted(set(checkpoint_kwargs) - set(_TORCH_KEYWORDS))
    if unknown:
        raise TypeError(
            f"unknown checkpoint keyword(s) {unknown}; allowed: {['use_reentrant', *_TORCH_KEYWORDS]}"
        )
    existing = getattr(model, "_ckpt_offload_handle", None)
    if existing is not None and not existing.removed:
        raise RuntimeError(
            "co.apply or co.hf.enable was already applied to this model; call .remove() on the handle "
            "it returned (model._ckpt_offload_handle.remove()) before applying again"
        )
    if segments is not None:
        if every_n_layers != 1 or checkpoint_kwargs or use_reentrant:
            raise ValueError("segments= cannot be combined with every_n_layers, use_reentrant or checkpoint keywords")
        from ckpt_offload.planner.apply import apply_segments

        return apply_segments(model, _select_blocks(model, layers), segments, options)
    candidates = _select_blocks(model, layers)
    for name, block in candidates:
        if "_ckpt_offload_wrapped" in block.__dict__:
            raise RuntimeError(f"block {name!r} is already wrapped by another co.apply; remove that one first")
    chosen = [(n, b) for i, (n, b) in enumerate(candidates) if i % every_n_layers == 0]

    for _, block in chosen:
        original = block.forward  # the class's forward, bound to this block

        def forward(*args, _original=original, _block=block, **kwargs):
            if _block.training and torch.is_grad_enabled():
                return _checkpoint(_original, args, kwargs, options, use_reentrant, checkpoint_kwargs)
            return _original(*args, **kwargs)

        block.forward = forward
        block._ckpt_offload_wrapped = True
    handle = CheckpointHandle(model, [b for _, b in chosen], [n for n, _ in chosen], every_n_layers)
    model._ckpt_offload_handle = handle
    return handle
