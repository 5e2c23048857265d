"""Recompute (gradient checkpointing) with the checkpoint's inputs optionally offloaded.

``co.checkpoint`` is a drop-in for ``torch.utils.checkpoint.checkpoint`` (non-reentrant). With
``offload=...`` the tensors the checkpoint keeps for backward -- its inputs, including those
passed by keyword or inside lists, tuples and dicts, which torch's checkpoint keeps on the
device -- wait in the host pool instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ckpt_offload._args import check_int, closest
from ckpt_offload._checkpoint_core import (
    OFFLOAD_KEYS,
    TORCH_KEYWORDS,
    check_checkpoint_keywords,
    check_reentrant,
    offload_options,
    StatsCollector,
    run_checkpoint,
)
from ckpt_offload.offload import check_offloads_something, logger, warn_at_user_line

__all__ = ["checkpoint", "checkpoint_sequential", "apply", "CheckpointHandle", "offload_options"]


def checkpoint(function: Callable, *args: Any, offload=False, use_reentrant: bool | None = None, **kwargs: Any):
    """Runs ``function(*args, **kwargs)`` without keeping its activations; backward recomputes them.

    A drop-in for ``torch.utils.checkpoint.checkpoint`` with non-reentrant semantics: it accepts
    and honours ``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug`` and
    ``early_stop`` (where the installed torch has them); every other keyword goes to
    ``function``. Gradients equal those without checkpointing, dropout included (the RNG state
    is restored for the recompute). With ``offload`` and a selective-checkpoint ``context_fn``,
    the tensors its policy saves go to the host pool too: ``respect_saved_tensors_hooks=True``
    is passed where torch has it, unless you pass that keyword yourself.

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
    if options is not None:
        check_offloads_something(options.get("devices"), "co.checkpoint(offload=...)")
    torch_kwargs = {k: kwargs.pop(k) for k in TORCH_KEYWORDS if k in kwargs}
    if kwargs:
        _check_function_keywords(function, kwargs)
    return run_checkpoint(function, args, kwargs, options, check_reentrant(use_reentrant, options), torch_kwargs)


_OUR_KEYWORDS = ("offload", "use_reentrant", *TORCH_KEYWORDS)


