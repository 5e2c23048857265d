"""The autograd core of a tiled call: its tiles run in forward with no graph, and two autograd
nodes whose backward recomputes and differentiates them one tile at a time.

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

import torch

from ckpt_offload.tiling.call import _Call, _float
from ckpt_offload.tiling.replay import _autocast
from ckpt_offload.tiling.tile_error import _measure_backward


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
        raise ValueError(
            f"co.tiled: out_dim={call.out_dim} is not a dimension of the function's output (shape "
            f"{tuple(part.shape)}); pass out_dim= (the output's token dimension) or reduce='sum' for "
            "outputs without one"
        )
    if part.shape[d] != call.tiles[0][1]:
        raise ValueError(
            f"co.tiled: the function's output has {part.shape[d]} positions along out_dim={call.out_dim} "
            f"for a tile of {call.tiles[0][1]}; a token-wise function returns one row per input row. "
            "Pass out_dim= (the output's token dimension) or reduce='sum' (outputs summed over tiles)"
        )
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
        ctx.params = flat[call.n_tensors :]
        outs = _run_tiles(call, flat[: call.n_tensors])
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
                "as they are now, so an in-place change between forward and backward would give a wrong gradient."
            )


def _tile_backward(call: _Call, saved, params, grads):
    """The gradients of a tiled call's tensors and parameters, one tile at a time."""
    _check_versions(call, params)
    n_t = call.n_tensors
    # The inputs as leaves of the recompute: split tensors are cut per tile, the rest is shared.
    whole = [
        t.detach().requires_grad_(t.requires_grad) if d is None and _float(t) else t for t, d in zip(saved, call.dims)
    ]
    split_grads = [torch.empty_like(t) if d is not None and t.requires_grad else None for t, d in zip(saved, call.dims)]
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
            got = (
                list(torch.autograd.grad(diff_outs, wanted, diff_grads, allow_unused=True))
                if diff_outs and wanted
                else [None] * len(wanted)
            )
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
