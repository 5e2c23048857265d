"""``co.hf.enable``: ckpt_offload's checkpoint as the gradient-checkpointing function of a Hugging
Face model (the package's docstring, :mod:`ckpt_offload.integrations.hf`, says how it plugs in)."""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

try:
    import transformers
except ImportError as e:  # pragma: no cover - explained to the user
    raise ImportError(
        f"co.hf needs Hugging Face transformers ({e}); install it with `pip install transformers`, "
        "or use co.apply(model, ...) for other models."
    ) from e

try:  # recent transformers (4.57 has it): every decoder/encoder layer is one of these
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older transformers: checkpointing lives in the layer stacks
    GradientCheckpointingLayer = None

from ckpt_offload._args import check_int, suggest_keywords
from ckpt_offload._compile import (
    CompiledCall,
    compiled_forward,
    fullgraph_tracing,
    skip_frame_only,
    skipped_by_dynamo,
    watch_for_dynamo,
)
from ckpt_offload._compile import eager as eager_code
from ckpt_offload._compile_ops import prepare as prepare_compiled_offload
from ckpt_offload._compile_ops import traced_checkpoint, untraced_reason
from ckpt_offload._stats import StatsCollector
from ckpt_offload._warn import FULLGRAPH_MESSAGE, graph_break_if_compiling, warn
from ckpt_offload.blocks.handle import HANDLE_ATTR, CheckpointHandle, active_handle, check_not_applied
from ckpt_offload.blocks.select import select_blocks
from ckpt_offload.checkpointing import TORCH_KEYWORDS, check_checkpoint_keywords, check_reentrant, run_checkpoint
from ckpt_offload.integrations.hf import head as _head  # noqa: F401 - registers the fused head of tile=
from ckpt_offload.options import OffloadOptions, as_options, check_offloads_something
from ckpt_offload.tile_model import as_tile_options, tile_blocks

__all__ = ["enable", "disable", "install", "active_handle", "HFCheckpointHandle", "HFCheckpointFunction"]

# New name first: it is the one that does not warn. Feature-detected on each model, not by version.
_ENABLE_NAMES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
_DISABLE_NAMES = ("activation_checkpointing_disable", "gradient_checkpointing_disable")


