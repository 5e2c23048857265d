"""Sequence-tiled recompute: a token-wise function run over tiles of the sequence, nothing of it kept.

``co.tiled(function, tile=...)`` wraps a function that treats every token on its own -- an MLP, a
norm, the LM head with its loss -- so that its forward runs over tiles of the sequence dimension
without keeping any intermediate (only its inputs are saved for backward), and its backward
recomputes and differentiates one tile at a time, summing the parameters' gradients over the tiles.
At long context the largest part of a transformer layer's working set is its MLP's intermediates
(a SwiGLU keeps four tensors of the MLP's width per token); tiled, that part shrinks to one tile's.

Note [Tiled recompute: two nodes]
A tiled call records two autograd nodes. The first, :class:`_SaveInputs`, saves the inputs (through
``save_for_backward``: whatever saved-tensor hooks are active -- co.offload's, a checkpoint's -- see
them, and autograd's version check applies) and returns an empty token; the second,
:class:`_TiledCompute`, takes the token and the inputs, computes the tiles under ``no_grad`` and, in
backward, reads the inputs back through the first node's saved tensors. Saving before computing is
what lets the tiled function nest in a checkpoint at no extra cost: torch's non-reentrant checkpoint
stops its recompute once the last tensor the block saved has been recomputed (early stop), and when
the tiled function is the block's last saver (a decoder layer's MLP, followed by the residual add)
that is the first node's save, before any tile runs. So the block's recompute runs no MLP at all;
each tile's forward runs once more, just before its own backward, as the MLP's forward would have in
the block's recompute: the same FLOPs as checkpointing without tiles. The compute node returns an
empty gradient for the token, so the first node runs in backward and autograd releases its saved
tensors there (pool bytes go back at the end of backward, not when the graph dies).

Note [Tiled recompute: what is exact]
The forward computes each tile with the same kernels as the whole sequence, so each token's output
is the untiled one wherever the backend computes a row without looking at the number of rows (CPU
float32 in the tests: bit-identical); the input's gradient likewise, tile by tile. A parameter's
gradient is a sum over tokens: tiled, it is the sum over tiles of per-tile sums, which rounds
differently from one large matmul. So tiling is opt-in, never bit-identical for parameters, and
``measure_error=True`` measures its error against the untiled run (docs/api.md, "Sequence-tiled
recompute"). Gradients of parameters narrower than float32 are accumulated in float32 over the
tiles and rounded once.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_offload._args import suggest_keywords
from ckpt_offload._args import check_int, parse_bytes
from ckpt_offload._compile import (
    compiled_forward,
    fullgraph_tracing,
    skip_frame_only,
    skipped_by_dynamo,
    watch_for_dynamo,
)
from ckpt_offload._compile import eager as eager_code

__all__ = ["TILED_COMPILE_MESSAGE", "Tiled", "mixing_reason", "tiled", "tiled_cross_entropy"]

#: Why Dynamo does not trace a tiled call into the graph around it (the graph breaks there; the
#: function itself is compiled, tile by tile). fullgraph=True takes the traced route instead.
TILED_COMPILE_MESSAGE = (
    "co.tiled: the tiled call runs its tiles in eager code (an autograd function whose backward "
    "recomputes each tile), so Dynamo breaks the graph there and compiles the tiled function itself, "
    "once per tile shape. Under fullgraph=True the tiles are traced into the graph instead, each "
    "under torch's checkpoint.")

_DEFAULT_HEAD_TILE_BYTES = 256 << 20  # tiled_cross_entropy's default: float32 logits of one tile


# --- which functions mix tokens ------------------------------------------------------------------

# Modules whose output at one position depends on other positions. A tiled call of them would be
# wrong, not just inexact.
def _mixing_types() -> tuple:
    types = [torch.nn.MultiheadAttention, torch.nn.RNNBase, torch.nn.Transformer,
             torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer, torch.nn.TransformerEncoder,
             torch.nn.TransformerDecoder, torch.nn.modules.conv._ConvNd, torch.nn.modules.batchnorm._NormBase,
             torch.nn.GroupNorm, torch.nn.modules.pooling._MaxPoolNd, torch.nn.modules.pooling._AvgPoolNd]
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


# --- tile sizes ----------------------------------------------------------------------------------


def _check_tile(tile, tiles, name="tile"):
    """``tile`` (tokens: an int; bytes: a size string) and ``tiles`` (a count) checked; returns
    (tokens or None, bytes or None, count or None)."""
    if tile is not None and tiles is not None:
        raise ValueError(f"give {name}= (tokens per tile, or a size string for bytes per tile) or tiles= (how many "
                         f"tiles), not both; got {name}={tile!r}, tiles={tiles!r}")
    if tiles is not None:
        return None, None, check_int("tiles", tiles, minimum=1)
    if tile is None or tile == "auto":
        return None, None, None
    if isinstance(tile, str):
        nbytes = parse_bytes(name, tile)
        if nbytes < 1:
            raise ValueError(f"{name}: {tile!r} is 0 bytes; give at least one token's bytes, e.g. '64MiB'")
        return None, nbytes, None
    if isinstance(tile, bool) or not isinstance(tile, int):
        raise TypeError(f"{name} must be an int (tokens per tile), a size string such as '64MiB' (bytes per tile), "
                        f"'auto' or None; got {type(tile).__name__} ({tile!r})")
    return check_int(name, tile, minimum=1), None, None


def _positions_per_tile(n: int, bytes_per_position: int, width: int, tokens, nbytes, count) -> int:
    """How many positions along the tiled dimension one tile takes."""
    if count is not None:
        return max(1, math.ceil(n / count))
    if tokens is not None:
        return tokens
    if nbytes is not None:
        return max(1, nbytes // max(1, bytes_per_position))
    return max(1, width)  # "auto": as many positions as the input is wide (DeepSpeed's TiledMLP rule)


def _tiles(n: int, per: int) -> list:
    return [(s, min(per, n - s)) for s in range(0, n, per)]


# --- RNG and autocast, as torch's checkpoint replays them ----------------------------------------


def _device_type(tensors) -> str:
    for t in tensors:
        if t.device.type != "cpu":
            return t.device.type
    return "cpu"


def _autocast_state(device_type: str):
    state = {}
    for dev in {device_type, "cpu"}:
        if torch.amp.is_autocast_available(dev):
            state[dev] = {"enabled": torch.is_autocast_enabled(dev), "dtype": torch.get_autocast_dtype(dev),
                          "cache_enabled": torch.is_autocast_cache_enabled()}
    return state


def _autocast(state: dict):
    stack = contextlib.ExitStack()
    for dev, kwargs in state.items():
        stack.enter_context(torch.amp.autocast(dev, **kwargs))
    return stack


class _RngState:
    """The RNG states at a tiled call's start (CPU, and the devices its tensors are on), replayed
    in backward: the tiles then run in forward order and draw what they drew in forward."""

    def __init__(self, tensors, device_type):
        from torch.utils.checkpoint import get_device_states

        self.device_type = device_type
        self.cpu = torch.get_rng_state()
        self.devices, self.states = [], []
        module = getattr(torch, device_type, None) if device_type != "cpu" else None
        if module is not None and getattr(module, "_initialized", False):
            self.devices, self.states = get_device_states(*tensors)

    @contextlib.contextmanager
    def replay(self):
        from torch.utils.checkpoint import set_device_states

        kwargs = {} if self.device_type == "cpu" else {"device_type": self.device_type}
        with torch.random.fork_rng(devices=self.devices, enabled=True, **kwargs):
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.states, device_type=self.device_type)
            yield


# --- finding the parameters a function reads -----------------------------------------------------


class _ReadsWatch(TorchFunctionMode):
    """Records, while a tile runs, the tensors requiring grad that the function reads besides its
    inputs: leaves (parameters it closes over) and non-leaves (activations it closes over)."""

    def __init__(self, known_ids: set):
        super().__init__()
        self.known = known_ids
        self.leaves: dict = {}
        self.others: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self.known and t.requires_grad:
                if t.grad_fn is None:
                    self.leaves.setdefault(id(t), t)
                elif not self.others:
                    self.others.append(t)
        return func(*args, **kwargs)


# --- the call ------------------------------------------------------------------------------------


class _Call:
    """One tiled call: the function, its arguments with the tensors taken out, which tensors are
    split along which dimension, the tiles, and what backward needs to replay them."""

    __slots__ = (
        "autocast",
        "dims",
        "fn",
        "n",
        "n_tensors",
        "out_dim",
        "owner",
        "param_versions",
        "positions",
        "reduce",
        "rng",
        "single",
        "skeleton",
        "spec",
        "tiles",
    )

    def fill(self, tensors, start=None, length=None):
        """The arguments of one tile (``start``/``length`` along the tiled dimension), or of the
        whole call (``start`` None)."""
        filled = list(self.skeleton)
        for i, t, d in zip(self.positions, tensors, self.dims):
            # A tile along the sequence of a batch of sequences is strided; given contiguous (as the
            # untiled input is), so that code that views its input (x.view(-1, h)) works. With one
            # sequence it is contiguous already: no copy.
            filled[i] = t if (d is None or start is None) else t.narrow(d, start, length).contiguous()
        return tree_unflatten(filled, self.spec)

    def run(self, tensors, start=None, length=None) -> tuple:
        """The function on one tile (or the whole call); its outputs as a tuple."""
        a, kw = self.fill(tensors, start, length)
        out = self.fn(*a, **kw)
        if isinstance(out, torch.Tensor):
            self.single = True
            return (out,)
        if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
            self.single = False
            return tuple(out)
        raise TypeError(f"co.tiled: the function must return a tensor or a tuple of tensors, got {_describe(out)}")


def _describe(out) -> str:
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of " + ", ".join(type(o).__name__ for o in out)
    return type(out).__name__


def _run_tiles(call: _Call, tensors) -> tuple:
    """Every tile's outputs, assembled: written into place along ``out_dim``, or summed."""
    if call.owner is not None:
        call.owner._counted_call(call)
    outs = None
    for k, (start, length) in enumerate(call.tiles):
        part = call.run(tensors, start, length)
        if outs is None:
            if call.reduce == "sum":
                # The first tile's output is the running sum: never one that views an input.
                outs = [p.clone() if _aliases(p, tensors) else p for p in part]
            else:
                outs = [_buffer_for(p, call) for p in part]
        if call.reduce == "sum":
            if k:
                for o, p in zip(outs, part):
                    o.add_(p)
        else:
            for o, p in zip(outs, part):
                o.narrow(_out_dim(p, call), start, length).copy_(p)
        del part
    return tuple(outs)


