"""``co.tiled``: :class:`Tiled`, a token-wise function run over tiles of the sequence -- its
arguments checked, each call cut into tiles (``tiles.py``) and run through the two autograd nodes
of ``nodes.py``, or traced tile by tile under ``torch.compile(fullgraph=True)`` -- and its counts."""

from __future__ import annotations

import threading

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_offload._args import check_int, suggest_keywords
from ckpt_offload._compile import (
    compiled_forward,
    fullgraph_tracing,
    skip_frame_only,
    skipped_by_dynamo,
    watch_for_dynamo,
)
from ckpt_offload._compile import eager as eager_code
from ckpt_offload.tiling.call import _Call
from ckpt_offload.tiling.mixing import _owner_module, mixing_reason
from ckpt_offload.tiling.nodes import _run_tiles, _SaveInputs, _TiledCompute
from ckpt_offload.tiling.params import _check_params, find_params
from ckpt_offload.tiling.replay import _autocast_state, _device_type, _RngState
from ckpt_offload.tiling.tile_error import _measure_forward
from ckpt_offload.tiling.tiles import _check_split, _check_tile, _positions_per_tile, _split_dims, _tiles

__all__ = ["TILED_COMPILE_MESSAGE", "Tiled", "tiled"]

#: Why Dynamo does not trace a tiled call into the graph around it (the graph breaks there; the
#: function itself is compiled, tile by tile). fullgraph=True takes the traced route instead.
TILED_COMPILE_MESSAGE = (
    "co.tiled: the tiled call runs its tiles in eager code (an autograd function whose backward "
    "recomputes each tile), so Dynamo breaks the graph there and compiles the tiled function itself, "
    "once per tile shape. Under fullgraph=True the tiles are traced into the graph instead, each "
    "under torch's checkpoint."
)


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

    def __init__(
        self,
        function,
        tile=None,
        *,
        tiles=None,
        dim: int = -2,
        split=None,
        reduce=None,
        out_dim=None,
        params=None,
        token_wise=None,
        preserve_rng_state: bool = True,
        measure_error: bool = False,
        name: str = "co.tiled",
    ):
        if not callable(function):
            raise TypeError(
                f"{name}: function must be callable (a module or a function of tensors), got {type(function).__name__}"
            )
        self.tile, self.tile_bytes, self.tiles = _check_tile(tile, tiles)
        self.dim = check_int("dim", dim)
        self.split = _check_split(split)
        if reduce not in _REDUCES:
            raise ValueError(
                f"reduce must be None (outputs concatenated along out_dim) or 'sum' (outputs summed over "
                f"tiles, e.g. a loss with reduction='sum'); got {reduce!r}"
            )
        self.reduce = reduce
        self.out_dim = check_int("out_dim", out_dim, allow_none=True)
        for arg, value in (("preserve_rng_state", preserve_rng_state), ("measure_error", measure_error)):
            if not isinstance(value, bool):
                raise TypeError(f"{arg} must be True or False, got {value!r}")
        if token_wise not in (None, True):
            raise ValueError(
                "token_wise must be None (refuse modules known to mix tokens) or True (your promise "
                f"that the function treats every position on its own); got {token_wise!r}"
            )
        self.function = function
        self.module = _owner_module(function)
        if token_wise is None and self.module is not None:
            why = mixing_reason(self.module)
            if why is not None:
                raise ValueError(
                    f"{name}: {type(self.module).__name__} mixes tokens: {why}. A tiled call computes each tile "
                    "of the sequence on its own, so the output at one position could not depend on other tiles: "
                    "tile only token-wise parts (an MLP, a norm, the LM head and its loss). If this module is "
                    "token-wise all the same, pass token_wise=True (your promise)."
                )
        self.params = None if params is None else _check_params(params)
        self.preserve_rng_state = preserve_rng_state
        self.measure_error = measure_error
        self.name = name
        self._found: list | None = None  # parameters found at the first call (_find_params)
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
        size = (
            f"tile={self.tile}"
            if self.tile is not None
            else f"tile={self.tile_bytes}B"
            if self.tile_bytes is not None
            else f"tiles={self.tiles}"
            if self.tiles is not None
            else "tile='auto'"
        )
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
            raise TypeError(
                f"{self.name}: the first positional argument is the tensor to tile (e.g. hidden states "
                f"(batch, seq, hidden)); got {got}"
            )
        x = args[0]
        if x.dim() == 0:
            raise ValueError(f"{self.name}: the first argument is a 0-dimensional tensor: there is nothing to tile")
        d = self.dim + x.dim() if self.dim < 0 else self.dim
        if not 0 <= d < x.dim():
            raise ValueError(
                f"dim={self.dim} is not a dimension of the first argument (shape {tuple(x.shape)}); "
                f"pass the sequence dimension, e.g. dim=1 for (batch, seq, hidden)"
            )
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
        """The parameters the function reads, found at its first call (``params.py``:
        Note [Parameters a tiled function reads])."""
        known = {id(t) for t in tensors} | {id(p) for p in self._params()}
        self._found = find_params(self.name, self.function, call, tensors, known)

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
            tile_tensors = [
                t if dd is None else t.narrow(dd, start, length).contiguous() for t, dd in zip(tensors, dims)
            ]
            parts.append(torch_checkpoint.checkpoint(region, *tile_tensors, use_reentrant=False))
        single = isinstance(parts[0], torch.Tensor)
        cols = [[p] if single else list(p) for p in parts]
        out_dim = self.out_dim if self.out_dim is not None else self.dim
        if self.reduce == "sum":
            outs = [
                sum(c[j] for c in cols[1:]) + cols[0][j] if len(cols) > 1 else cols[0][j] for j in range(len(cols[0]))
            ]
        else:
            outs = [torch.cat([c[j] for c in cols], dim=out_dim) for j in range(len(cols[0]))]
        return outs[0] if single else tuple(outs)


@suggest_keywords("co.tiled")
def tiled(
    function,
    tile=None,
    *,
    tiles=None,
    dim: int = -2,
    split=None,
    reduce=None,
    out_dim=None,
    params=None,
    token_wise=None,
    preserve_rng_state: bool = True,
    measure_error: bool = False,
) -> Tiled:
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
    return Tiled(
        function,
        tile,
        tiles=tiles,
        dim=dim,
        split=split,
        reduce=reduce,
        out_dim=out_dim,
        params=params,
        token_wise=token_wise,
        preserve_rng_state=preserve_rng_state,
        measure_error=measure_error,
    )
