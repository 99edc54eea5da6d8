"""Built-in models and data: real, offline, small enough to train on two CPU cores in minutes.

Data
- `digits`: the 1,797 8x8 handwritten digits scikit-learn ships (`load_digits`), a fixed stratified
  80/20 split (1,437 train, 360 test), images as 1x8x8 floats in [0, 1].
- `pysource`: a byte-level corpus built from the Python standard library's own top-level `*.py` files,
  in sorted order; every tenth file goes to validation. Its SHA-256 fingerprint is recorded in the run.

Models
- `mlp`: 64 -> hidden -> hidden -> 10.
- `cnn-bn` / `cnn-gn`: the same small CNN with BatchNorm or GroupNorm (the BatchNorm caveat made visible).
- `gpt`: a small pre-LayerNorm GPT with causal attention through `scaled_dot_product_attention`.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

# ---- data -------------------------------------------------------------------------------------------


def digits(test_fraction: float = 0.2, seed: int = 0) -> dict:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        list(range(len(labels))), test_size=test_fraction, random_state=seed, stratify=bunch.target
    )
    train_idx, test_idx = torch.tensor(sorted(train_idx)), torch.tensor(sorted(test_idx))
    return {
        "train": TensorDataset(images[train_idx], labels[train_idx]),
        "eval": TensorDataset(images[test_idx], labels[test_idx]),
        "info": {"name": "digits", "source": "sklearn.datasets.load_digits", "classes": 10},
    }


class TokenWindows(Dataset):
    """Non-overlapping windows of `sequence_length + 1` bytes: input is the first L, target the last L."""

    def __init__(self, data: torch.Tensor, sequence_length: int):
        self.data, self.length = data, sequence_length
        self.count = (len(data) - 1) // sequence_length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.length
        chunk = self.data[start : start + self.length + 1].long()
        return chunk[:-1], chunk[1:]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Many windows at once (fast path for the training loop)."""
        offsets = indices.view(-1, 1) * self.length + torch.arange(self.length + 1).view(1, -1)
        chunks = self.data[offsets].long()
        return chunks[:, :-1], chunks[:, 1:]


def stdlib_sources(max_bytes: int) -> list[Path]:
    """The standard library's top-level Python files, sorted, up to about `max_bytes` in total."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return files


def pysource(sequence_length: int = 64, max_bytes: int = 2_000_000, validation_every: int = 10) -> dict:
    files = stdlib_sources(max_bytes)
    if not files:
        raise FileNotFoundError("no Python standard library sources found for the pysource corpus")
    train, valid = bytearray(), bytearray()
    for index, path in enumerate(files):
        (valid if index % validation_every == validation_every - 1 else train).extend(path.read_bytes())
    fingerprint = hashlib.sha256(bytes(train) + b"\0" + bytes(valid)).hexdigest()
    to_tensor = lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()  # noqa: E731
    train_t, valid_t = to_tensor(train), to_tensor(valid)
    counts = torch.bincount(train_t.long(), minlength=256).double()
    probs = counts[counts > 0] / counts.sum()
    unigram = float(-(probs * probs.log()).sum())  # entropy of the byte distribution, in nats
    return {
        "train": TokenWindows(train_t, sequence_length),
        "eval": TokenWindows(valid_t, sequence_length),
        "info": {
            "name": "pysource", "files": len(files), "train_bytes": len(train), "eval_bytes": len(valid),
            "fingerprint": fingerprint, "vocab_size": 256, "unigram_loss": unigram,
        },
    }


DATA = {"digits": digits, "pysource": pysource}

# ---- models -----------------------------------------------------------------------------------------


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
        self.apply(self._init)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

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
