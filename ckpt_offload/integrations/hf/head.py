"""A Hugging Face causal LM's head fused with its loss, tiled: a training forward with labels never
makes the full logits (``tile=`` of ``co.apply`` / ``co.hf.enable`` / the Trainer callback).

Note [Fused head of a Hugging Face causal LM]
``LlamaForCausalLM.forward`` (Qwen2, Mistral, GPT-2 alike) runs the decoder, projects every position
to the vocabulary (``lm_head``) and computes the loss from those logits: at long context the float32
logits are the largest tensor of the step (128K vocabulary: 512 KiB per token), kept for backward.
:class:`FusedHeadForward`, set on the model instance, runs a training forward that has labels as the
model's own forward with ``labels=None`` and ``logits_to_keep`` an empty index tensor (so its head
projects no position: the returned ``logits`` have 0 positions), captures the decoder's last hidden
state with a forward hook, and computes Hugging Face's loss from it with
:func:`~ckpt_offload.tiled_cross_entropy`: labels padded and shifted (or ``shift_labels``), float32
logits, ``ignore_index``, the mean over targets, or the sum over ``num_items_in_batch`` when the
Trainer passes it. Everything else -- eval, ``no_grad``, no labels, ``logits_to_keep`` set -- runs
the model's own forward. Only for the model types whose loss is exactly that (:data:`FUSED_TYPES`):
others (a final logit softcap, a logit scale, a custom loss function) keep their head.
"""

from __future__ import annotations

import inspect

import torch
import transformers

from ckpt_offload._compile import compiled_forward, skipped_by_dynamo
from ckpt_offload._compile import eager as eager_code
from ckpt_offload._warn import warn_at_user_line
from ckpt_offload.tile_model import HEAD_FUSERS
from ckpt_offload.tiling.cross_entropy import _DEFAULT_HEAD_TILE_BYTES, _HeadLoss
from ckpt_offload.tiling.mixing import _owner_module
from ckpt_offload.tiling.tiles import _check_tile
from ckpt_offload.tiling.wrapper import Tiled

__all__ = ["FUSED_TYPES", "FusedHeadForward", "fuse_head", "fused_reason"]

#: ``config.model_type`` of the causal LMs whose head and loss :class:`FusedHeadForward` reproduces.
FUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

_COMPILE_MESSAGE = (
    "tile= fuses this causal LM's head with its loss: its training forward captures the decoder's output with a "
    "forward hook and computes the tiled loss in eager code, which Dynamo does not trace into a "
    "torch.compile(fullgraph=True) graph. Under fullgraph=True pass tile=co.TileOptions(head=False) (the blocks' "
    "MLPs are traced tiled; the head stays as it is); without fullgraph the graph breaks around the head and the "
    "model's own forward is compiled."
)


