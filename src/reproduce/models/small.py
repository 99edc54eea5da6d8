"""The small built-in models, trained on two CPU cores in minutes: `mlp`, `cnn-bn` / `cnn-gn` (the BatchNorm
caveat made visible) and `gpt` (pre-LayerNorm, causal `scaled_dot_product_attention`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, inputs: int = 64, hidden: int = 128, classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """conv-norm-relu x2, pool, conv-norm-relu, global pool, linear. `norm` is batch or group."""

    def __init__(self, norm: str = "batch", channels: int = 32, classes: int = 10, groups: int = 8):
        super().__init__()

        def norm_layer(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(min(groups, c), c)

        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), norm_layer(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), norm_layer(channels), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), norm_layer(2 * channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, pre-LN blocks, tied output head. Returns logits (B, T, V)."""

    def __init__(self, vocab_size: int = 256, block_size: int = 64, layers: int = 2, heads: int = 4,
                 dim: int = 128, dropout: float = 0.0):
        super().__init__()
        self.block_size = block_size
        self.token = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.token.weight
        for module in self.modules():  # the layers in the order `apply` visits them, so the same draws
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence of {length} tokens exceeds block_size {self.block_size}")
        positions = torch.arange(length, device=tokens.device)
        x = self.drop(self.token(tokens) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


MODELS = {
    "mlp": MLP,
    "cnn-bn": lambda **kw: SmallCNN(norm="batch", **kw),
    "cnn-gn": lambda **kw: SmallCNN(norm="group", **kw),
    "gpt": GPT,
}