class HFCheckpointFunction:
    """The callable installed as ``_gradient_checkpointing_func`` on the model's modules.

    Called by Hugging Face as ``f(partial(forward, layer, **kwargs), *args)``; runs
    :func:`ckpt_offload.checkpoint` with the options given to :func:`enable`. ``calls`` counts
    the checkpointed layer calls, so you can check that this function is the one in use.

    Example::

        handle = co.hf.enable(model)
        model(**batch).loss.backward()
        assert handle.function.calls > 0
    """

    def __init__(self, options: OffloadOptions | None, use_reentrant: bool, torch_kwargs: dict):
        self.options = options
        self.use_reentrant = use_reentrant
        self.torch_kwargs = dict(torch_kwargs)
        self.calls = 0
        self.collector = StatsCollector()  # the contexts its checkpoints used, for handle.stats()
        prepare_compiled_offload(options)  # Note [Wrappers under fullgraph=True] (_compile.py)
        watch_for_dynamo()

    @skip_frame_only
    def __call__(self, function, *args, **kwargs):
        if torch.compiler.is_compiling() and fullgraph_tracing():
            # Dynamo traces this under fullgraph=True: Note [Wrappers under fullgraph=True].
            torch_kwargs = dict(self.torch_kwargs)
            for name in TORCH_KEYWORDS:
                if name in kwargs:
                    torch_kwargs[name] = kwargs.pop(name)
            use_reentrant = kwargs.pop("use_reentrant", self.use_reentrant)
            why = untraced_reason(self.options, use_reentrant, torch_kwargs)
            if why is not None:
                graph_break_if_compiling(why)  # fullgraph=True: the error, naming the keyword
            else:
                pargs, pkw = (), {}
                # One level (transformers' partial(super().__call__, **kwargs)); an inner partial
                # is traced as it is. Dynamo in torch 2.11 cannot tell whether a bound super()
                # method is a partial, so a loop would break the graph there.
                if isinstance(function, functools.partial):
                    pargs, pkw = function.args, function.keywords
                    function = function.func
                return traced_checkpoint(function, pargs + args, {**pkw, **kwargs}, self.options, torch_kwargs)
            kwargs = {**kwargs, **torch_kwargs, "use_reentrant": use_reentrant}
        return self._eager_call(function, *args, **kwargs)

    @skipped_by_dynamo(FULLGRAPH_MESSAGE)
    def _eager_call(self, function, *args, **kwargs):
        # Under torch.compile of the model: Dynamo skips this frame, and only the layer's own
        # forward is compiled (Note [Wrappers under torch.compile] in _compile.py).
        with eager_code() as callback:
            return self._call(compiled_forward(function, callback), args, kwargs)

    def _call(self, function, args, kwargs):
        self.calls += 1
        torch_kwargs = dict(self.torch_kwargs)
        for name in TORCH_KEYWORDS:  # a call site may pass torch's keywords as Hugging Face's func allows
            if name in kwargs:
                torch_kwargs[name] = kwargs.pop(name)
        use_reentrant = check_reentrant(kwargs.pop("use_reentrant", self.use_reentrant), self.options)
        if not use_reentrant:
            # The partial's keywords (position_embeddings, attention_mask, position_ids, or the
            # hidden states where a model passes them by keyword) become inputs of the checkpoint:
            # torch's checkpoint then saves and version-checks them (a layer that writes one in
            # place raises torch's in-place error instead of recomputing from the written value),
            # and with offload they wait in the pool. Left in the partial they would stay on the
            # device until backward, unchecked. torch's reentrant checkpoint takes no keywords.
            pargs, pkw = (), {}
            compiled = function if isinstance(function, CompiledCall) else None
            function = compiled.fn if compiled is not None else function
            while isinstance(function, functools.partial):
                pargs = function.args + pargs
                pkw = {**function.keywords, **pkw}
                function = function.func
            if compiled is not None:
                function = CompiledCall(compiled.callback, function)
            args, kwargs = pargs + args, {**pkw, **kwargs}
        return run_checkpoint(function, args, kwargs, self.options, use_reentrant, torch_kwargs, self.collector)

    def __deepcopy__(self, memo):
        # A copied model shares the function: its options may hold a HostPool, which is not copyable.
        return self

    def __repr__(self) -> str:
        return f"HFCheckpointFunction(offload={self.options!r}, use_reentrant={self.use_reentrant}, calls={self.calls})"


class _KeepOurs:
    """Set on the model instance over its enable methods while a handle is active: a later call
    (``Trainer.train()``'s) re-installs ckpt_offload's function instead of replacing it."""

    def __init__(self, handle: "HFCheckpointHandle", name: str):
        self.handle = handle
        self.name = name

    def __call__(self, *args, **kwargs):
        self.handle._follow_offload_request(self.name, args, kwargs)
        self.handle._warn_ignored(self.name, args, kwargs)
        self.handle.reinstall()


class _OnDisable:
    """Set on the model instance over its disable methods while a handle is active: Hugging
    Face's own disable removes the handle too (``handle.removed``), then runs as usual -- or,
    for a Trainer callback's handle, pauses it (Note [Disable pauses a callback's handle])."""

    def __init__(self, handle: "HFCheckpointHandle", name: str):
        self.handle = handle
        self.name = name

    def __call__(self, *args, **kwargs):
        if self.handle._pause_on_disable:
            return self.handle._pause(self.name, args, kwargs)
        self.handle.remove()  # unwraps this method too
        return getattr(self.handle._model, self.name)(*args, **kwargs)