def fused_reason(model) -> str | None:
    """Why the head of ``model`` cannot be fused with its loss (None: it can).

    Example::

        fused_reason(LlamaForCausalLM(LlamaConfig(...)))     # None
        fused_reason(GemmaForCausalLM(GemmaConfig(...)))     # "its model_type 'gemma' is not one of ..."
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FUSED_TYPES:
        return f"its model_type {model_type!r} is not one of {FUSED_TYPES}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return f"its output embedding is a {type(head).__name__}, not an nn.Linear"
    if getattr(model.config, "final_logit_softcapping", None) is not None or getattr(model, "logit_scale", None):
        return "it scales or caps its logits"
    if "_loss_function" in model.__dict__:
        return "it has a custom loss_function"
    params = inspect.signature(model.forward).parameters
    if "labels" not in params or "logits_to_keep" not in params:
        return "its forward takes no labels= or logits_to_keep="
    if getattr(model, getattr(model, "base_model_prefix", ""), None) is None:
        return f"it has no base model at {getattr(model, 'base_model_prefix', None)!r}"
    return None


class FusedHeadForward:
    """The ``forward`` set on a Hugging Face causal LM by ``tile=`` (Note [Fused head of a Hugging
    Face causal LM]). ``.tiled`` is the :class:`~ckpt_offload.Tiled` of its loss.

    Example::

        handle = co.hf.enable(model, offload=True, tile=True)
        out = model(input_ids=ids, labels=ids)      # out.logits: 0 positions; out.loss: tiled
        print(model.forward.tiled.stats())
    """

    def __init__(self, model, tiled: Tiled, original=None):
        self.model = model
        self.tiled = tiled
        self.original = original if original is not None else model.__dict__.get("forward")

    def own_forward(self):
        if self.original is not None:
            return self.original
        return type(self.model).forward.__get__(self.model)

    @property
    def __signature__(self):
        # The model's own (Trainer reads it to keep dataset columns and to pass num_items_in_batch).
        return inspect.signature(self.own_forward())

    def install(self) -> None:
        self.model.__dict__["forward"] = self

    def uninstall(self) -> None:
        if self.model.__dict__.get("forward") is self:
            if self.original is not None:
                self.model.__dict__["forward"] = self.original
            else:
                del self.model.__dict__["forward"]

    @skipped_by_dynamo(_COMPILE_MESSAGE)
    def __call__(self, *args, **kwargs):
        with eager_code() as callback:
            forward = self.own_forward()
            run = compiled_forward(forward, callback)
            model = self.model
            if not (model.training and torch.is_grad_enabled()):
                return run(*args, **kwargs)
            sig = inspect.signature(forward)
            bound = sig.bind_partial(*args, **kwargs)
            arguments = dict(bound.arguments)
            var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
            extra = dict(arguments.pop(var_kw, {}) or {}) if var_kw else {}
            labels = arguments.get("labels")
            keep = arguments.get("logits_to_keep", 0)
            if labels is None or not (isinstance(keep, int) and keep == 0):
                return run(*args, **kwargs)
            base = getattr(model, model.base_model_prefix)
            captured = []
            hook = base.register_forward_hook(lambda module, inputs, output: captured.append(output))
            try:
                device = labels.device if isinstance(labels, torch.Tensor) else None
                arguments.update(labels=None, logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
                out = run(**arguments, **extra)
            finally:
                hook.remove()
            hidden = captured[-1][0]
            loss = self._loss(hidden, labels, extra)
        if isinstance(out, tuple):
            return (loss, *out)
        fields = {k: v for k, v in out.items() if k != "loss"}
        return type(out)(loss=loss, **fields)

    def _loss(self, hidden, labels, extra):
        """Hugging Face's ForCausalLMLoss on the tiled head (float32 logits, shifted labels)."""
        ignore_index = extra.get("ignore_index", -100)
        shift = extra.get("shift_labels")
        if shift is None:
            shift = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift = shift.to(hidden.device)
        num_items = extra.get("num_items_in_batch")
        flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), shift.reshape(-1)
        loss_fn = self.tiled.function
        loss_fn.ignore_index = ignore_index
        total = self.tiled(flat_h, flat_y)
        if num_items is not None:
            if isinstance(num_items, torch.Tensor):
                num_items = num_items.to(total.device)
            return total / num_items
        return total / (flat_y != ignore_index).sum()

    def __repr__(self) -> str:
        return f"<ckpt_offload fused head and loss of {type(self.model).__name__}: {self.tiled!r}>"


def fuse_head(model, options, route: str):
    """``(undo, tiled)`` after installing :class:`FusedHeadForward` on ``model``; None when ``model``
    is not a Hugging Face model, or (with a warning) a causal LM this cannot fuse.

    Example::

        undo, tiled = fuse_head(model, TileOptions(head_tile=1024), "co.apply")
        undo()
    """
    if not isinstance(model, transformers.PreTrainedModel):
        return None
    return _fuse(model, options, route)


def _fuse(model, options, route: str):
    """:func:`fuse_head` for a Hugging Face model."""
    why = fused_reason(model)
    if why is not None:
        if type(model).__name__.endswith("ForCausalLM"):
            warn_at_user_line(
                f"{route}(tile=...): the head of {type(model).__name__} stays as it is (its logits and "
                f"loss are not tiled): {why}. Its blocks' MLPs are tiled. Pass "
                "tile=co.TileOptions(head=False) to say so and silence this.",
                key=f"{route}-head",
            )
        return None
    head = model.get_output_embeddings()
    tokens, nbytes, _ = _check_tile(options.head_tile, None, name="head_tile")
    if tokens is None:
        tokens = max(1, (nbytes or _DEFAULT_HEAD_TILE_BYTES) // (head.out_features * 4))
    if _owner_module(head) is None:  # pragma: no cover - fused_reason checked it is a Linear
        return None
    tiled = Tiled(
        _HeadLoss(head, -100, "sum", True, 0.0),
        tokens,
        dim=0,
        split={1: 0},
        reduce="sum",
        out_dim=0,
        params=list(head.parameters()),
        token_wise=True,
        measure_error=options.measure_error,
        name=route,
    )
    wrapper = FusedHeadForward(model, tiled)
    wrapper.install()
    return wrapper.uninstall, tiled


if fuse_head not in HEAD_FUSERS:
    HEAD_FUSERS.append(fuse_head)