def _named_parameters(function) -> set | None:
    """The keyword names ``function`` declares (a module: its forward's), or None when its
    signature cannot be read (a builtin)."""
    import inspect

    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_function_keywords(function, kwargs: dict) -> None:
    """co.checkpoint passes unknown keywords on to ``function``; one that ``function`` does not
    declare and that looks like a keyword of co.checkpoint (a typo: ``offlaod=True``) or is a
    co.offload option is far more likely a mistake than an argument for ``function`` (silently
    passed on it would turn offload off, or fail inside the function with an unrelated error)."""
    suspects = {k: closest(k, _OUR_KEYWORDS) for k in kwargs if k in OFFLOAD_KEYS or closest(k, _OUR_KEYWORDS)}
    if not suspects:
        return
    declared = _named_parameters(function)
    for k, near in suspects.items():
        if declared is not None and k in declared:
            continue
        name = getattr(function, "__name__", type(function).__name__)
        if k in OFFLOAD_KEYS:
            raise TypeError(
                f"co.checkpoint: {k}= is a co.offload option, which {name} does not take; pass it inside "
                f"offload={{...}}, e.g. co.checkpoint(f, x, offload={{{k!r}: ...}})"
            )
        raise TypeError(
            f"co.checkpoint: unknown keyword {k}= (did you mean {near}=?). {name} does not declare it, so "
            f"it would be passed on to {name}. co.checkpoint's own keywords: {', '.join(_OUR_KEYWORDS)}. "
            f"To pass {k}= to the function, declare it in its signature or bind it with functools.partial."
        )


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
        self._collector = StatsCollector()

    def stats(self) -> dict:
        """What offload did in this handle's checkpoints, and only theirs: the keys of
        :meth:`ckpt_offload.offload.stats` summed over the contexts they used (the handle's own:
        another model wrapped with equal options counts apart; peaks: the largest),
        ``pool_peak_bytes`` (the most bytes in use in the pool, read at each pack and unpack of
        these checkpoints' inputs, since the last :meth:`reset_stats`) and ``device_saved_peak_bytes``
        (the most bytes of saved activations held on the device at once -- kept, reloaded,
        prefetched -- as co.profile() reports it, sampled at each pack and unpack of these
        checkpoints' inputs; see Note [Handle device peak] in ``_checkpoint_core.py``). All
        zeros without ``offload``.

        Example::

            handle = co.apply(model, offload=True)
            model(x).sum().backward()
            print(handle.stats()["bytes_offloaded"], handle.stats()["kept_by_reason"])
            print(handle.stats()["device_saved_peak_bytes"])    # the device's peak of saved bytes
        """
        return self._collector.stats()

    def reset_stats(self) -> None:
        """Counts from zero again, the device peak included (see :meth:`stats`)."""
        self._collector.reset()

    def remove(self) -> None:
        """Restores every wrapped block's own ``forward``. Calling it twice is harmless."""
        if self.removed:
            return
        for block in self._blocks:
            _CheckpointedForward.uninstall(block)
        if getattr(self._model, "_ckpt_offload_handle", None) is self:
            del self._model._ckpt_offload_handle
        self.removed = True

    def __repr__(self) -> str:
        return f"CheckpointHandle({len(self.names)} blocks, every_n_layers={self.every_n_layers}, removed={self.removed})"


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
class _CheckpointedForward:
    """The ``forward`` that :func:`apply` sets on a block (in its ``__dict__``).

    Holds the block as an attribute instead of capturing it in a closure: ``copy.deepcopy`` of
    the model copies this object with the block it belongs to, so a copy computes with its own
    weights; ``pickle`` / ``torch.save`` store it by class name (module-level, no locals).
    """

    def __init__(self, block: torch.nn.Module, options, use_reentrant: bool, torch_kwargs: dict, original=None):
        self.block = block
        # An instance-level forward the block had before (None: the class's, looked up at call
        # time, so the copy's class method is bound to the copy).
        self.original = original if original is not None else block.__dict__.get("forward")
        self.options = options
        self.use_reentrant = use_reentrant
        self.torch_kwargs = torch_kwargs
        self.collector = None  # the handle's StatsCollector, set by apply()

    def install(self) -> None:
        block = self.block
        block.__dict__["forward"] = self
        block.__dict__["_ckpt_offload_wrapped"] = True
        # nn.DataParallel replicates a module with a shallow copy of its __dict__, which would
        # leave the replica's forward pointing at the original block: give the replica its own.
        block.__dict__["_replicate_for_data_parallel"] = _ReplicateWithForward(self)

    @staticmethod
    def uninstall(block: torch.nn.Module) -> None:
        wrapper = block.__dict__.get("forward")
        if isinstance(wrapper, _CheckpointedForward) and wrapper.original is not None:
            block.__dict__["forward"] = wrapper.original
        else:
            block.__dict__.pop("forward", None)
        block.__dict__.pop("_ckpt_offload_wrapped", None)
        block.__dict__.pop("_replicate_for_data_parallel", None)

    def _forward(self):
        if self.original is not None:
            return self.original
        return type(self.block).forward.__get__(self.block)

    def __call__(self, *args, **kwargs):
        forward = self._forward()
        if self.block.training and torch.is_grad_enabled():
            return run_checkpoint(forward, args, kwargs, self.options, self.use_reentrant, self.torch_kwargs,
                                  self.collector)
        return forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<ckpt_offload checkpointed forward of {type(self.block).__name__}, offload={self.options!r}>"