def _aliases(t, tensors) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == ptr for x in tensors)


def _out_dim(p, call) -> int:
    d = call.out_dim
    return d + p.dim() if d < 0 else d


def _buffer_for(part, call) -> torch.Tensor:
    d = _out_dim(part, call)
    if not 0 <= d < part.dim():
        raise ValueError(f"co.tiled: out_dim={call.out_dim} is not a dimension of the function's output (shape "
                         f"{tuple(part.shape)}); pass out_dim= (the output's token dimension) or reduce='sum' for "
                         "outputs without one")
    if part.shape[d] != call.tiles[0][1]:
        raise ValueError(f"co.tiled: the function's output has {part.shape[d]} positions along out_dim={call.out_dim} "
                         f"for a tile of {call.tiles[0][1]}; a token-wise function returns one row per input row. "
                         "Pass out_dim= (the output's token dimension) or reduce='sum' (outputs summed over tiles)")
    shape = list(part.shape)
    shape[d] = call.n
    return part.new_empty(shape)


class _SaveInputs(torch.autograd.Function):
    """Note [Tiled recompute: two nodes]: saves a tiled call's inputs, returns an empty token."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, token_grad):
        return (None,) * len(ctx.needs_input_grad)


class _TiledCompute(torch.autograd.Function):
    """Note [Tiled recompute: two nodes]: the tiles, under no_grad; backward recomputes and
    differentiates them one at a time."""

    @staticmethod
    def forward(ctx, token, call, *flat):
        ctx.call = call
        ctx.saver = token.grad_fn  # the _SaveInputs node: its saved tensors are this call's inputs
        ctx.params = flat[call.n_tensors:]
        outs = _run_tiles(call, flat[:call.n_tensors])
        undiff = [o for o in outs if not _float(o)]
        if undiff:
            ctx.mark_non_differentiable(*undiff)
        return outs[0] if call.single else outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        saved = ctx.saver.saved_tensors  # reloaded / recomputed / version-checked here
        grads_in = _tile_backward(ctx.call, saved, list(ctx.params), grads)
        return (torch.empty(0), None, *grads_in)


def _check_versions(call, params) -> None:
    for i, (p, v) in enumerate(zip(params, call.param_versions)):
        if p._version != v:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a parameter of shape {list(p.shape)} read by a co.tiled function (parameter {i}) is at version "
                f"{p._version}; expected version {v} instead. Its backward recomputes each tile with the parameters "
                "as they are now, so an in-place change between forward and backward would give a wrong gradient.")


def _tile_backward(call: _Call, saved, params, grads):
    """The gradients of a tiled call's tensors and parameters, one tile at a time."""
    _check_versions(call, params)
    n_t = call.n_tensors
    # The inputs as leaves of the recompute: split tensors are cut per tile, the rest is shared.
    whole = [t.detach().requires_grad_(t.requires_grad) if d is None and _float(t) else t
             for t, d in zip(saved, call.dims)]
    split_grads = [torch.empty_like(t) if d is not None and t.requires_grad else None
                   for t, d in zip(saved, call.dims)]
    shared_acc = [None] * n_t
    param_acc = [None] * len(params)
    with contextlib.ExitStack() as stack:
        if call.rng is not None:
            stack.enter_context(call.rng.replay())
        stack.enter_context(_autocast(call.autocast))
        for start, length in call.tiles:
            tile_inputs = []
            for t, d, w in zip(saved, call.dims, whole):
                if d is None:
                    tile_inputs.append(w)
                else:
                    piece = t.narrow(d, start, length).detach().contiguous()
                    tile_inputs.append(piece.requires_grad_(t.requires_grad) if _float(t) else piece)
            with torch.enable_grad():
                outs = call.run(tile_inputs)
            diff_outs, diff_grads = [], []
            for o, g in zip(outs, grads):
                if g is None or not o.requires_grad:
                    continue
                diff_outs.append(o)
                diff_grads.append(g if call.reduce == "sum" else g.narrow(_out_dim(o, call), start, length))
            del outs
            wanted = [x for x in tile_inputs if x.requires_grad] + params
            got = list(torch.autograd.grad(diff_outs, wanted, diff_grads, allow_unused=True)) \
                if diff_outs and wanted else [None] * len(wanted)
            del diff_outs
            it = iter(got)
            for i, x in enumerate(tile_inputs):
                if not x.requires_grad:
                    continue
                g = next(it)
                if call.dims[i] is not None:
                    dst = split_grads[i].narrow(call.dims[i], start, length)
                    dst.zero_() if g is None else dst.copy_(g)
                else:
                    shared_acc[i] = _accumulate(shared_acc[i], g, diff_grads)
            for j in range(len(params)):
                param_acc[j] = _accumulate(param_acc[j], next(it), diff_grads)
            del got, diff_grads, tile_inputs
    out = [split_grads[i] if call.dims[i] is not None else _finish(shared_acc[i], t) for i, t in enumerate(saved)]
    out += [_finish(a, p) for a, p in zip(param_acc, params)]
    _measure_backward(call, saved, params, grads, out)
    if call.owner is not None:
        call.owner._count("tiles_recomputed", len(call.tiles))
    return out


