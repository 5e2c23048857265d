"""The strategies benchmarks/overlap.py compares, and how each one runs a step.

Each strategy is a context around the model's forward and/or a per-layer checkpoint function
(see :class:`Strategy`); :func:`build_strategy` makes one for a device, or raises
:class:`Unavailable` with the reason a row shows instead of numbers.

Example::

    strategy = build_strategy("co_checkpoint_side_prefetch", torch.device("cpu"))
    with strategy.context():
        logits = model(tokens, checkpoint_fn=strategy.checkpoint_fn)
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.utils.checkpoint as torch_checkpoint

import ckpt_offload as co

KiB, MiB = 1 << 10, 1 << 20

STRATEGIES = (
    "none",
    "checkpoint",
    "hf_offload",
    "torchtune",
    "co_offload",
    "co_checkpoint_compute",
    "co_checkpoint_side_prefetch",
    "co_checkpoint_side_batched",
)
REFERENCES = ("none", "checkpoint")
OURS = ("co_offload", "co_checkpoint_compute", "co_checkpoint_side_prefetch", "co_checkpoint_side_batched")
DESCRIPTIONS = {
    "none": "no checkpointing",
    "checkpoint": "torch.utils.checkpoint.checkpoint(use_reentrant=False) per layer",
    "hf_offload": "Hugging Face offload=True: each layer's checkpoint inside save_on_cpu(pin_memory=True)",
    "torchtune": "torchtune OffloadActivations() around the checkpointed model forward, output head excluded",
    "co_offload": "with co.offload(): around the plain model forward",
    "co_checkpoint_compute": 'co.checkpoint(offload={"stream": "compute", "prefetch_bytes": 0}) per layer',
    "co_checkpoint_side_prefetch": 'co.checkpoint(offload={"stream": "side"}) per layer (default prefetch)',
    "co_checkpoint_side_batched": 'co.checkpoint(offload={"stream": "side", "batch_below": 262144, '
    '"min_bytes": 4096}) per layer',
}
#: The run with the same computation and no copies: the reference for the gradients' bit identity,
#: the step-time overhead and the hidden-copy estimate.
BASELINE = {
    "none": None,
    "checkpoint": None,
    "hf_offload": "checkpoint",
    "torchtune": "checkpoint",
    "co_offload": "none",
    "co_checkpoint_compute": "checkpoint",
    "co_checkpoint_side_prefetch": "checkpoint",
    "co_checkpoint_side_batched": "checkpoint",
}
#: co.offload options per strategy of ours (the device-specific defaults are added at run time).
OUR_OPTIONS = {
    "co_offload": {},
    "co_checkpoint_compute": {"stream": "compute", "prefetch_bytes": 0},
    "co_checkpoint_side_prefetch": {"stream": "side"},
    "co_checkpoint_side_batched": {"stream": "side", "batch_below": 256 * KiB, "min_bytes": 4096},
}


class Unavailable(Exception):
    """A strategy that cannot run here (not installed, option not supported yet, needs a GPU)."""


class SaveCounter:
    """Tensors (with at least one element) and bytes that :class:`CountingSaveOnCpu` contexts
    sharing it copied to the host."""

    def __init__(self):
        self.tensors = 0
        self.bytes = 0


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``torch.autograd.graph.save_on_cpu`` that also counts the tensors and bytes it copied into
    ``counter`` (a :class:`SaveCounter`): the sum of the host tensors' sizes, i.e. what it asked
    the host allocator for (torch's pinned allocator rounds each request up to a power of two).

    Example::

        counter = SaveCounter()
        with CountingSaveOnCpu(counter, pin_memory=True):
            loss = model(x).sum()
        print(counter.tensors, counter.bytes)
    """

    def __init__(self, counter: SaveCounter, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        inner = self.pack_hook

        def pack(tensor):
            packed = inner(tensor)
            host = packed[1]
            if host.numel():  # torch 2.11's checkpoint also saves an empty tensor per region
                counter.tensors += 1
                counter.bytes += host.numel() * host.element_size()
            return packed

        self.pack_hook = pack


def hf_checkpoint_fn(counter: SaveCounter, pin_memory: bool, device_type: str):
    """Hugging Face's ``checkpoint_func`` for ``offload=True`` (transformers' modeling_utils):
    ``with save_on_cpu(pin_memory=True): return checkpoint(function, *args, **kwargs)``, per layer,
    with ``use_reentrant=False`` (its default kwargs), counting what it copies."""

    def checkpoint_func(function, *args, **kwargs):
        with CountingSaveOnCpu(counter, pin_memory=pin_memory, device_type=device_type):
            return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    return checkpoint_func


def _torchtune_context(model):
    """torchtune's recipe setup (``get_act_offloading_ctx_manager``): ``OffloadActivations``
    around the forward, the output head under ``NoOpManager`` (its activations are needed first in
    backward). Returns (context factory, cleanup)."""
    from torchtune.training import OffloadActivations

    handles = []
    try:
        from torchtune.training import NoOpManager

        noop = NoOpManager()
        handles.append(model.lm_head.register_forward_pre_hook(lambda *a: noop.__enter__()))
        handles.append(model.lm_head.register_forward_hook(lambda *a: noop.__exit__(None, None, None)))
    except ImportError:
        pass

    def cleanup():
        for h in handles:
            h.remove()

    return OffloadActivations, cleanup


class Strategy:
    """How one strategy runs a step: a context around the forward, an optional per-layer
    checkpoint function, and (ours) the fresh pool it offloads into."""

    def __init__(
        self, name, context_factory=None, checkpoint_fn=None, pool=None, options=None, counter=None, cleanup=None
    ):
        self.name = name
        self.context_factory = context_factory or contextlib.nullcontext
        self.checkpoint_fn = checkpoint_fn
        self.pool = pool
        self.options = options
        self.counter = counter  # SaveCounter of hf_offload
        self.cleanup = cleanup or (lambda: None)
        self.last_context = None

    def context(self):
        self.last_context = self.context_factory()
        return self.last_context


def _probe_options(name: str, options: dict) -> None:
    """Raises Unavailable when this ckpt_offload does not accept ``options`` (e.g. a key that is
    still being added), by running a 4-element CPU checkpoint / offload with them."""
    probe = {k: v for k, v in options.items() if k not in ("pool", "devices")}
    probe.update(devices=["cpu"], pool=co.HostPool(pinned=False))
    x = torch.ones(4, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a 4-element probe offloads nothing by design: not worth a warning
            if name == "co_offload":
                with co.offload(**probe):
                    y = x.exp()
            else:
                y = co.checkpoint(torch.exp, x, offload=probe)
            y.sum().backward()
        co.synchronize()
    except (TypeError, ValueError) as e:
        raise Unavailable(f"unavailable: {type(e).__name__}: {e}") from None


def build_strategy(name: str, device: torch.device, model=None) -> Strategy:
    """The :class:`Strategy` ``name`` for ``device``; raises :class:`Unavailable` with the reason."""
    on_gpu = device.type == "cuda"
    torch_ckpt = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
    if name == "none":
        return Strategy(name)
    if name == "checkpoint":
        return Strategy(name, checkpoint_fn=torch_ckpt)
    if name == "hf_offload":
        counter = SaveCounter()
        return Strategy(
            name, checkpoint_fn=hf_checkpoint_fn(counter, on_gpu, device.type if on_gpu else "cuda"), counter=counter
        )
    if name == "torchtune":
        try:
            import torchtune.training  # noqa: F401
        except ImportError:
            raise Unavailable("not installed") from None
        if not on_gpu:
            raise Unavailable("unavailable: OffloadActivations needs a CUDA device")
        factory, cleanup = _torchtune_context(model)
        return Strategy(name, factory, torch_ckpt, cleanup=cleanup)
    if name in OUR_OPTIONS:
        options = dict(OUR_OPTIONS[name])
        if not on_gpu:
            # CPU tensors into a pageable pool; the tiny model's tensors are under 256 KiB.
            options["devices"] = ["cpu"]
            options.setdefault("min_bytes", 0)
        _probe_options(name, options)
        pool = co.HostPool() if on_gpu else co.HostPool(pinned=False)
        options["pool"] = pool
        if name == "co_offload":
            return Strategy(name, lambda: co.offload(**options), None, pool, options)
        return Strategy(name, None, functools.partial(co.checkpoint, offload=options), pool, options)
    raise ValueError(f"strategy: unknown name {name!r}; choose from {STRATEGIES}")
