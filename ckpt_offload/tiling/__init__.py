"""Sequence-tiled recompute: a token-wise function run over tiles of the sequence, nothing of it kept.

``co.tiled(function, tile=...)`` wraps a function that treats every token on its own -- an MLP, a
norm, the LM head with its loss -- so that its forward runs over tiles of the sequence dimension
without keeping any intermediate (only its inputs are saved for backward), and its backward
recomputes and differentiates one tile at a time, summing the parameters' gradients over the tiles.
At long context the largest part of a transformer layer's working set is its MLP's intermediates
(a SwiGLU keeps four tensors of the MLP's width per token); tiled, that part shrinks to one tile's.

``wrapper.py`` holds :class:`Tiled` and ``co.tiled``; ``nodes.py`` the two autograd nodes that
save the inputs and recompute each tile in backward (Note [Tiled recompute: two nodes], Note [Tiled
recompute: what is exact]), over ``call.py`` (one tiled call), ``replay.py`` (RNG and autocast, as
torch's checkpoint replays them) and ``tile_error.py`` (``measure_error``); ``tiles.py`` how a call
is cut, ``params.py`` the parameters a function reads, ``mixing.py`` which functions are refused;
``cross_entropy.py`` holds ``co.tiled_cross_entropy``.
"""

from ckpt_offload.tiling.cross_entropy import tiled_cross_entropy
from ckpt_offload.tiling.mixing import mixing_reason
from ckpt_offload.tiling.wrapper import TILED_COMPILE_MESSAGE, Tiled, tiled

__all__ = ["TILED_COMPILE_MESSAGE", "Tiled", "mixing_reason", "tiled", "tiled_cross_entropy"]