def _float(t) -> bool:
    return t.is_floating_point() or t.is_complex()


def _accumulate(acc, g, incoming):
    """``acc + g``, in float32 for narrower floating types (rounded once at the end)."""
    if g is None:
        return acc
    if acc is None:
        if g.dtype in (torch.float16, torch.bfloat16):
            return g.float()
        # g may be (a view of) an incoming gradient (an identity-like function): never add into it.
        return g.clone() if g._base is not None or _aliases(g, incoming) else g
    return acc.add_(g)


def _finish(acc, like):
    if acc is None:
        return None
    return acc.to(like.dtype) if acc.dtype != like.dtype else acc


# --- measuring the error against the untiled run -------------------------------------------------


class _ErrorClass:
    __slots__ = ("bit_identical", "max_rel", "sum_rel", "tensors")

    def __init__(self):
        self.tensors, self.sum_rel, self.max_rel, self.bit_identical = 0, 0.0, 0.0, True

    def add(self, tiled_value, untiled_value) -> None:
        if tiled_value is None or untiled_value is None:
            return
        a, b = tiled_value.detach().double(), untiled_value.detach().double()
        rel = float((a - b).norm() / b.norm().clamp_min(1e-300))
        self.tensors += 1
        self.sum_rel += rel
        self.max_rel = max(self.max_rel, rel)
        self.bit_identical = self.bit_identical and torch.equal(tiled_value, untiled_value)

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "mean_rel_error": self.sum_rel / max(self.tensors, 1),
                "max_rel_error": self.max_rel, "bit_identical": self.bit_identical}