# Note [Disable pauses a callback's handle]
# Trainer subclasses turn checkpointing off around their no-grad passes with the model's own
# methods and back on after: TRL's GRPOTrainer around generation and the old/reference
# log-probabilities (trl.models.utils.unwrap_model_for_generation, disable_gradient_checkpointing),
# its DPOTrainer around the reference forward, each step. Hugging Face's disable removes a
# co.hf.enable handle, so the enable call that follows would put Hugging Face's function back and
# the rest of training would silently run without ckpt_offload. A handle a Trainer callback made
# belongs to the training run, so the disable only pauses it: Hugging Face's own disable runs
# (every layer's flag off: generation uses its KV cache and nothing is checkpointed or offloaded),
# the handle and its method wrappers stay, and the next enable call goes through _KeepOurs, which
# re-installs ckpt_offload's function with the handle's settings. handle.remove() still ends it.


class HFCheckpointHandle(CheckpointHandle):
    """Returned by :func:`enable`: a :class:`ckpt_offload.CheckpointHandle` (``names``,
    ``kinds``, ``every_n_layers``, ``removed``, :meth:`stats`, :meth:`reset_stats`,
    :meth:`remove`) whose layers Hugging Face's enable method selected and whose checkpoints run
    through ``function``, the installed :class:`HFCheckpointFunction`. Also: ``offload`` (the
    co.offload options, or None), ``enable_method`` (the Hugging Face method used).

    Example::

        handle = co.hf.enable(model, offload={"devices": ["cpu"]})
        model(**batch).loss.backward()
        print(handle.names[:2], handle.stats()["bytes_offloaded"])
    """

    def __init__(
        self, model, every_n_layers: int, options, use_reentrant: bool, torch_kwargs: dict, offload_given: bool = True
    ):
        self.function = HFCheckpointFunction(options, use_reentrant, torch_kwargs)
        # Its stats are its function's: the contexts of the checkpoints Hugging Face's layers ran.
        super().__init__(model, [], [], [], every_n_layers, collector=self.function.collector)
        # False when enable() left offload off: a later enable call's offload entry
        # (Trainer.train() passes TrainingArguments' one) then decides; True: ours is kept.
        self._offload_given = offload_given
        self.use_reentrant = use_reentrant
        self.torch_kwargs = dict(torch_kwargs)
        self.enable_method = next(n for n in _ENABLE_NAMES if hasattr(model, n))
        self._saved_state = None  # per-module flags/functions before enable, restored by remove()
        self._input_grads_added = False
        # True for a Trainer callback's handle: Note [Disable pauses a callback's handle].
        self._pause_on_disable = False

    @property
    def kinds(self) -> list:
        """Per checkpointed layer, what it does (as ``co.apply``'s handle names it)."""
        return ["recompute" if self.function.options is None else "recompute_offload"] * len(self.names)

    @property
    def offload(self) -> dict | None:
        """The co.offload options in use (those that differ from the defaults, as a dict; ``{}``
        for the defaults), or None when offload is off. ``handle.function.options`` is the
        :class:`~ckpt_offload.OffloadOptions` itself."""
        options = self.function.options
        return None if options is None else options.to_dict()

    # -- installing ---------------------------------------------------------------------------

    def reinstall(self) -> None:
        """Makes ckpt_offload's function the model's checkpoint function again, with this handle's
        settings (after something, such as a Trainer, called Hugging Face's enable or changed the
        layers' flags). Calling it again changes nothing."""
        model = self._model
        patches = {n: model.__dict__.pop(n) for n in _ENABLE_NAMES if isinstance(model.__dict__.get(n), _KeepOurs)}
        try:
            if self._input_grads_added and hasattr(model, "disable_input_require_grads"):
                # Hugging Face's enable adds the embedding hook again on every call; drop ours first.
                model.disable_input_require_grads()
                self._input_grads_added = False
            had = _input_grads_hooks(model)
            self._call_hf_enable()
            self._input_grads_added = bool(_input_grads_hooks(model) - had)
        finally:
            model.__dict__.update(patches)
        layers = _checkpoint_layers(model)
        selected = [(n, m) for n, m in layers if m.gradient_checkpointing is True]
        if not self._hf_takes_every_n:
            # An enable method without every_n_layers (5.0, 4.57) turned every layer on: Hugging
            # Face's later rule (layer i when i % every_n_layers == 0, in modules() order) is applied here.
            for i, (_, m) in enumerate(selected):
                m.gradient_checkpointing = i % self.every_n_layers == 0
            selected = selected[:: self.every_n_layers]
        if not layers:
            # Before GradientCheckpointingLayer the layer stacks called _gradient_checkpointing_func.
            selected = [(n, m) for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
            if self.every_n_layers != 1 and selected:
                raise ValueError(
                    f"{type(model).__name__} checkpoints per layer stack, not per layer, in this transformers "
                    f"({transformers.__version__}), so every_n_layers={self.every_n_layers} cannot be applied. Pass "
                    "every_n_layers=1, upgrade transformers, or use co.apply(model, layers=<its block class>, ...)."
                )
        if not selected:
            raise ValueError(
                f"{type(model).__name__}'s {self.enable_method}() turned no layer's checkpointing on through "
                "transformers' _gradient_checkpointing_func hook (its _set_gradient_checkpointing is custom), so "
                "ckpt_offload cannot plug in. Use co.apply(model, layers=<its block class>, every_n_layers=..., "
                "offload=...) instead."
            )
        for m in model.modules():
            if hasattr(m, "gradient_checkpointing"):
                m._gradient_checkpointing_func = self.function
        self.names = [n for n, _ in selected]

    def _call_hf_enable(self) -> None:
        model = self._model
        method = getattr(model, self.enable_method)
        params = inspect.signature(method).parameters
        takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._hf_takes_every_n = "every_n_layers" in params or takes_var_kw
        # Hugging Face's own function is replaced right after; these keep its checks quiet.
        hf_kwargs = {"use_reentrant": self.use_reentrant}
        extra = {"every_n_layers": self.every_n_layers} if self._hf_takes_every_n else {}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*deprecated.*", category=FutureWarning)
                method(hf_kwargs, **extra)
        except ValueError as e:
            raise ValueError(
                f"{type(model).__name__}.{self.enable_method}() refused: {e} co.hf.enable needs a model that "
                "supports Hugging Face gradient checkpointing; for any other model use co.apply(model, "
                "layers=<its block class>, every_n_layers=..., offload=...)."
            ) from e

    @staticmethod
    def _ckpt_kwargs_of(args, kwargs):
        """The checkpoint-kwargs dict of a call of the model's enable method (positional or named)."""
        return (
            args[0]
            if args
            else kwargs.get("activation_checkpointing_kwargs", kwargs.get("gradient_checkpointing_kwargs"))
        )

    def _offload_requested(self, args, kwargs):
        """The ``offload`` a call of the model's enable method asks for: its ``offload`` argument
        (transformers 5.24's Trainer pops the entry out of the kwargs dict and passes it so), else
        the dict's ``offload`` entry (Trainers that pass the whole dict); ``_MISSING`` if none."""
        if len(args) > 2:
            return args[2]
        if kwargs.get("offload") is not None:
            return kwargs["offload"]
        ckpt_kwargs = self._ckpt_kwargs_of(args, kwargs)
        if isinstance(ckpt_kwargs, dict) and "offload" in ckpt_kwargs:
            return ckpt_kwargs["offload"]
        return kwargs.get("offload", _MISSING)

    def _follow_offload_request(self, name: str, args, kwargs) -> None:
        """With offload off in :func:`enable`, a later enable call's offload entry (a bool or a
        dict of co.offload options) decides whether the checkpoints offload."""
        if self._offload_given:
            return
        requested = self._offload_requested(args, kwargs)
        if requested is _MISSING:
            return
        where = f"{name}(offload=...) (from TrainingArguments' checkpointing kwargs under Trainer)"
        options = as_options(requested, name=where)
        check_reentrant(self.use_reentrant, options)
        if options is not None and options != self.function.options:
            check_offloads_something(options.devices, where)
        self.function.options = options

    def _warn_ignored(self, name: str, args, kwargs) -> None:
        ckpt_kwargs = self._ckpt_kwargs_of(args, kwargs)
        every_n = args[1] if len(args) > 1 else kwargs.get("every_n_layers", 1)
        offload = self._offload_requested(args, kwargs)
        ignored = []
        if every_n not in (1, self.every_n_layers):
            ignored.append(f"every_n_layers={every_n}")
        if self._offload_given and offload is not _MISSING and offload is not None:
            # Kept: enable() was given offload explicitly. Ignored when the call asks for offload
            # that ours is not (True is satisfied by any options; False is what Trainer passes
            # when its arguments have no entry, so it never warns).
            asked = as_options(offload, name=f"{name}(offload=...)")
            if asked is not None and (self.offload is None or (asked.to_dict() and asked != self.function.options)):
                ignored.append(f"offload={offload!r}")
        ours = {"use_reentrant": self.use_reentrant, **self.torch_kwargs}
        for k, v in (ckpt_kwargs or {}).items():
            if k not in ("every_n_layers", "offload") and ours.get(k, _MISSING) != v:
                ignored.append(f"{k}={v!r}")
        if ignored:
            warn(
                f"{name}() on a model with co.hf.enable active keeps ckpt_offload's checkpoint (every_n_layers="
                f"{self.every_n_layers}, offload={self.offload!r}) and ignores {', '.join(ignored)}. To change "
                "the settings, call handle.remove() and co.hf.enable(...) again.",
                stacklevel=3,
            )

    def _pause(self, name: str, args, kwargs):
        """The model's disable method ``name``, run with this handle kept: Note [Disable pauses a
        callback's handle]. Its wrappers are set aside meanwhile (Hugging Face's disable calls the
        deprecated name when it finds an instance attribute there)."""
        model = self._model
        wrappers = {
            n: model.__dict__.pop(n)
            for n in _ENABLE_NAMES + _DISABLE_NAMES
            if isinstance(model.__dict__.get(n), (_KeepOurs, _OnDisable))
        }
        try:
            return getattr(model, name)(*args, **kwargs)
        finally:
            model.__dict__.update(wrappers)

    # -- removing -----------------------------------------------------------------------------

    def remove(self) -> None:
        """Restores every module's checkpointing flag and function to what it was before
        :func:`enable` (so checkpointing is off again unless it was on before), drops the
        input-gradient hook if enabling added it, and unwraps the model's enable methods.
        Calling it twice is harmless."""
        super().remove()

    def _restore(self) -> None:
        model = self._model
        for n in _ENABLE_NAMES + _DISABLE_NAMES:
            if isinstance(model.__dict__.get(n), (_KeepOurs, _OnDisable)):
                del model.__dict__[n]
        for m, state in self._saved_state:
            for key, value in state.items():
                if value is _MISSING:
                    m.__dict__.pop(key, None)
                else:
                    m.__dict__[key] = value
        if self._input_grads_added and hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()

    def disable(self) -> None:
        """Deprecated alias of :meth:`remove` (goes in 0.3.0)."""
        warnings.warn(
            "handle.disable() is deprecated and goes in 0.3.0: use handle.remove()", DeprecationWarning, stacklevel=2
        )
        self.remove()

    def __repr__(self) -> str:
        return (
            f"HFCheckpointHandle({len(self.names)} layers, every_n_layers={self.every_n_layers}, "
            f"offload={self.offload!r}, removed={self.removed})"
        )


class _Missing:
    """Marks an attribute a module did not have. Copies of a model keep this very object."""

    def __reduce__(self):
        return "_MISSING"

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _input_grads_hooks(model) -> set:
    """The input-gradient hooks Hugging Face's enable_input_require_grads() keeps track of."""
    hooks = list(getattr(model, "_require_grads_hooks", None) or [])
    if getattr(model, "_require_grads_hook", None) is not None:
        hooks.append(model._require_grads_hook)
    return {id(h) for h in hooks}


def _checkpoint_layers(model) -> list:
    if GradientCheckpointingLayer is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]


