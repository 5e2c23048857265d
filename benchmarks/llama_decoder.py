"""A Llama-style decoder for the benchmarks (``benchmarks/overlap.py``); not part of the library.

Pure PyTorch, built from a :class:`DecoderConfig` (no downloads): token embedding, RMSNorm,
rotary position embeddings, grouped-query attention through ``F.scaled_dot_product_attention``,
SwiGLU MLP. The config is called ``DecoderConfig`` (not ``LlamaConfig``) so that it is never
mistaken for, or shadows, ``transformers.LlamaConfig`` in code that imports both.

Scripts in ``benchmarks/`` import it as a neighbour (``python3 benchmarks/overlap.py`` puts
``benchmarks/`` on ``sys.path``); tests add ``benchmarks/`` to ``sys.path`` first.

Example::

    from llama_decoder import LlamaDecoder, causal_lm_loss, make_decoder_config, random_tokens

    cfg = make_decoder_config("tiny")
    model = LlamaDecoder(cfg, seed=0)
    causal_lm_loss(model, random_tokens(cfg.vocab, batch=2, seq=64, seed=0)).backward()
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

# The preset lookup the demo's make_config uses (one definition). The scripts that import this
# module import ckpt_offload first (through _package.py).
from ckpt_offload.demo.model import preset_config

__all__ = [
    "DecoderConfig",
    "DECODER_CONFIGS",
    "make_decoder_config",
    "LlamaDecoder",
    "LlamaBlock",
    "GroupedQueryAttention",
    "SwiGLU",
    "RMSNorm",
    "rotary_tables",
    "apply_rotary",
    "random_tokens",
    "causal_lm_loss",
]

# F.scaled_dot_product_attention takes enable_gqa from torch 2.5 on; before that the key/value
# heads are repeated (what Hugging Face's Llama did before 2.5).
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a :class:`LlamaDecoder`.

    Fields: ``vocab``, ``dim`` (model width), ``layers``, ``heads`` (query heads), ``kv_heads``
    (key/value heads; ``heads`` must be a multiple: grouped-query attention), ``ffn_dim`` (SwiGLU
    hidden width), ``max_seq`` (longest sequence the rotary table covers), ``rope_theta``,
    ``norm_eps``, ``tie_embeddings`` (the LM head reuses the token embedding).

    Example::

        cfg = make_decoder_config("tiny", layers=3)
        model = LlamaDecoder(cfg, seed=0)
    """

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim: int
    max_seq: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        for field in ("vocab", "dim", "layers", "heads", "kv_heads", "ffn_dim", "max_seq"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig: {field} must be a positive int, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"DecoderConfig: dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"DecoderConfig: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"DecoderConfig: the head size dim/heads ({self.dim // self.heads}) must be even (rotary)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def num_parameters(self) -> int:
        """Parameter elements of the model this config builds (without building it)."""
        hd = self.head_dim
        attn = self.dim * (self.heads * hd) * 2 + self.dim * (self.kv_heads * hd) * 2
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab * self.dim
        return self.layers * per_layer + self.dim + emb + (0 if self.tie_embeddings else emb)

    def as_dict(self) -> dict:
        return asdict(self)


#: Presets. "tiny" is for CPU tests (milliseconds per step); "small" (~150M parameters) and "1b"
#: (TinyLlama-1.1B's shape: 22 layers of width 2048, 32 query / 4 key-value heads, SwiGLU 5632,
#: 32000-token vocabulary) are sized for a GPU; "1b" finishes a step at sequence 4096 in a
#: fraction of a second on an H200.
DECODER_CONFIGS = {
    "tiny": DecoderConfig("tiny", vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=176, max_seq=1024),
    "small": DecoderConfig("small", vocab=32000, dim=1024, layers=8, heads=16, kv_heads=4, ffn_dim=2816, max_seq=8192),
    "1b": DecoderConfig("1b", vocab=32000, dim=2048, layers=22, heads=32, kv_heads=4, ffn_dim=5632, max_seq=8192),
}


def make_decoder_config(preset: str = "tiny", **overrides) -> DecoderConfig:
    """The preset ``preset`` (``"tiny"``, ``"small"``, ``"1b"``) with fields overridden.

    Example::

        make_decoder_config("small", layers=4).layers      # 4
    """
    return preset_config(DECODER_CONFIGS, preset, overrides, argument="preset", caller="make_decoder_config")


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 and cast back (Llama's rule).

    Example::

        y = RMSNorm(64)(torch.randn(2, 8, 64))
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_tables(seq: int, head_dim: int, theta: float = 10000.0, device=None, dtype=torch.float32):
    """``(cos, sin)`` of rotary position embeddings, each ``(seq, head_dim)`` (Llama's layout:
    the frequencies repeated for both halves of a head).

    Example::

        cos, sin = rotary_tables(128, 16)
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` (``(batch, heads, seq, head_dim)``) by the tables ``cos``/``sin`` (``(seq, head_dim)``)."""
    return x * cos + _rotate_half(x) * sin


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, through
    ``F.scaled_dot_product_attention(is_causal=True)``. No biases (Llama)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_heads == self.heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif _SDPA_HAS_GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # pragma: no cover - torch < 2.5
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """One decoder layer: ``h = x + attn(norm(x), cos, sin)``, then ``h + mlp(norm(h))``.

    ``forward(x, *, cos, sin)`` takes the rotary tables by keyword, as Hugging Face's layers take
    ``position_embeddings``: torch's checkpoint (and ``save_on_cpu`` around it) keeps such
    keyword tensors on the device, ``co.checkpoint(..., offload=...)`` offloads them.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = GroupedQueryAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.input_norm(x), cos, sin)
        return h + self.mlp(self.post_attn_norm(h))


class LlamaDecoder(nn.Module):
    """A Llama-style causal language model built from a :class:`DecoderConfig` (no downloads).

    Token embedding, ``cfg.layers`` :class:`LlamaBlock` in ``self.layers`` (an ``nn.ModuleList``,
    so :func:`ckpt_offload.apply` finds them), a final RMSNorm and an LM head (tied to the
    embedding when ``cfg.tie_embeddings``). Rotary tables are computed in ``forward`` for the
    input's length and passed to every layer by keyword.

    Args:
        cfg: a :class:`DecoderConfig` (see :data:`DECODER_CONFIGS` / :func:`make_decoder_config`).
        seed: initialise the weights (N(0, 0.02), output projections scaled by
            ``1/sqrt(2*layers)``, norms 1) from a private generator with this seed, leaving the
            global RNG alone; ``None`` uses the global RNG.
        device: where to create the parameters (``"cuda"`` builds a 1B model in a second
            instead of initialising it on the CPU).
        dtype: parameter dtype (e.g. ``torch.bfloat16``); norms compute in float32 anyway.

    ``forward(tokens, *, checkpoint_fn=None)``: ``tokens`` is ``(batch, t)`` int64 with
    ``t <= cfg.max_seq``; returns ``(batch, t, vocab)`` logits. With ``checkpoint_fn``, layer
    ``i`` runs as ``checkpoint_fn(layer, x, cos=cos, sin=sin)`` (e.g.
    ``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`` or
    ``co.checkpoint`` with ``offload=...``).

    Example::

        from llama_decoder import LlamaDecoder, make_decoder_config, random_tokens, causal_lm_loss

        cfg = make_decoder_config("tiny")
        model = LlamaDecoder(cfg, seed=0)
        tokens = random_tokens(cfg.vocab, batch=2, seq=64, seed=0)   # (2, 65)
        causal_lm_loss(model, tokens).backward()
    """

    def __init__(self, cfg: DecoderConfig, seed: int | None = None, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        if not isinstance(cfg, DecoderConfig):
            raise TypeError(f"LlamaDecoder: cfg must be a DecoderConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        device = torch.device(device) if device is not None else torch.device("cpu")
        fork_devices = [device.index or 0] if device.type == "cuda" else []
        # The submodules' default initialisation (overwritten below) runs on a forked RNG.
        with torch.random.fork_rng(devices=fork_devices, enabled=seed is not None), device:
            self.embed = nn.Embedding(cfg.vocab, cfg.dim)
            self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters(seed)
        if dtype is not None:
            self.to(dtype)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """N(0, 0.02) weights, ``o_proj``/``down_proj`` scaled by ``1/sqrt(2*layers)``, norms 1.
        Deterministic given ``seed`` on a given device (drawn with a generator on that device)."""
        gens = {}
        resid_std = 0.02 / math.sqrt(2 * len(self.layers))
        for name, p in self.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            gen = None
            if seed is not None:
                gen = gens.get(p.device)
                if gen is None:
                    gen = gens[p.device] = torch.Generator(device=p.device)
                    gen.manual_seed(seed)
            std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.normal_(0.0, std, generator=gen)

    def forward(self, tokens: torch.Tensor, *, checkpoint_fn=None) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"LlamaDecoder: tokens must be (batch, t), got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.cfg.max_seq:
            raise ValueError(f"LlamaDecoder: sequence length {t} is longer than max_seq={self.cfg.max_seq}")
        x = self.embed(tokens)
        cos, sin = rotary_tables(t, self.cfg.head_dim, self.cfg.rope_theta, device=x.device, dtype=x.dtype)
        for layer in self.layers:
            if checkpoint_fn is None:
                x = layer(x, cos=cos, sin=sin)
            else:
                x = checkpoint_fn(layer, x, cos=cos, sin=sin)
        return self.lm_head(self.norm(x))

    def num_parameters(self) -> int:
        """Number of parameter elements (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())


def random_tokens(vocab: int, batch: int, seq: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Uniformly random token ids, shape ``(batch, seq + 1)`` int64 (inputs plus the shifted
    targets of :func:`causal_lm_loss`), drawn on the CPU from ``seed`` then moved to ``device``.

    Example::

        tokens = random_tokens(32000, batch=1, seq=4096, seed=0, device="cuda")
    """
    for name, value in (("vocab", vocab), ("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"random_tokens: {name} must be a positive int, got {value!r}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor, **forward_kwargs) -> torch.Tensor:
    """Next-token cross-entropy in float32: ``model(tokens[:, :-1], **forward_kwargs)`` predicts
    ``tokens[:, 1:]``. Works for :class:`LlamaDecoder` and :class:`TinyTransformer`.

    Example::

        loss = causal_lm_loss(model, random_tokens(cfg.vocab, 2, 64), checkpoint_fn=my_checkpoint)
        loss.backward()
    """
    logits = model(tokens[:, :-1], **forward_kwargs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