def _measure_forward(call, tensors, outs) -> None:
    owner = call.owner
    if owner is None or not owner.measure_error:
        return
    with contextlib.ExitStack() as stack:
        if call.rng is not None:
            stack.enter_context(call.rng.replay())
        stack.enter_context(torch.no_grad())
        ref = call.run(tensors)
    with owner._lock:
        for o, r in zip(outs, ref):
            owner._errors.setdefault("output", _ErrorClass()).add(o, r)


def _measure_backward(call, saved, params, grads, tiled_grads) -> None:
    owner = call.owner
    if owner is None or not owner.measure_error:
        return
    inputs = [t.detach().requires_grad_(t.requires_grad) if _float(t) else t for t in saved]
    with contextlib.ExitStack() as stack:
        if call.rng is not None:
            stack.enter_context(call.rng.replay())
        stack.enter_context(_autocast(call.autocast))
        with torch.enable_grad():
            outs = call.run(inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] + params
        if not pairs or not wanted:
            return
        ref = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    it = iter(ref)
    with owner._lock:
        for x, got in zip(inputs, tiled_grads):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                owner._errors.setdefault("input_grad", _ErrorClass()).add(got, next(it))
        for got in tiled_grads[len(inputs):]:
            owner._errors.setdefault("param_grad", _ErrorClass()).add(got, next(it))


# --- the public wrapper --------------------------------------------------------------------------

_REDUCES = (None, "sum")
#: The counts of :meth:`Tiled.stats` (besides ``tile_error``).
_STATS_KEYS = ("calls", "untiled_calls", "tiles", "tiles_recomputed", "positions", "largest_tile")