def _snapshot(model) -> list:
    keys = ("gradient_checkpointing", "_gradient_checkpointing_func")
    return [
        (m, {k: m.__dict__.get(k, _MISSING) for k in keys})
        for m in model.modules()
        if hasattr(m, "gradient_checkpointing")
    ]


def enable(
    model, every_n_layers: int = 1, offload: bool | dict | OffloadOptions | None = False, tile=None, **checkpoint_kwargs
) -> HFCheckpointHandle:
    """Makes :func:`ckpt_offload.checkpoint` the gradient-checkpointing function of a Hugging Face model.

    Calls the model's own ``activation_checkpointing_enable`` (or, where that does not exist,
    ``gradient_checkpointing_enable``): Hugging Face selects the layers, applies
    ``every_n_layers`` (layer ``i`` when ``i % every_n_layers == 0``; done here for transformers
    releases whose method lacks the argument) and enables input gradients when it would. Then
    every module with a ``gradient_checkpointing`` flag gets ckpt_offload's function. While the
    handle is active, a later call of the model's enable method (``Trainer.train()`` makes one)
    keeps ckpt_offload's function and these settings -- except ``offload`` when it is off
    here: the call's ``offload`` (TrainingArguments' entry) is then used.

    Args:
        model: a ``transformers.PreTrainedModel`` (or anything with Hugging Face's enable method)
            whose class supports gradient checkpointing through ``_gradient_checkpointing_func``.
        every_n_layers: checkpoint one layer in ``every_n_layers`` (>= 1), starting with the first.
        offload: ``False`` (default, as everywhere in ckpt_offload: offload is opt-in),
            ``True``, a :class:`~ckpt_offload.OffloadOptions`, or a dict of its options
            (``{"devices": ["cpu"], "min_bytes": 0, "pool": pool}``). Off (``False``/``None``), a
            later call of the model's enable method that asks for offload turns it on:
            ``Trainer.train()`` passes the ``offload`` entry of
            ``TrainingArguments.activation_checkpointing_kwargs`` (a bool or a dict of co.offload
            options), which is then used. When on, each
            checkpointed layer's inputs -- hidden states, and the position embeddings, masks and
            ids Hugging Face passes by keyword -- wait in the host pool until backward.
        tile: ``None`` (default) or a :class:`~ckpt_offload.TileOptions` (``True``, an int of
            positions per tile, a size string, a dict of its fields): every decoder layer's MLP and
            norms run as :func:`ckpt_offload.tiled` along the sequence and, for Llama, Mistral, Qwen2/3 and
            GPT-2 causal LMs, a training forward with labels computes the head and its loss tiled,
            never the full logits (``logits`` then has 0 positions); ``handle.tiles`` says what.
        **checkpoint_kwargs: ``use_reentrant`` (``False`` by default; ``True`` needs
            ``offload=False``), ``preserve_rng_state``, ``context_fn``, ``determinism_check``,
            ``debug``, ``early_stop``.

    Returns:
        an :class:`HFCheckpointHandle`; ``handle.remove()`` restores the model.

    Raises:
        TypeError: ``model`` is not a Hugging Face model (use :func:`ckpt_offload.apply`).
        ValueError: the model does not support gradient checkpointing (or not through that hook),
            ``every_n_layers < 1``, or ``offload`` with ``use_reentrant=True``.
        RuntimeError: ckpt_offload is already applied to this model.

    Example::

        import ckpt_offload as co
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=256))
        handle = co.hf.enable(model, every_n_layers=2, offload=True)
        print(handle.names)    # ['model.layers.0', 'model.layers.2']
        model(input_ids=ids, labels=ids).loss.backward()
        handle.remove()
    """
    return install(model, every_n_layers, offload, checkpoint_kwargs, tile=tile)


