"""Tiling a model's token-wise parts in place: ``co.tile``, and the ``tile=`` option of the routes.

:func:`tile` installs a :class:`~ckpt_offload.tiling.Tiled` run as the ``forward`` of modules (in
their ``__dict__``, as ``co.apply`` wraps blocks): parameters and ``state_dict()`` keys do not change,
and :meth:`TileHandle.remove` puts back the forward each module had. ``co.apply(model, tile=...)``,
``co.hf.enable(model, tile=...)`` and the Trainer callback call it with the MLPs they find by
structure in the blocks they checkpoint (:func:`find_mlps`), and for a Hugging Face causal LM also
fuse its head and loss (``ckpt_offload.integrations.hf.head``).

:class:`TileOptions` is the ``tile=`` option of those routes, one frozen value as
:class:`~ckpt_offload.OffloadOptions` is for ``offload=``.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys

import torch

from ckpt_offload._args import suggest_keywords
from ckpt_offload._args import check_int
from ckpt_offload.tiling.mixing import mixing_reason
from ckpt_offload.tiling.tiles import _check_tile
from ckpt_offload.tiling.wrapper import _STATS_KEYS, Tiled

__all__ = [
    "TileHandle",
    "TileOptions",
    "TiledForward",
    "as_tile_options",
    "find_mlps",
    "find_norms",
    "tile",
    "tile_blocks",
]


@dataclasses.dataclass(frozen=True)
class TileOptions:
    """The ``tile=`` option of ``co.apply``, ``co.hf.enable``, ``co.hf.OffloadCheckpointCallback``
    and ``co.plan``: which token-wise parts of each block run tiled, and how large a tile is.

    Fields: ``tile`` (positions per tile, an int; or bytes of the input per tile, a size string;
    ``None``: as many positions as the hidden size), ``tiles`` (a count instead), ``mlp`` (tile each
    block's MLP, default True), ``norms`` (tile each block's norms too, default True: a bf16 RMSNorm
    keeps float32 copies of its input, measured at about 10 hidden-widths per token for a decoder
    layer's two; recomputing a norm is cheap), ``head``
    (fuse a Hugging Face causal LM's head with its loss, tiled, default True), ``head_tile`` (tokens
    per tile of the head, or bytes of a tile's float32 logits; default 256 MiB of logits),
    ``measure_error`` (measure each tiled call against the untiled one; for measuring).

    ``tile=True`` is ``TileOptions()``, ``tile=4096`` is ``TileOptions(tile=4096)``,
    ``tile="32MiB"`` is ``TileOptions(tile="32MiB")``, and a dict gives the fields by name.

    Example::

        co.apply(model, offload=True, tile=co.TileOptions(tile=2048, norms=False))   # MLPs only
        co.apply(model, offload=True, tile=2048)          # MLPs and norms, tiles of 2048 positions
    """

    tile: int | str | None = None
    tiles: int | None = None
    mlp: bool = True
    norms: bool = True
    head: bool = True
    head_tile: int | str | None = None
    measure_error: bool = False

    def __post_init__(self):
        _check_tile(self.tile, self.tiles)
        _check_tile(self.head_tile, None, name="head_tile")
        for name in ("mlp", "norms", "head", "measure_error"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TileOptions.{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.mlp or self.norms or self.head):
            raise ValueError(
                "TileOptions with mlp=False, norms=False and head=False tiles nothing; pass tile=False "
                "(or leave tile out) instead"
            )

    def tiled_kwargs(self) -> dict:
        """What :class:`~ckpt_offload.tiling.Tiled` takes for the blocks' parts."""
        return {"tile": self.tile, "tiles": self.tiles, "measure_error": self.measure_error}


# A misspelled field names the right one (the dataclass's own __init__ would not).
TileOptions.__init__ = suggest_keywords("co.TileOptions")(TileOptions.__init__)


def as_tile_options(value, name: str = "tile") -> TileOptions | None:
    """``tile=`` of a route as :class:`TileOptions` (None: no tiling). Raises naming ``name``.

    Example::

        as_tile_options(4096)        # TileOptions(tile=4096)
        as_tile_options(False)       # None
    """
    if value is None or value is False:
        return None
    if value is True:
        return TileOptions()
    if isinstance(value, TileOptions):
        return value
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return TileOptions(tile=value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(TileOptions)}
        unknown = sorted(set(value) - fields)
        if unknown:
            from ckpt_offload._args import closest

            hints = [
                f"{k!r}" + (f" (did you mean {closest(k, fields)!r}?)" if closest(k, fields) else "") for k in unknown
            ]
            raise TypeError(f"{name}: unknown option(s) {', '.join(hints)}; TileOptions takes {sorted(fields)}")
        return TileOptions(**value)
    raise TypeError(
        f"{name} must be True/False/None, an int (positions per tile), a size string ('32MiB': bytes "
        f"per tile), a dict of TileOptions fields or a co.TileOptions; got {type(value).__name__} "
        f"({value!r})"
    )


# --- installing ----------------------------------------------------------------------------------

_MARK = "_ckpt_offload_tiled"


class _OwnForward:
    """A module's own forward (the instance-level one it had, or its class's), called by the
    :class:`Tiled` that replaced it. ``__self__`` is the module, so the wrapper reads its
    parameters and checks it as it does for a bound method. Picklable, no closures."""

    def __init__(self, module, original=None):
        self.__self__ = module
        self.original = original

    def __call__(self, *args, **kwargs):
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.__self__).forward(self.__self__, *args, **kwargs)


class TiledForward:
    """The ``forward`` that :func:`tile` sets on a module (in its ``__dict__``): its own forward run
    by a :class:`~ckpt_offload.tiling.Tiled` (``.tiled``)."""

    def __init__(self, module: torch.nn.Module, tiled: Tiled, original=None):
        self.module = module
        self.original = original
        self.tiled = tiled

    def install(self) -> None:
        self.module.__dict__["forward"] = self
        self.module.__dict__[_MARK] = True

    @staticmethod
    def uninstall(module: torch.nn.Module) -> None:
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, TiledForward) and wrapper.original is not None:
            module.__dict__["forward"] = wrapper.original
        else:
            module.__dict__.pop("forward", None)
        module.__dict__.pop(_MARK, None)

    def __call__(self, *args, **kwargs):
        return self.tiled(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<ckpt_offload tiled forward of {type(self.module).__name__}: {self.tiled!r}>"


def _install(module, name, options: TileOptions, dim: int, token_wise, route: str):
    if _MARK in module.__dict__:
        raise RuntimeError(
            f"{route}: {name or type(module).__name__} is already tiled; call .remove() on the handle "
            "that tiled it first"
        )
    original = module.__dict__.get("forward")
    tiled = Tiled(_OwnForward(module, original), dim=dim, token_wise=token_wise, name=route, **options.tiled_kwargs())
    TiledForward(module, tiled, original).install()
    return tiled


class TileHandle:
    """Returned by :func:`tile` (and kept as ``handle.tiles`` by ``co.apply`` / ``co.hf.enable``):
    which modules run tiled (:attr:`names`, :attr:`kinds`), their counts (:meth:`stats`), and
    :meth:`remove`.

    Example::

        handle = co.tile(model.layers[0].mlp, tile=1024)
        print(handle.names, handle.stats()["tiles"])
        handle.remove()
    """

    def __init__(self, modules: list, names: list, kinds: list, tiled: list, extra_remove=()):
        self._modules = modules
        self.names = names  #: qualified names of the tiled modules ("" for the module itself)
        self.kinds = kinds  #: per module: "mlp", "norm", "module" or "head"
        self._tiled = tiled
        self._extra_remove = list(extra_remove)
        self.removed = False

    @property
    def tiled(self) -> list:
        """The :class:`~ckpt_offload.tiling.Tiled` objects, one per name."""
        return list(self._tiled)

    def stats(self) -> dict:
        """The sums of the tiled calls' ``stats()`` (``largest_tile``: the largest), and with
        ``measure_error`` the errors of all of them per class (``tile_error``)."""
        out: dict = dict.fromkeys(_STATS_KEYS, 0)
        errors: dict = {}
        for t in self._tiled:
            s = t.stats()
            for k, v in out.items():
                out[k] = max(v, s[k]) if k == "largest_tile" else v + s[k]
            for cls, e in (s.get("tile_error") or {}).items():
                have = errors.get(cls)
                if have is None:
                    errors[cls] = dict(e)
                    continue
                n = have["tensors"] + e["tensors"]
                have["mean_rel_error"] = (
                    have["mean_rel_error"] * have["tensors"] + e["mean_rel_error"] * e["tensors"]
                ) / max(n, 1)
                have["max_rel_error"] = max(have["max_rel_error"], e["max_rel_error"])
                have["bit_identical"] = have["bit_identical"] and e["bit_identical"]
                have["tensors"] = n
        if any(t.measure_error for t in self._tiled):
            out["tile_error"] = errors
        return out

    def reset_stats(self) -> None:
        for t in self._tiled:
            t.reset_stats()

    def remove(self) -> None:
        """Puts back every tiled module's own forward. Calling it twice is harmless."""
        if self.removed:
            return
        for m in self._modules:
            TiledForward.uninstall(m)
        for undo in self._extra_remove:
            undo()
        self.removed = True

    def __repr__(self) -> str:
        return f"TileHandle({len(self.names)} modules: {self.kinds}, removed={self.removed})"


# --- finding the token-wise parts ----------------------------------------------------------------

# Attribute names and class names of a transformer block's MLP: Hugging Face's Llama / Qwen2 /
# Mistral / GPT-2 ("mlp"), others' "feed_forward" / "ffn", T5's "DenseReluDense" inside "layer".
_MLP_NAMES = ("mlp", "feed_forward", "feedforward", "ffn", "ff", "mlp_block", "ffw")
_MLP_CLASS = re.compile(r"mlp|feedforward|feed_forward|ffn|swiglu|geglu", re.IGNORECASE)
# A mixture of experts routes tokens with per-batch capacities and auxiliary losses over all tokens:
# never tiled by structure (co.tile(module, token_wise=True) is the caller's promise).
_MOE = re.compile(r"expert|moe|router|sparse", re.IGNORECASE)
_NORM_CLASS = re.compile(r"norm", re.IGNORECASE)


def _has_weights(module) -> bool:
    return any(p.dim() == 2 for p in module.parameters())


def _is_mlp(attr: str, module) -> bool:
    if not (attr.lower() in _MLP_NAMES or _MLP_CLASS.search(type(module).__name__)):
        return False
    if not _has_weights(module) or mixing_reason(module) is not None:
        return False
    return not any(_MOE.search(n) or _MOE.search(type(m).__name__) for n, m in module.named_modules())


def _is_norm(module) -> bool:
    return (
        bool(_NORM_CLASS.search(type(module).__name__))
        and not list(module.children())
        and mixing_reason(module) is None
    )


def find_mlps(named_blocks) -> list:
    """``[(name, module), ...]``: the MLP of each block, found by structure: a direct child named
    like an MLP (``mlp``, ``feed_forward``, ``ffn``, ...) or whose class is (``LlamaMLP``,
    ``SwiGLU``, ``FeedForward``), holding weight matrices, neither mixing tokens nor routing them
    to experts.

    Example::

        find_mlps([("layers.0", model.layers[0])])    # [("layers.0.mlp", model.layers[0].mlp)]
    """
    out = []
    for bname, block in named_blocks:
        for attr, child in block.named_children():
            if _is_mlp(attr, child):
                out.append((f"{bname}.{attr}" if bname else attr, child))
    return out


def find_norms(named_blocks) -> list:
    """``[(name, module), ...]``: the norms that are direct children of each block (LayerNorm,
    RMSNorm and the like: a class named ``*Norm*`` without children, neither batch nor group norm).

    Example::

        find_norms([("blocks.0", model.blocks[0])])   # [("blocks.0.ln1", ...), ("blocks.0.ln2", ...)]
    """
    out = []
    for bname, block in named_blocks:
        for attr, child in block.named_children():
            if _is_norm(child):
                out.append((f"{bname}.{attr}" if bname else attr, child))
    return out


def tile_blocks(model, named_blocks, options: TileOptions, route: str) -> TileHandle:
    """Tiles, in place, the MLPs (and with ``options.norms`` the norms) of ``named_blocks`` and,
    with ``options.head``, a Hugging Face causal LM's head and loss: what ``co.apply(..., tile=...)``
    and ``co.hf.enable(..., tile=...)`` do. Raises when the blocks have no MLP to tile.

    Example::

        handle = tile_blocks(model, select_blocks(model, None), TileOptions(tile=1024), "co.apply")
        handle.remove()
    """
    found = []
    if options.mlp:
        found += [(n, m, "mlp") for n, m in find_mlps(named_blocks)]
    if options.norms:
        found += [(n, m, "norm") for n, m in find_norms(named_blocks)]
    head_undo = None
    if options.head:
        head_undo = _fuse_hf_head(model, options, route)
    if not found and head_undo is None:
        what = " or norm" if options.norms else ""
        block = type(named_blocks[0][1]).__name__ if named_blocks else "none"
        raise ValueError(
            f"{route}(tile=...): found no MLP{what} in the blocks ({block}): a token-wise child named 'mlp' / "
            "'feed_forward' / 'ffn' or whose class is named like an MLP. Tile the module yourself with "
            "co.tile(block.<its MLP>, tile=...), or leave tile= out."
        )
    modules, names, kinds, tiled = [], [], [], []
    try:
        for name, module, kind in found:
            tiled.append(_install(module, name, options, -2, None, route))
            modules.append(module)
            names.append(name)
            kinds.append(kind)
    except BaseException:
        for m in modules:
            TiledForward.uninstall(m)
        if head_undo is not None:
            head_undo[0]()
        raise
    extra = []
    if head_undo is not None:
        undo, head_tiled = head_undo
        extra.append(undo)
        names.append("<head>")
        kinds.append("head")
        tiled.append(head_tiled)
    return TileHandle(modules, names, kinds, tiled, extra)


#: Functions ``fuser(model, options, route) -> (undo, tiled) | None`` that fuse a model's head with
#: its loss, tiled; an integration registers its own when it is imported (Hugging Face's:
#: ckpt_offload/integrations/hf/head.py), so that this module imports no integration.
HEAD_FUSERS: list = []


def _fuse_hf_head(model, options, route):
    """``(undo, tiled)`` when a registered fuser fuses ``model``'s head with its loss; None otherwise.
    A Hugging Face model loads the Hugging Face integration first (``co.hf``), which registers its fuser."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, getattr(transformers, "PreTrainedModel", ())):
        # The integration registers its fuser in HEAD_FUSERS when imported (a registry, so that this
        # module imports nothing above it).
        importlib.import_module("ckpt_offload.integrations.hf.head")
    for fuser in HEAD_FUSERS:
        fused = fuser(model, options, route)
        if fused is not None:
            return fused
    return None


@suggest_keywords("co.tile")
def tile(
    module: torch.nn.Module,
    tile=None,
    *,
    tiles=None,
    modules=None,
    dim: int = -2,
    token_wise=None,
    measure_error: bool = False,
) -> TileHandle:
    """Runs ``module`` (or the submodules ``modules`` selects) tiled along the sequence, in place:
    its ``forward`` becomes a :func:`~ckpt_offload.tiled` call of its own forward. Parameters,
    ``state_dict()`` keys and hooks do not change; the returned handle's ``remove()`` undoes it.

    Args:
        module: the module to tile, or the model to search with ``modules``.
        tile, tiles, dim, token_wise, measure_error: as :func:`~ckpt_offload.tiled` (``tile``:
            positions per tile, or a size string for bytes of the input per tile; ``None``: the
            hidden size).
        modules: ``None`` tiles ``module`` itself; ``"mlp"`` tiles every MLP found by structure in
            ``module``'s children and deeper (as ``co.apply(tile=...)`` finds them in blocks); an
            ``nn.Module`` class tiles every submodule of that class; a predicate
            ``modules(name, submodule) -> bool`` tiles what it accepts (outermost matches).

    Modules that mix tokens (attention, recurrence, convolution, batch norm; see
    :func:`~ckpt_offload.tiling.mixing_reason`) are refused unless ``token_wise=True``.

    Example::

        import ckpt_offload as co

        handle = co.tile(model, tile=1024, modules="mlp")      # every block's MLP
        loss = model(x).sum(); loss.backward()
        handle.remove()
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"module must be an nn.Module (use co.tiled(function) for a function), got {type(module).__name__}"
        )
    options = TileOptions(tile=tile, tiles=tiles, measure_error=measure_error)
    check_int("dim", dim)
    if modules is None:
        found = [("", module, "module")]
    elif modules == "mlp":
        found = []
        for name, sub in module.named_modules():
            if any(name.startswith(f + ".") for f, _, _ in found):
                continue
            attr = name.rpartition(".")[2]
            if name and _is_mlp(attr, sub):
                found.append((name, sub, "mlp"))
    elif isinstance(modules, type) and issubclass(modules, torch.nn.Module):
        found = [(n, m, "module") for n, m in module.named_modules() if isinstance(m, modules)]
    elif callable(modules) and not isinstance(modules, (str, type)):
        found = [(n, m, "module") for n, m in module.named_modules() if modules(n, m)]
    else:
        raise TypeError(
            f"modules must be None, 'mlp', an nn.Module subclass or a predicate modules(name, module) -> "
            f"bool; got {modules!r}"
        )
    outer = []
    for name, sub, kind in found:
        if not any(name.startswith(o + ".") for o, _, _ in outer if o):
            outer.append((name, sub, kind))
    if not outer:
        raise ValueError(f"co.tile: modules={modules!r} selects nothing in {type(module).__name__}")
    installed, tiled = [], []
    try:
        for name, sub, _kind in outer:
            tiled.append(_install(sub, name, options, dim, token_wise, "co.tile"))
            installed.append(sub)
    except BaseException:
        for m in installed:
            TiledForward.uninstall(m)
        raise
    return TileHandle(installed, [n for n, _, _ in outer], [k for _, _, k in outer], tiled)