class Tiled:
    """A token-wise function run over tiles of the sequence (made by :func:`tiled`; see there).

    Calling it calls the function: ``tiled_mlp(x)`` returns what ``mlp(x)`` returns. ``stats()``
    counts calls and tiles and, with ``measure_error=True``, the error against the untiled run.
    Not an ``nn.Module``: keep it as a plain attribute (``self._tiled_mlp = co.tiled(self.mlp)``);
    the module it wraps stays where it is registered.

    Example::

        mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        tiled_mlp = co.tiled(mlp, tile=128)
        y = tiled_mlp(torch.randn(2, 1024, 64, requires_grad=True))   # 8 tiles of 128 positions
        y.sum().backward()
        print(tiled_mlp.stats()["tiles"])                            # 8
    """

    def __init__(self, function, tile=None, *, tiles=None, dim: int = -2, split=None, reduce=None,
                 out_dim=None, params=None, token_wise=None, preserve_rng_state: bool = True,
                 measure_error: bool = False, name: str = "co.tiled"):
        if not callable(function):
            raise TypeError(f"{name}: function must be callable (a module or a function of tensors), got "
                            f"{type(function).__name__}")
        self.tile, self.tile_bytes, self.tiles = _check_tile(tile, tiles)
        self.dim = check_int("dim", dim)
        self.split = _check_split(split)
        if reduce not in _REDUCES:
            raise ValueError(f"reduce must be None (outputs concatenated along out_dim) or 'sum' (outputs summed over "
                             f"tiles, e.g. a loss with reduction='sum'); got {reduce!r}")
        self.reduce = reduce
        self.out_dim = check_int("out_dim", out_dim, allow_none=True)
        for arg, value in (("preserve_rng_state", preserve_rng_state), ("measure_error", measure_error)):
            if not isinstance(value, bool):
                raise TypeError(f"{arg} must be True or False, got {value!r}")
        if token_wise not in (None, True):
            raise ValueError("token_wise must be None (refuse modules known to mix tokens) or True (your promise "
                             f"that the function treats every position on its own); got {token_wise!r}")
        self.function = function
        self.module = _owner_module(function)
        if token_wise is None and self.module is not None:
            why = mixing_reason(self.module)
            if why is not None:
                raise ValueError(
                    f"{name}: {type(self.module).__name__} mixes tokens: {why}. A tiled call computes each tile "
                    "of the sequence on its own, so the output at one position could not depend on other tiles: "
                    "tile only token-wise parts (an MLP, a norm, the LM head and its loss). If this module is "
                    "token-wise all the same, pass token_wise=True (your promise).")
        self.params = None if params is None else _check_params(params)
        self.preserve_rng_state = preserve_rng_state
        self.measure_error = measure_error
        self.name = name
        self._found: list | None = None  # parameters found at the first call (Note in _find_params)
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_STATS_KEYS, 0)
        self._errors: dict = {}
        watch_for_dynamo()  # Note [Wrappers under fullgraph=True]

    # -- stats --------------------------------------------------------------------------------

    def stats(self) -> dict:
        """``calls`` (tiled), ``untiled_calls`` (calls whose input fit in one tile: the function ran
        as it is), ``tiles`` (run in forward), ``tiles_recomputed`` (run again in backward),
        ``positions`` (along the tiled dimension, summed over calls), ``largest_tile`` (positions);
        with ``measure_error=True`` also ``tile_error``: per class (``"output"``, ``"input_grad"``,
        ``"param_grad"``) ``tensors``, ``mean_rel_error``, ``max_rel_error`` of
        ``||tiled - untiled|| / ||untiled||`` and ``bit_identical``.

        Example::

            t = co.tiled(mlp, tile=256, measure_error=True)
            t(x).sum().backward()
            print(t.stats()["tile_error"]["param_grad"]["max_rel_error"])
        """
        with self._lock:
            out = dict(self._stats)
            if self.measure_error:
                out["tile_error"] = {k: v.as_dict() for k, v in self._errors.items()}
        return out

    def __getstate__(self):
        # A lock neither pickles nor deep-copies: a copy (of the model it is installed on) gets its
        # own, and counts from zero.
        state = dict(self.__dict__)
        del state["_lock"]
        state["_stats"] = dict.fromkeys(_STATS_KEYS, 0)
        state["_errors"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset_stats(self) -> None:
        """Counts (and measured errors) from zero again."""
        with self._lock:
            for k in self._stats:
                self._stats[k] = 0
            self._errors = {}

    def __repr__(self) -> str:
        size = (f"tile={self.tile}" if self.tile is not None else f"tile={self.tile_bytes}B"
                if self.tile_bytes is not None else f"tiles={self.tiles}" if self.tiles is not None else "tile='auto'")
        what = type(self.module).__name__ if self.module is not None else getattr(self.function, "__name__", "function")
        return f"Tiled({what}, {size}, dim={self.dim})"

    # -- calling ------------------------------------------------------------------------------

    @skip_frame_only
    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and fullgraph_tracing():
            return self._traced(args, kwargs)  # Note [Wrappers under fullgraph=True]
        return self._eager(*args, **kwargs)

    @skipped_by_dynamo(TILED_COMPILE_MESSAGE)
    def _eager(self, *args, **kwargs):
        with eager_code() as callback:
            return self._call(compiled_forward(self.function, callback), args, kwargs)

    def _resolve(self, args, kwargs):
        """``(x, its tiled dimension, its length there, positions per tile)``."""
        if not args or not isinstance(args[0], torch.Tensor):
            got = "no positional argument" if not args else type(args[0]).__name__
            raise TypeError(f"{self.name}: the first positional argument is the tensor to tile (e.g. hidden states "
                            f"(batch, seq, hidden)); got {got}")
        x = args[0]
        if x.dim() == 0:
            raise ValueError(f"{self.name}: the first argument is a 0-dimensional tensor: there is nothing to tile")
        d = self.dim + x.dim() if self.dim < 0 else self.dim
        if not 0 <= d < x.dim():
            raise ValueError(f"dim={self.dim} is not a dimension of the first argument (shape {tuple(x.shape)}); "
                             f"pass the sequence dimension, e.g. dim=1 for (batch, seq, hidden)")
        n = x.shape[d]
        per_position = (x.numel() // n if n else 0) * x.element_size()
        per = _positions_per_tile(n, per_position, x.shape[-1], self.tile, self.tile_bytes, self.tiles)
        return x, d, n, per

    def _counted_call(self, call) -> None:
        with self._lock:
            s = self._stats
            s["calls"] += 1
            s["tiles"] += len(call.tiles)
            s["positions"] += call.n
            s["largest_tile"] = max(s["largest_tile"], call.tiles[0][1])

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self._stats[key] += n

    def _call(self, fn, args, kwargs):
        _, d, n, per = self._resolve(args, kwargs)
        if n <= per:
            # One tile is the whole call: tiling would only add a recompute.
            self._count("untiled_calls", 1)
            return fn(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        call = _Call()
        call.owner, call.fn, call.spec = self, fn, spec
        call.skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        call.positions, call.n = positions, n
        call.dims = _split_dims(self, args, kwargs, leaves, positions, d, n)
        call.tiles = _tiles(n, per) if n else [(0, 0)]
        call.n_tensors = len(tensors)
        call.reduce = self.reduce
        call.out_dim = self.out_dim if self.out_dim is not None else self.dim
        call.single = True
        call.rng = None
        call.autocast = {}
        del leaves, args, kwargs
        if self._found is None:
            self._find_params(call, tensors)
        params = self._params()
        if not (torch.is_grad_enabled() and (any(t.requires_grad for t in tensors) or params)):
            with torch.no_grad():
                outs = _run_tiles(call, tensors)
                _measure_forward(call, tensors, outs)
            return outs[0] if call.single else outs
        device_type = _device_type(tensors)
        call.rng = _RngState(tensors, device_type) if self.preserve_rng_state else None
        call.autocast = _autocast_state(device_type)
        call.param_versions = [p._version for p in params]
        token = _SaveInputs.apply(torch.empty(0, requires_grad=True), *tensors)
        out = _TiledCompute.apply(token, call, *tensors, *params)
        if self.measure_error:
            _measure_forward(call, tensors, (out,) if call.single else out)
        return out

    def _params(self) -> list:
        """The parameters whose gradients the tiles return: a module's own (requiring grad), those
        given in ``params=``, and those the function was seen reading at its first call."""
        own = [] if self.module is None else list(self.module.parameters())
        seen, out = set(), []
        for p in own + (self.params or []) + (self._found or []):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _find_params(self, call, tensors) -> None:
        """Note [Parameters a tiled function reads]
        Backward differentiates each tile with respect to its inputs and a list of parameters, and
        returns those gradients from the tiled call's node: a tensor requiring grad that the function
        reads without it being in that list would silently get no gradient. So the first call runs its
        first tile once more, eagerly, under no_grad and a TorchFunctionMode that records every tensor
        requiring grad that reaches an op and is not an argument: leaves (parameters the function
        closes over: a lambda over a head's weight) join the list, an activation it closes over (a
        non-leaf, which could not be saved with the arguments) is refused. The RNG is forked around
        it, so it draws nothing from the caller's generators. Later calls use the list found then."""
        known = {id(t) for t in tensors} | {id(p) for p in self._params()}
        watch = _ReadsWatch(known)
        probe = _Call()
        for slot in _Call.__slots__:
            setattr(probe, slot, getattr(call, slot, None))
        probe.fn = self.function  # eager: the mode is not for Dynamo to trace
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.no_grad(), watch:
            probe.run(tensors, *call.tiles[0])
        if watch.others:
            t = watch.others[0]
            raise RuntimeError(
                f"{self.name}: the function reads a tensor that requires grad and is neither one of its arguments "
                f"nor a parameter (shape {list(t.shape)}, made by {type(t.grad_fn).__name__}): tiled, its "
                "gradient would be lost, since backward recomputes each tile from the saved arguments only. Pass it "
                "to the function as an argument (e.g. co.tiled(f)(x, that_tensor)).")
        self._found = list(watch.leaves.values())

    # -- fullgraph ----------------------------------------------------------------------------

    def _traced(self, args, kwargs):
        """Under ``torch.compile(fullgraph=True)``: each tile under torch's non-reentrant
        checkpoint, traced into the graph (the compiler then decides what its backward keeps)."""
        import torch.utils.checkpoint as torch_checkpoint

        _, d, n, per = self._resolve(args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        dims = _split_dims(self, args, kwargs, leaves, positions, d, n)
        skeleton = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        tensors = [leaves[i] for i in positions]
        fn = self.function

        def region(*given):
            filled = list(skeleton)
            for i, t in zip(positions, given):
                filled[i] = t
            a, kw = tree_unflatten(filled, spec)
            return fn(*a, **kw)

        parts = []
        for start, length in _tiles(n, per):
            tile_tensors = [t if dd is None else t.narrow(dd, start, length).contiguous()
                            for t, dd in zip(tensors, dims)]
            parts.append(torch_checkpoint.checkpoint(region, *tile_tensors, use_reentrant=False))
        single = isinstance(parts[0], torch.Tensor)
        cols = [[p] if single else list(p) for p in parts]
        out_dim = self.out_dim if self.out_dim is not None else self.dim
        if self.reduce == "sum":
            outs = [sum(c[j] for c in cols[1:]) + cols[0][j] if len(cols) > 1 else cols[0][j]
                    for j in range(len(cols[0]))]
        else:
            outs = [torch.cat([c[j] for c in cols], dim=out_dim) for j in range(len(cols[0]))]
        return outs[0] if single else tuple(outs)


def _check_params(params) -> list:
    try:
        out = list(params)
    except TypeError:
        raise TypeError(f"params must be an iterable of tensors (e.g. module.parameters()), got "
                        f"{type(params).__name__}") from None
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] must be a tensor (a parameter), got {type(p).__name__}")
    return out


def _check_split(split) -> dict:
    if split is None:
        return {}
    if not isinstance(split, dict):
        raise TypeError("split must be a dict {argument position (int >= 1) or keyword (str): its token dimension}, "
                        f"e.g. split={{1: -1}} for labels (batch, seq) given second; got {type(split).__name__}")
    out = {}
    for key, d in split.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)) or (isinstance(key, int) and key < 1):
            raise ValueError(f"split: {key!r} is not an argument position >= 1 (the first argument is always split) "
                             "or a keyword name")
        out[key] = check_int(f"split[{key!r}]", d)
    return out


def _split_dims(owner, args, kwargs, leaves, positions, d, n) -> list:
    """Per tensor leaf of (args, kwargs): the dimension it is split along, or None (whole to every tile)."""
    where = {}  # id(tensor) -> dim, for the top-level arguments that are split
    where[id(args[0])] = d
    for key, dd in owner.split.items():
        value = args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key) if isinstance(key, str) \
            else None
        if value is None:
            continue  # an optional argument left out (a mask given as None)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{owner.name}: split names argument {key!r}, which is a {type(value).__name__}, not a "
                            "tensor")
        ddd = dd + value.dim() if dd < 0 else dd
        if not 0 <= ddd < value.dim() or value.shape[ddd] != n:
            raise ValueError(f"{owner.name}: split[{key!r}]={dd}: argument {key!r} (shape {tuple(value.shape)}) has no "
                             f"dimension of {n} positions there, as the first argument has along dim={owner.dim}")
        where[id(value)] = ddd
    out = []
    for i in positions:
        t = leaves[i]
        dd = where.get(id(t))
        if dd is None and t is args[0]:
            dd = d
        out.append(dd)
    return out


