"""``co.hf``: ckpt_offload's checkpoint as the gradient-checkpointing function of Hugging Face models.

Hugging Face ``transformers`` checkpoints a model through one hook: its enable method
(``activation_checkpointing_enable`` in recent releases such as 5.24, ``gradient_checkpointing_enable``
in earlier ones such as 5.18, where the new name is absent; 5.24 keeps the old name as a deprecated
alias) sets ``gradient_checkpointing`` on the selected layers and stores a checkpoint function as
``_gradient_checkpointing_func`` on every module that has that flag. Each
``GradientCheckpointingLayer`` then calls ``self._gradient_checkpointing_func(partial(forward,
self, **kwargs), *args)`` (5.24; 5.18 and earlier checkpoint ``partial(super().__call__,
**kwargs)``). :func:`enable` calls the model's own enable method -- so Hugging Face chooses the
layers, applies ``every_n_layers`` and turns on input gradients exactly as it does by itself --
and then puts :func:`ckpt_offload.checkpoint` with your offload options in place of that
function. Both names, both layer styles, and enable methods without ``every_n_layers`` (5.0,
4.57) are detected on the model itself, not from the version number.

Hugging Face passes a layer's ``position_embeddings``, masks and ids by keyword, inside the
``partial``: torch's checkpoint would keep those on the device. Our function opens the
``partial`` so that they are offloaded too, once for all layers that share them.

Trainer: ``Trainer.train()`` calls the model's enable method again when
``TrainingArguments(activation_checkpointing=True)`` (``gradient_checkpointing=True`` in releases
without the new name), which would put Hugging Face's function back. While :func:`enable` is active the model's
enable methods are wrapped on the instance so that such a call keeps ckpt_offload's function
(with a warning when it asked for different settings). :class:`OffloadCheckpointCallback` is the
Trainer route: it enables ckpt_offload when the Trainer is built and checks it again at
``on_train_begin``. ``activation_checkpointing_kwargs`` cannot carry our function itself (its
keys go to ``torch.utils.checkpoint.checkpoint`` and it is serialized with the arguments), but
the callback reads ``every_n_layers``, ``offload`` and torch's checkpoint keywords from it. Its
``offload`` entry is honoured on the :func:`enable` route too: Trainer passes it to the enable
call it makes, and a handle made with offload off follows it.

Example::

    import ckpt_offload as co

    handle = co.hf.enable(model, every_n_layers=2, offload=True)
    model(**batch).loss.backward()
    handle.remove()

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[co.hf.OffloadCheckpointCallback(offload=True)])
"""

# enable first: it explains a missing transformers before anything else imports it.
from ckpt_offload.integrations.hf.hook import HFCheckpointFunction, HFCheckpointHandle, disable, enable
from ckpt_offload.integrations.hf.trainer import (
    LOG_KEYS,
    PEAK_KEYS,
    PER_STEP_KEYS,
    OffloadCallback,
    OffloadCheckpointCallback,
)

__all__ = [
    "enable",
    "disable",
    "HFCheckpointHandle",
    "HFCheckpointFunction",
    "OffloadCheckpointCallback",
    "OffloadCallback",
    "PER_STEP_KEYS",
    "PEAK_KEYS",
    "LOG_KEYS",
]
