"""Small models the tests train with and without offload."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Chain(nn.Module):
    """Layers that each save one activation of rows x width (tanh saves its output, which is
    also the next Linear's saved input: one storage, two saved tensors)."""

    def __init__(self, n=8, width=512):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class MLP(nn.Module):
    def __init__(self, dim=64, hidden=256, dtype=torch.float32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden, dtype=dtype),
            nn.GELU(),
            nn.Linear(hidden, hidden, dtype=dtype),
            nn.ReLU(),
            nn.Linear(hidden, dim, dtype=dtype),
        )

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2)
        self.fc = nn.Linear(32 * 3 * 3, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)  # max_pool saves int64 indices
        x = F.silu(self.conv2(x))
        return self.fc(x.flatten(1))


class Block(nn.Module):
    def __init__(self, dim=64, heads=4, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)  # views with storage offsets
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Transformer(nn.Module):
    def __init__(self, vocab=97, dim=64, layers=2, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)  # saves int64 token indices
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]  # pos is expanded over the batch
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# The built-in TinyTransformer (ckpt_offload/demo/model.py), imported here for the tests.
from ckpt_offload.demo.model import TinyTransformer, lm_loss, make_batch, make_config  # noqa: E402,F401