@suggest_keywords("co.tiled")
def tiled(function, tile=None, *, tiles=None, dim: int = -2, split=None, reduce=None, out_dim=None, params=None,
          token_wise=None, preserve_rng_state: bool = True, measure_error: bool = False) -> Tiled:
    """``function`` run over tiles of the sequence: its forward keeps no intermediate (only its
    inputs are saved for backward, where saved-tensor hooks such as ``co.offload``'s see them), and
    its backward recomputes and differentiates one tile at a time.

    For **token-wise** functions only: an MLP, a norm, an LM head with its loss -- functions whose
    output at one position depends on that position alone. Modules known to mix positions
    (attention, ``nn.MultiheadAttention``, recurrent and convolutional layers, batch or group norm,
    or a submodule named like ``attn``/``attention``) are refused; for anything else it is your
    promise.

    Args:
        function: a module or a callable. Its first positional argument is the tensor tiled along
            ``dim``; other tensor arguments go whole to every tile unless ``split`` names them.
        tile: positions per tile along ``dim`` (an int), or bytes of the first argument per tile (a
            size string, ``"64MiB"``); ``None``/``"auto"``: as many positions as the last dimension
            is wide (the hidden size: DeepSpeed's TiledMLP rule). With a batch of ``B`` sequences
            and ``dim`` the sequence dimension, a tile holds ``B * tile`` tokens.
        tiles: how many tiles instead (not with ``tile``).
        dim: the first argument's token dimension (default -2: ``(batch, seq, hidden)`` and
            ``(seq, hidden)``).
        split: other arguments tiled with the first, ``{position or keyword: their dimension}``,
            e.g. ``{1: -1}`` for labels ``(batch, seq)`` passed second.
        reduce: ``None`` (outputs are per position: concatenated along ``out_dim``) or ``"sum"``
            (outputs summed over tiles: a loss with ``reduction="sum"``).
        out_dim: the outputs' token dimension (default: ``dim``).
        params: tensors the function reads besides its arguments and, for a module, its own
            parameters. Usually not needed: the first call records the parameters a function reads
            (a lambda over a head works) and refuses activations it closes over.
        token_wise: ``True`` skips the refusal of modules known to mix tokens (your promise).
        preserve_rng_state: replay the RNG per tile in backward, so dropout draws what it drew in
            forward (default True, as torch's checkpoint).
        measure_error: also run the function untiled in forward and backward and record the error
            of the tiled outputs and gradients against it in ``stats()["tile_error"]`` (for
            measuring: it costs the untiled memory).

    Forward outputs are those of the untiled call, per token, where the backend computes a row the
    same whatever the number of rows (bit-identical on CPU in the tests); parameter gradients are
    summed over tiles, so they differ from the untiled ones in the last bits (Note [Tiled
    recompute: what is exact]). Nested in ``co.checkpoint`` / ``co.apply`` (offload or not), the
    block's recompute skips the tiled function when it is the block's last saver (its MLP), so
    tiling adds no recompute (Note [Tiled recompute: two nodes]). Under ``torch.compile`` the graph
    breaks at the tiled call and the function is compiled per tile; under ``fullgraph=True`` each
    tile is traced as a checkpoint.

    Returns:
        a :class:`Tiled`, called as the function is.

    Example::

        import ckpt_offload as co

        mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        x = torch.randn(2, 4096, 64, requires_grad=True)
        y = co.tiled(mlp, tile=512)(x)             # 8 tiles; keeps only x for backward
        y.sum().backward()
    """
    return Tiled(function, tile, tiles=tiles, dim=dim, split=split, reduce=reduce, out_dim=out_dim, params=params,
                 token_wise=token_wise, preserve_rng_state=preserve_rng_state, measure_error=measure_error)