def install(
    model,
    every_n_layers: int = 1,
    offload=False,
    checkpoint_kwargs: dict | None = None,
    *,
    route: str | None = "co.hf.enable(offload=...)",
    offload_decided: bool | None = None,
    pause_on_disable: bool = False,
    tile=None,
) -> HFCheckpointHandle:
    """:func:`enable` with the checkpoint keywords as one dict, for callers that resolved the
    settings themselves (the Trainer callbacks). ``route``: the name the offloads-nothing warning
    gives (None: the caller checked that at the user's own line already); ``offload_decided``:
    whether a later enable call's ``offload`` entry is ignored (default: when ``offload`` is on,
    as :func:`enable` does); ``pause_on_disable``: the model's disable method pauses the handle
    instead of removing it (Note [Disable pauses a callback's handle]); ``tile``: as :func:`enable`'s
    (sequence tiles for the blocks' MLPs and norms and the head, ``co.tile``).

    Example::

        handle = install(model, 2, {"devices": ["cpu"]}, {}, route=None, pause_on_disable=True)
    """
    checkpoint_kwargs = dict(checkpoint_kwargs or {})
    if not isinstance(model, torch.nn.Module) or not any(hasattr(model, n) for n in _ENABLE_NAMES):
        raise TypeError(
            f"co.hf.enable needs a Hugging Face transformers model (a PreTrainedModel, which has "
            f"activation_checkpointing_enable / gradient_checkpointing_enable); got {type(model).__name__}. "
            "For any other nn.Module use co.apply(model, layers=<its block class>, every_n_layers=..., offload=...)."
        )
    check_int("every_n_layers", every_n_layers, minimum=1)
    options = as_options(offload)
    tiles = as_tile_options(tile)
    check_checkpoint_keywords(checkpoint_kwargs, "co.hf.enable", own=("every_n_layers", "offload", "tile"))
    use_reentrant = check_reentrant(checkpoint_kwargs.pop("use_reentrant", None), options)
    if options is not None and route is not None:
        check_offloads_something(options.devices, route)
    if getattr(model, "supports_gradient_checkpointing", True) is False:
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing in transformers "
            "(supports_gradient_checkpointing=False), so co.hf.enable cannot hook it. Use co.apply(model, "
            "layers=<its block class>, every_n_layers=..., offload=...), which checkpoints the blocks of any nn.Module."
        )
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if setter is not None and "value" in inspect.signature(setter).parameters:
        # transformers' own test for the pre-4.35 format: such modules call torch's checkpoint
        # themselves and never read _gradient_checkpointing_func.
        raise ValueError(
            f"{type(model).__name__} uses the old checkpointing format (_set_gradient_checkpointing(module, "
            "value)), whose layers call torch's checkpoint directly, so co.hf.enable cannot plug in. Use "
            "co.apply(model, layers=<its block class>, every_n_layers=..., offload=...) instead."
        )
    check_not_applied(model, route="co.hf.enable")
    handle = HFCheckpointHandle(
        model,
        every_n_layers,
        options,
        use_reentrant,
        checkpoint_kwargs,
        offload_given=options is not None if offload_decided is None else offload_decided,
    )
    handle._saved_state = _snapshot(model)
    handle._pause_on_disable = pause_on_disable
    try:
        handle.reinstall()
    except BaseException:
        handle.remove()
        raise
    if tiles is not None:
        # Every layer's MLP, checkpointed or not (tiled, a kept layer keeps its MLP's input only).
        layers = _checkpoint_layers(model) or select_blocks(model, None, route="co.hf.enable(tile=...)")
        try:
            handle.tiles = tile_blocks(model, layers, tiles, "co.hf.enable")
        except BaseException:
            handle.remove()
            raise
    for n in _ENABLE_NAMES:
        if hasattr(model, n):
            model.__dict__[n] = _KeepOurs(handle, n)
    for n in _DISABLE_NAMES:
        if hasattr(model, n):
            model.__dict__[n] = _OnDisable(handle, n)
    model.__dict__[HANDLE_ATTR] = handle
    return handle


@suggest_keywords("co.hf.disable")
def disable(model) -> None:
    """Removes ckpt_offload's checkpointing from ``model`` (what ``handle.remove()`` does);
    does nothing if :func:`enable` is not active on it.

    Example::

        co.hf.enable(model)
        ...
        co.hf.disable(model)
    """
    handle = active_handle(model)
    if isinstance(handle, HFCheckpointHandle):
        handle.remove()
