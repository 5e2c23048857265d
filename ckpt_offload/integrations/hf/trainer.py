"""The Trainer callbacks of ``co.hf``: :class:`OffloadCheckpointCallback` (checkpointing through
:func:`~ckpt_offload.integrations.hf.enable`, inputs optionally offloaded) and
:class:`OffloadCallback` (offload without recompute). Import them as ``co.hf.OffloadCallback``."""

from __future__ import annotations

from transformers import TrainerCallback  # co.hf, imported first, explains a missing transformers

from ckpt_offload._args import check_int, check_keywords
from ckpt_offload.blocks.forward import BlockForward
from ckpt_offload.blocks.runs import InContext
from ckpt_offload.checkpointing import TORCH_KEYWORDS, check_checkpoint_keywords, check_reentrant
from ckpt_offload.integrations.hf.hook import HFCheckpointHandle, active_handle, install
from ckpt_offload.offloading import offload as offload_context
from ckpt_offload.options import OFFLOAD_KEYS, as_options, check_offloads_something, from_arguments
from ckpt_offload.tile_model import as_tile_options

__all__ = ["OffloadCheckpointCallback", "OffloadCallback", "PER_STEP_KEYS", "PEAK_KEYS", "LOG_KEYS"]


def _args_checkpoint_kwargs(args) -> dict:
    """The checkpoint kwargs of TrainingArguments, under its new or its deprecated name."""
    if args is None or not (
        getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)
    ):
        return {}
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = getattr(args, name, None)
        if isinstance(value, dict):
            return dict(value)
    return {}


#: Counters of a handle's ``stats()`` the callbacks log per optimizer step, as
#: ``ckpt_offload/<key>_per_step``: what the steps since the previous log entry did, divided by
#: their number (Trainer averages the loss over the same steps); ``stats()`` keeps the totals.
PER_STEP_KEYS = ("tensors_offloaded", "bytes_offloaded", "bytes_kept", "bytes_reloaded")
#: Peaks of ``stats()`` the callbacks log as they are, ``ckpt_offload/<key>``: the largest value
#: since training began (a peak has no per-step sum).
PEAK_KEYS = ("pool_peak_bytes", "device_saved_peak_bytes", "peak_prefetch_bytes")
#: Every ``stats()`` key the callbacks log.
LOG_KEYS = PER_STEP_KEYS + PEAK_KEYS


BOTH_CALLBACKS = (
    "co.hf.OffloadCallback and co.hf.OffloadCheckpointCallback on one model: the first offloads every saved "
    "tensor of the forward, the second checkpoints the layers and offloads their inputs, and together each "
    "layer's inputs would be copied twice while the recompute saves them again. Keep one: "
    "OffloadCheckpointCallback(every_n_layers=..., offload=True) to recompute with offloaded inputs, or "
    "OffloadCallback(...) to offload without recompute"
)


def _has_offload_callback(model) -> bool:
    wrapper = model.__dict__.get("forward")
    return isinstance(wrapper, BlockForward) and isinstance(wrapper.run, InContext)


class _StepLog:
    """Turns a callback's running totals into what each Trainer log entry reports: the counters
    per optimizer step since the previous entry, the peaks as they are."""

    def __init__(self):
        self.totals: dict = {}
        self.step = 0

    def start(self, state, stats: dict) -> None:
        """At train begin: what the counters held before training is not any step's."""
        self.totals = {k: stats.get(k, 0) for k in PER_STEP_KEYS}
        self.step = getattr(state, "global_step", 0) or 0

    def add_to_logs(self, logs: dict, state, stats: dict) -> None:
        """Adds the entries to the log entry being made: to ``logs`` (what the callbacks after
        ours see) and to the entry Trainer already put in ``state.log_history`` (it copies
        ``logs`` before calling on_log)."""
        step = getattr(state, "global_step", 0) or 0
        steps = step - self.step
        extra = {}
        if steps > 0:  # Trainer's end-of-training summary comes at the step already logged
            for k in PER_STEP_KEYS:
                if k in stats:
                    before = self.totals.get(k, 0)
                    # reset_stats() between two entries: the counter started again from zero.
                    done = stats[k] - before if stats[k] >= before else stats[k]
                    extra[f"ckpt_offload/{k}_per_step"] = done / steps
            self.totals = {k: stats.get(k, 0) for k in PER_STEP_KEYS}
            self.step = step
        extra.update({f"ckpt_offload/{k}": stats[k] for k in PEAK_KEYS if k in stats})
        logs.update(extra)
        history = getattr(state, "log_history", None)
        if history and all(history[-1].get(k) == v for k, v in logs.items() if k not in extra):
            history[-1].update(extra)