# --- the LM head and its loss --------------------------------------------------------------------

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
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing)


@suggest_keywords("co.tiled_cross_entropy")
def tiled_cross_entropy(hidden: torch.Tensor, head, labels: torch.Tensor, *, tile=None, tiles=None,
                        ignore_index: int = -100, reduction: str = "mean", upcast: bool = True,
                        label_smoothing: float = 0.0, measure_error: bool = False) -> torch.Tensor:
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
        raise ValueError(f"labels must have the shape of hidden without its last dimension, "
                         f"{tuple(hidden.shape[:-1])}; got {tuple(labels.shape)}")
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
                raise ValueError(f"tile={tile!r} gives bytes of logits per tile, but the vocabulary of head "
                                 f"({type(head).__name__}) cannot be read (it is not a Linear); pass tile= as a token "
                                 "count")
            tokens = 1024
        else:
            tokens = max(1, (nbytes or _DEFAULT_HEAD_TILE_BYTES) // (vocab * (4 if upcast else hidden.element_size())))
    per_tile = "none" if reduction == "none" else "sum"
    wrapper = Tiled(_HeadLoss(head, ignore_index, per_tile, upcast, label_smoothing), tokens, tiles=count, dim=0,
                    split={1: 0}, reduce=None if reduction == "none" else "sum", out_dim=0,
                    params=_params_of(head), token_wise=True, measure_error=measure_error,
                    name="co.tiled_cross_entropy")
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
