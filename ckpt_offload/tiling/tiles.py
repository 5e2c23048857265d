"""How a tiled call is cut: the tile size (positions per tile, bytes of the first argument per tile,
or a number of tiles; ``"auto"``: as many positions as the input is wide), the tiles along the
sequence, and which arguments are cut along which dimension (the first always; others as
``split=`` names them)."""

from __future__ import annotations

import math

import torch

from ckpt_offload._args import check_int, parse_bytes


def _check_tile(tile, tiles, name="tile"):
    """``tile`` (tokens: an int; bytes: a size string) and ``tiles`` (a count) checked; returns
    (tokens or None, bytes or None, count or None)."""
    if tile is not None and tiles is not None:
        raise ValueError(
            f"give {name}= (tokens per tile, or a size string for bytes per tile) or tiles= (how many "
            f"tiles), not both; got {name}={tile!r}, tiles={tiles!r}"
        )
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
        raise TypeError(
            f"{name} must be an int (tokens per tile), a size string such as '64MiB' (bytes per tile), "
            f"'auto' or None; got {type(tile).__name__} ({tile!r})"
        )
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


def _check_split(split) -> dict:
    if split is None:
        return {}
    if not isinstance(split, dict):
        raise TypeError(
            "split must be a dict {argument position (int >= 1) or keyword (str): its token dimension}, "
            f"e.g. split={{1: -1}} for labels (batch, seq) given second; got {type(split).__name__}"
        )
    out = {}
    for key, d in split.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)) or (isinstance(key, int) and key < 1):
            raise ValueError(
                f"split: {key!r} is not an argument position >= 1 (the first argument is always split) "
                "or a keyword name"
            )
        out[key] = check_int(f"split[{key!r}]", d)
    return out


def _split_dims(owner, args, kwargs, leaves, positions, d, n) -> list:
    """Per tensor leaf of (args, kwargs): the dimension it is split along, or None (whole to every tile)."""
    where = {}  # id(tensor) -> dim, for the top-level arguments that are split
    where[id(args[0])] = d
    for key, dd in owner.split.items():
        value = (
            args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key) if isinstance(key, str) else None
        )
        if value is None:
            continue  # an optional argument left out (a mask given as None)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{owner.name}: split names argument {key!r}, which is a {type(value).__name__}, not a tensor"
            )
        ddd = dd + value.dim() if dd < 0 else dd
        if not 0 <= ddd < value.dim() or value.shape[ddd] != n:
            raise ValueError(
                f"{owner.name}: split[{key!r}]={dd}: argument {key!r} (shape {tuple(value.shape)}) has no "
                f"dimension of {n} positions there, as the first argument has along dim={owner.dim}"
            )
        where[id(value)] = ddd
    out = []
    for i in positions:
        t = leaves[i]
        dd = where.get(id(t))
        if dd is None and t is args[0]:
            dd = d
        out.append(dd)
    return out