class _ReplicateWithForward:
    """``block._replicate_for_data_parallel()`` that re-targets the replica's checkpointed forward."""

    def __init__(self, wrapper: _CheckpointedForward):
        self.wrapper = wrapper

    def __call__(self):
        w = self.wrapper
        replica = type(w.block)._replicate_for_data_parallel(w.block)
        replica.__dict__.pop("forward", None)  # the shallow copy's: the original block's wrapper
        _CheckpointedForward(replica, w.options, w.use_reentrant, w.torch_kwargs, w.original).install()
        return replica


def _is_expert_list(name: str) -> bool:
    """A mixture-of-experts list: its members run for some tokens each, not one after another,
    so they are never "the blocks" (checkpointing them would recompute per expert)."""
    last = name.rsplit(".", 1)[-1].lower()
    return "expert" in last


def _largest_block_list(model: torch.nn.Module):
    """The list of same-class blocks (2 or more) holding the most of the model's parameters;
    warns when another list holds nearly as many (say which, and how to pass layers=)."""
    candidates = []  # (params, count, name, blocks)
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or _is_expert_list(name):
            continue
        children = list(mod.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        prefix = f"{name}." if name else ""
        candidates.append((size, len(children), name, [(prefix + n, c) for n, c in children]))
    if not candidates:
        return []
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    best = candidates[0]
    for other in candidates[1:]:
        nested = best[2] == "" or other[2].startswith(best[2] + ".") or best[2].startswith(other[2] + ".")
        if not nested and best[0] > 0 and other[0] >= 0.8 * best[0]:
            block = type(best[3][0][1]).__name__
            warn_at_user_line(
                f"co.apply: two lists of blocks hold a similar share of the parameters: {best[2] or '<model>'!r} "
                f"({best[1]} x {block}, {best[0]} parameters, chosen) and {other[2]!r} ({other[1]} x "
                f"{type(other[3][0][1]).__name__}, {other[0]} parameters). Pass layers= to choose, e.g. "
                f"co.apply(model, layers={block}) or layers=lambda name, m: name.startswith({best[2] + '.'!r}).",
                key="co.apply-ambiguous",
            )
            break
    logger.info("co.apply: checkpointing %d x %s in %r", best[1], type(best[3][0][1]).__name__, best[2])
    return best[3]


def _select_blocks(model: torch.nn.Module, layers):
    if layers is None:
        found = _largest_block_list(model)
        what = "list of identical blocks (an nn.ModuleList or nn.Sequential of 2 or more modules of one class)"
    elif isinstance(layers, type) and issubclass(layers, torch.nn.Module):
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, layers) and m is not model]
        what = f"submodule of class {layers.__name__}"
    elif isinstance(layers, type):
        # A class is callable, but calling it as a predicate would fail with an unrelated error.
        raise TypeError(
            f"layers is the class {layers.__name__}, which is not an nn.Module subclass; pass None, "
            "an nn.Module subclass (the block class), or a predicate layers(name, module) -> bool"
        )
    elif callable(layers):
        found = [(n, m) for n, m in model.named_modules() if m is not model and layers(n, m)]
        what = "submodule for which layers(name, module) is true"
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
        layers: which blocks: ``None`` finds the ``nn.ModuleList``/``nn.Sequential`` of blocks
            of one class (2 or more) holding the most parameters -- never a mixture-of-experts
            list (a name with "expert") -- and warns when another list holds nearly as many; a module class selects every submodule of it; a predicate
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
    options = offload_options(offload)
    check_checkpoint_keywords(checkpoint_kwargs, "co.apply")
    use_reentrant = check_reentrant(checkpoint_kwargs.pop("use_reentrant", None), options)
    if options is not None:
        check_offloads_something(options.get("devices"), "co.apply(offload=...)")
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

    handle = CheckpointHandle(model, [b for _, b in chosen], [n for n, _ in chosen], every_n_layers)
    for _, block in chosen:
        wrapper = _CheckpointedForward(block, options, use_reentrant, checkpoint_kwargs)
        wrapper.collector = handle._collector
        wrapper.install()
    model._ckpt_offload_handle = handle
    return handle
