"""Which blocks of a model are "the blocks": ``layers=`` of co.apply, co.hf.enable and co.plan --
a block class, a predicate, or by default the list of same-class blocks holding the most
parameters (never a mixture-of-experts list)."""

from __future__ import annotations

import torch

from ckpt_offload._warn import logger, warn_at_user_line

__all__ = ["select_blocks"]


def _is_expert_list(name: str) -> bool:
    """A mixture-of-experts list: its members run for some tokens each, not one after another,
    so they are never "the blocks" (checkpointing them would recompute per expert)."""
    last = name.rsplit(".", 1)[-1].lower()
    return "expert" in last


def _largest_block_list(model: torch.nn.Module):
    """The list of same-class blocks (2 or more) holding the most of the model's parameters;
    warns when another list holds nearly as many (say which, and how to pass layers=)."""
    candidates = []  # (params, count, name, blocks)
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or _is_expert_list(name):
            continue
        children = list(mod.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        prefix = f"{name}." if name else ""
        candidates.append((size, len(children), name, [(prefix + n, c) for n, c in children]))
    if not candidates:
        return []
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    best = candidates[0]
    for other in candidates[1:]:
        nested = best[2] == "" or other[2].startswith(best[2] + ".") or best[2].startswith(other[2] + ".")
        if not nested and best[0] > 0 and other[0] >= 0.8 * best[0]:
            block = type(best[3][0][1]).__name__
            warn_at_user_line(
                f"co.apply: two lists of blocks hold a similar share of the parameters: {best[2] or '<model>'!r} "
                f"({best[1]} x {block}, {best[0]} parameters, chosen) and {other[2]!r} ({other[1]} x "
                f"{type(other[3][0][1]).__name__}, {other[0]} parameters). Pass layers= to choose, e.g. "
                f"co.apply(model, layers={block}) or layers=lambda name, m: name.startswith({best[2] + '.'!r}).",
                key="co.apply-ambiguous",
            )
            break
    logger.info("co.apply: checkpointing %d x %s in %r", best[1], type(best[3][0][1]).__name__, best[2])
    return best[3]


def select_blocks(model: torch.nn.Module, layers, route: str = "co.apply"):
    """``[(name, block), ...]``: the blocks ``layers`` selects in ``model`` (see :func:`apply`),
    outermost matches only; raises ValueError naming ``route`` when there are none."""
    if layers is None:
        found = _largest_block_list(model)
        what = "list of identical blocks (an nn.ModuleList or nn.Sequential of 2 or more modules of one class)"
    elif isinstance(layers, type) and issubclass(layers, torch.nn.Module):
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, layers) and m is not model]
        what = f"submodule of class {layers.__name__}"
    elif isinstance(layers, type):
        # A class is callable, but calling it as a predicate would fail with an unrelated error.
        raise TypeError(
            f"layers is the class {layers.__name__}, which is not an nn.Module subclass; pass None, "
            "an nn.Module subclass (the block class), or a predicate layers(name, module) -> bool"
        )
    elif callable(layers):
        found = [(n, m) for n, m in model.named_modules() if m is not model and layers(n, m)]
        what = "submodule for which layers(name, module) is true"
    else:
        raise TypeError(
            "layers must be None, an nn.Module subclass, or a predicate layers(name, module) -> bool; "
            f"got {type(layers).__name__}"
        )
    # A match nested inside another match would be checkpointed twice: keep the outermost.
    outer = []
    for name, mod in found:
        if not any(name.startswith(o + ".") for o, _ in outer):
            outer.append((name, mod))
    if not outer:
        raise ValueError(
            f"{route} found no {what} in {type(model).__name__}. Pass layers=<the block class> "
            "(for example layers=type(model.layers[0])) or a predicate layers=lambda name, module: ..."
        )
    return outer