class OffloadCheckpointCallback(TrainerCallback):
    """Trainer callback: the model trains with ckpt_offload's checkpoint (and offload).

    Enables :func:`enable` on the Trainer's model when the Trainer is built (``on_init_end``), so
    Trainer sees a checkpointed model when it wraps it, and checks again at ``on_train_begin``
    (after ``Trainer.train()`` re-enabled Hugging Face's checkpointing, and on a model made by
    ``model_init``). ``every_n_layers=None`` takes ``every_n_layers`` from
    ``TrainingArguments.activation_checkpointing_kwargs`` (``gradient_checkpointing_kwargs`` in
    releases without the new name) when ``activation_checkpointing`` is on, else 1; torch's checkpoint keywords
    there (``use_reentrant``, ...) are used too, unless given here, and so is its ``offload`` key
    (a bool or a dict of co.offload options) when ``offload`` is not given here (default: False,
    as everywhere in ckpt_offload). ``tile`` is :func:`~ckpt_offload.integrations.hf.enable`'s:
    every layer's MLP and norms, and the head with its loss, tiled along the sequence.
    The handle is
    ``callback.handle``; checkpointing stays enabled after training, as Trainer leaves it. The
    model's own disable method only pauses the handle and its next enable call resumes it (TRL's
    trainers call them around generation and reference passes); ``callback.handle.remove()`` ends it.

    Example::

        args = TrainingArguments("out", activation_checkpointing=True,
                                 activation_checkpointing_kwargs={"every_n_layers": 2})
        trainer = Trainer(model, args, train_dataset=ds,
                          callbacks=[co.hf.OffloadCheckpointCallback(offload=True)])
        trainer.train()
    """

    def __init__(self, every_n_layers: int | None = None, offload=None, tile=None, **checkpoint_kwargs):
        if every_n_layers is not None:
            check_int("every_n_layers", every_n_layers, minimum=1)
        self.every_n_layers = every_n_layers
        self.tile = tile
        as_tile_options(tile)  # a bad tile= fails here, not at the first step
        # None: TrainingArguments' activation_checkpointing_kwargs["offload"], else False.
        self.offload = offload
        self.checkpoint_kwargs = checkpoint_kwargs
        # Bad or misplaced options fail here, not at the first step: a co.offload option is told
        # to go inside offload={...}; anything else lists every option the callback takes.
        check_checkpoint_keywords(
            {k: v for k, v in checkpoint_kwargs.items() if k in OFFLOAD_KEYS}, "OffloadCheckpointCallback"
        )
        check_keywords(
            "OffloadCheckpointCallback",
            checkpoint_kwargs,
            ("every_n_layers", "offload", "tile", "use_reentrant", *TORCH_KEYWORDS),
        )
        options = as_options(offload)
        check_reentrant(checkpoint_kwargs.get("use_reentrant"), options)
        if options is not None:
            check_offloads_something(options.devices, "OffloadCheckpointCallback(offload=...)")
        self.handle: HFCheckpointHandle | None = None
        self._log = _StepLog()

    def _settings(self, args):
        from_args = _args_checkpoint_kwargs(args)
        every_n = self.every_n_layers if self.every_n_layers is not None else from_args.pop("every_n_layers", 1)
        from_args.pop("every_n_layers", None)
        offload = from_args.pop("offload", None)
        if self.offload is not None:
            offload = self.offload
        else:
            # From TrainingArguments (or the default, True): checked now, where it is known.
            options = as_options(
                False if offload is None else offload, name="activation_checkpointing_kwargs['offload']"
            )
            offload = False if offload is None else offload
            if options is not None:
                check_offloads_something(
                    options.devices, "OffloadCheckpointCallback (offload from TrainingArguments' checkpointing kwargs)"
                )
        return every_n, offload, {**from_args, **self.checkpoint_kwargs}

    def _ensure(self, args, model) -> None:
        if model is None:
            return
        if _has_offload_callback(model):
            raise RuntimeError(BOTH_CALLBACKS)
        every_n, offload, kwargs = self._settings(args)
        handle = active_handle(model)
        if handle is not None:
            if handle is self.handle:
                handle.reinstall()  # idempotent; covers a Trainer that changed the model's flags
                return
            if not isinstance(handle, HFCheckpointHandle):
                raise RuntimeError(
                    "OffloadCheckpointCallback: co.apply is active on this model; remove it "
                    "(model._ckpt_offload_handle.remove()) or drop the callback"
                )
            handle.remove()  # a co.hf.enable made elsewhere: the callback's settings win
        # route=None: the offload options were checked at the callback's construction, the user's line.
        # offload_decided: the callback resolved offload itself (its own argument first, then
        # TrainingArguments' entry): Trainer's later enable call must not turn on what it turned off.
        # pause_on_disable: Trainer subclasses (TRL's GRPO and DPO trainers) turn checkpointing off and
        # on around their no-grad passes; the handle must outlive that (Note [Disable pauses a
        # callback's handle] in hook.py).
        self.handle = install(
            model, every_n, offload, kwargs, route=None, offload_decided=True, pause_on_disable=True, tile=self.tile
        )
        self.handle._from_callback = True  # OffloadCallback refuses to join it

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._ensure(args, model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._ensure(args, model)
        if self.handle is not None and not self.handle.removed:
            # The logs describe this run: a handle kept from an earlier train() starts from zero.
            self.handle.reset_stats()
            self._log.start(state, self.handle.stats())

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Adds this run's offload statistics to what the Trainer logs: ``ckpt_offload/<counter>_per_step``
        (since the previous entry, per optimizer step) and ``ckpt_offload/<peak>`` (peaks since this
        ``train()`` began; see ``PER_STEP_KEYS`` and ``PEAK_KEYS``)."""
        if logs is None or self.handle is None or self.handle.removed or self.handle.function.options is None:
            return
        self._log.add_to_logs(logs, state, self.handle.stats())


class OffloadCallback(TrainerCallback):
    """Trainer callback: offload without recompute. Every training forward of the Trainer's
    model runs inside ``co.offload(**options)``, so the activations it saves wait in the host
    pool until backward (no checkpointing: nothing is computed twice). ``callback.stats()`` is
    the context's statistics; they are added to the Trainer's logs as ``ckpt_offload/...``.
    Wrap the LM head and the loss in :func:`ckpt_offload.keep` inside your model to keep them.

    The options are ``co.offload``'s, as keywords or as one :class:`~ckpt_offload.OffloadOptions`
    (or a dict of them) given first, which keywords then change.

    Example::

        trainer = Trainer(model, args, train_dataset=ds,
                          callbacks=[co.hf.OffloadCallback(devices=["cpu"])])
        trainer.train()
        print(trainer.callback_handler.callbacks[-1].stats()["bytes_offloaded"])
        co.hf.OffloadCallback(co.OffloadOptions(devices=["cpu"], min_bytes="1MiB"))   # the same options, one value
    """

    def __init__(self, options=None, /, **kwargs):
        recompute = (
            "OffloadCallback offloads without recompute; to checkpoint as well use "
            "co.hf.OffloadCheckpointCallback(every_n_layers=..., offload={...}) instead"
        )
        check_keywords(
            "OffloadCallback",
            kwargs,
            OFFLOAD_KEYS,
            elsewhere={k: recompute for k in ("every_n_layers", "offload", "use_reentrant", *TORCH_KEYWORDS)},
        )
        if options is None:
            opts = from_arguments("OffloadCallback", (), kwargs)  # bad options fail here
        else:
            opts = as_options(options, name="OffloadCallback(options)")
            if opts is None:
                raise ValueError("OffloadCallback(False) offloads nothing: leave the callback out, or pass options")
            opts = opts.replace(**kwargs) if kwargs else opts
        check_offloads_something(opts.devices, "OffloadCallback")
        self.context = offload_context._from_options(opts)  # warned just above, at the user's line
        self._model = None
        self._log = _StepLog()

    def _install(self, model) -> None:
        if model is None:
            return
        handle = active_handle(model)
        if isinstance(handle, HFCheckpointHandle) and getattr(handle, "_from_callback", False):
            raise RuntimeError(BOTH_CALLBACKS)
        if _has_offload_callback(model):
            return
        # The one forward installer co.apply uses: a training forward runs inside this context;
        # in eval or under no_grad the model's own forward runs as is.
        BlockForward(model, InContext(self.context)).install()
        self._model = model

    def remove(self) -> None:
        """Gives the model its own forward back. Calling it twice is harmless."""
        model, self._model = self._model, None
        if model is not None:
            wrapper = model.__dict__.get("forward")
            if isinstance(wrapper, BlockForward) and isinstance(wrapper.run, InContext):
                BlockForward.uninstall(model)

    def stats(self) -> dict:
        """The co.offload context's :meth:`~ckpt_offload.offload.stats`, with ``pool_peak_bytes``
        (its pool's ``peak_bytes_in_use``, since :meth:`reset_stats` -- called when ``train()``
        begins -- which resets the pool's peaks) like the checkpoint callback's."""
        out = self.context.stats()
        out["pool_peak_bytes"] = self.context.pool.stats()["peak_bytes_in_use"]
        return out

    def reset_stats(self) -> None:
        self.context.reset_stats()
        self.context.pool.reset_peak()

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._install(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._install(model)
        self.context.reset_stats()  # the logs describe this run, not an earlier train()
        self._log.start(state, self.stats())

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.remove()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        self._log.add_to_logs(logs, state, self.stats())
