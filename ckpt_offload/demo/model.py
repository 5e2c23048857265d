"""A small built-in decoder-only transformer, for the demo and the tests.

Pure PyTorch, no extra dependencies, runs on CPU and CUDA. Attention is written out
(``q @ k^T``, causal mask, softmax, dropout, ``@ v``) rather than calling
``F.scaled_dot_product_attention``, for two reasons:

* every intermediate is an ordinary saved tensor that :func:`ckpt_offload.offload` sees
  (the attention probabilities and their dropout mask are the largest activations), and
* the fused CUDA attention kernels can accumulate gradients with atomics, which would make
  "gradients are bit-identical with and without offload" untestable on a GPU.

Example::

    from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_config, make_batch

    cfg = make_config("small")
    model = TinyTransformer(**cfg.model_kwargs(), seed=0)
    tokens = make_batch(cfg, batch=cfg.batch, seed=0)          # (batch, seq + 1) int64
    loss = lm_loss(model, tokens)
    loss.backward()
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TinyTransformer",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "TinyConfig",
    "CONFIGS",
    "make_config",
    "preset_config",
    "make_batch",
    "lm_loss",
]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection.

    Args:
        dim: model width; must be divisible by ``heads``.
        heads: number of attention heads.
        seq: the longest sequence the causal mask is built for.
        dropout: dropout on the attention probabilities and on the output projection.
    """

    def __init__(self, dim: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        # True above the diagonal: the positions a token must not attend to. A buffer, so it
        # moves with .to(device); not persistent, so it is not part of the state dict.
        self.register_buffer("future", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
        probs = self.attn_drop(scores.softmax(dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """``Linear(dim, 4*dim) -> GELU -> Linear(4*dim, dim) -> Dropout``."""

    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-2-style decoder-only language model, small enough for a CPU.

    Token embedding + learned position embedding, ``layers`` pre-LayerNorm blocks (causal
    self-attention, GELU MLP, dropout), a final LayerNorm and an (untied) LM head.

    Args:
        vocab: vocabulary size.
        dim: model width (divisible by ``heads``).
        layers: number of blocks.
        heads: attention heads per block.
        seq: the longest input sequence (size of the position table and causal mask).
        dropout: dropout probability used after the embeddings, on attention probabilities,
            and on each residual branch. Default 0.1.
        seed: if given, the weights are initialised from a private ``torch.Generator`` seeded
            with it, so the same seed gives bit-identical weights whatever the global RNG state
            (and the global RNG is left untouched). If ``None``, the global RNG is used.

    ``forward(tokens)`` takes ``(batch, t)`` int64 token ids with ``t <= seq`` and returns
    ``(batch, t, vocab)`` float logits. Weights are created on the CPU; use ``.to(device)``.

    Example::

        model = TinyTransformer(vocab=256, dim=64, layers=2, heads=4, seq=32, seed=0)
        logits = model(torch.randint(0, 256, (2, 32)))      # (2, 32, 256)
    """

    def __init__(
        self,
        vocab: int,
        dim: int,
        layers: int,
        heads: int,
        seq: int,
        dropout: float = 0.1,
        seed: int | None = None,
    ):
        super().__init__()
        for name, value in (("vocab", vocab), ("dim", dim), ("layers", layers), ("heads", heads), ("seq", seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyTransformer: {name} must be a positive int, got {value!r}")
        if dim % heads:
            raise ValueError(f"TinyTransformer: dim ({dim}) must be divisible by heads ({heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"TinyTransformer: dropout must be in [0, 1), got {dropout!r}")
        self.vocab, self.dim, self.seq = vocab, dim, seq
        # With a seed, the submodules' own default initialisation (which draws from the global
        # RNG and is overwritten below anyway) runs on a forked RNG, leaving the caller's alone.
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            self.tok_emb = nn.Embedding(vocab, dim)
            self.pos_emb = nn.Parameter(torch.empty(seq, dim))
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(Block(dim, heads, seq, dropout) for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections scaled
        by ``1/sqrt(2 * layers)``. Deterministic given ``seed`` (see the class docstring)."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * len(self.blocks))
        # named_parameters() has a fixed order, so the generator draws are reproducible.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("attn.proj.weight", "mlp.out.weight")) else 0.02
                # Drawn on the CPU then copied, so CPU and CUDA models get the same weights.
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"TinyTransformer: tokens must be (batch, t), got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.seq:
            raise ValueError(f"TinyTransformer: sequence length {t} is longer than seq={self.seq}")
        x = self.drop(self.tok_emb(tokens) + self.pos_emb[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_parameters(self) -> int:
        """Number of parameter elements."""
        return sum(p.numel() for p in self.parameters())


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: predicts ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    ``tokens`` is ``(batch, t + 1)``; the model sees ``t`` positions. Example::

        loss = lm_loss(model, make_batch(cfg, batch=8, seed=0))
        loss.backward()
    """
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of a :class:`TinyTransformer` plus the batch size the demo and benchmarks use.

    Example::

        cfg = make_config("small", layers=2)        # a preset with one field overridden
        model = TinyTransformer(**cfg.model_kwargs(), seed=0)
    """

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    dropout: float = 0.1

    def model_kwargs(self) -> dict:
        """The keyword arguments of :class:`TinyTransformer` (everything but name and batch)."""
        d = asdict(self)
        del d["name"], d["batch"]
        return d

    def as_dict(self) -> dict:
        return asdict(self)


#: Presets. "tiny" is for unit tests (milliseconds); "small" is the demo default (a few
#: seconds on a 2-core CPU, activations well above the default 256 KiB ``min_bytes``);
#: "medium" is for a GPU or a patient CPU.
CONFIGS = {
    "tiny": TinyConfig("tiny", vocab=128, dim=64, layers=2, heads=4, seq=64, batch=4),
    "small": TinyConfig("small", vocab=512, dim=128, layers=4, heads=4, seq=128, batch=8),
    "medium": TinyConfig("medium", vocab=4096, dim=512, layers=8, heads=8, seq=512, batch=8),
}


def make_config(size: str = "small", **overrides) -> TinyConfig:
    """The preset ``size`` (``"tiny"``, ``"small"``, ``"medium"``) with fields overridden.

    Example::

        make_config("medium", batch=4).batch     # 4
    """
    return preset_config(CONFIGS, size, overrides, argument="size", caller="make_config")


def preset_config(presets: dict, name: str, overrides: dict, *, argument: str, caller: str):
    """``presets[name]`` (a dataclass with ``as_dict()``) with the fields in ``overrides``
    replaced: the body of :func:`make_config` and of the benchmarks' ``make_decoder_config``.
    An unknown preset or field raises, naming ``argument`` / ``caller``.

    Example::

        preset_config(CONFIGS, "small", {"layers": 2}, argument="size", caller="make_config").layers   # 2
    """
    if name not in presets:
        raise ValueError(f"{argument} must be one of {tuple(presets)}, got {name!r}")
    base = presets[name].as_dict()
    unknown = set(overrides) - set(base)
    if unknown:
        raise TypeError(f"{caller}: unknown field(s) {sorted(unknown)}; fields are {sorted(base)}")
    base.update(overrides)
    return type(presets[name])(**base)


def make_batch(cfg: TinyConfig, batch: int | None = None, seed: int = 0, device="cpu") -> torch.Tensor:
    """A deterministic batch of learnable sequences, shape ``(batch, cfg.seq + 1)``, int64.

    Each row is an arithmetic progression mod ``vocab`` with a random start and step, so a
    model can learn to continue it (the demo's loss goes down) and the data needs no download.
    Generated on the CPU from ``seed``, then moved to ``device``.
    """
    batch = cfg.batch if batch is None else batch
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    step = torch.randint(1, min(cfg.vocab, 17), (batch, 1), generator=gen)
    positions = torch.arange(cfg.seq + 1).unsqueeze(0)
    return ((start + step * positions) % cfg.vocab).to(device)
