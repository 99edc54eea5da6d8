"""A user's own model and data, for `reproduce` through `factory:` (docs/own-model.md).

The task: tell a sine, a square and a triangle wave apart, each 32 samples long, at a random frequency and
phase, with noise. The data is made here from a seed (nothing is downloaded); the model is a small 1-D
convolutional network. Any importable function works the same way: `factory: "module:function"` in the recipe,
with the function's keyword arguments under `kwargs:`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = ("sine", "square", "triangle")


def _waves(count: int, length: int, noise: float, generator: torch.Generator) -> TensorDataset:
    labels = torch.randint(len(CLASSES), (count,), generator=generator)
    cycles = 1 + 3 * torch.rand(count, 1, generator=generator)  # 1 to 4 periods in the window
    phase = 2 * math.pi * torch.rand(count, 1, generator=generator)
    angle = 2 * math.pi * cycles * torch.arange(length) / length + phase
    sine = torch.sin(angle)
    square = torch.sign(sine)
    triangle = 2 / math.pi * torch.asin(sine)
    waves = torch.stack([sine, square, triangle], dim=1)[torch.arange(count), labels]
    waves = waves + noise * torch.randn(count, length, generator=generator)
    return TensorDataset(waves.unsqueeze(1), labels)  # (count, 1 channel, length), class ids


def data(train: int = 1024, eval: int = 256, length: int = 32, noise: float = 0.2, seed: int = 0) -> dict:
    """The data factory: `{"train": dataset, "eval": dataset}` of (input, class) pairs; `info` is optional."""
    generator = torch.Generator().manual_seed(seed)
    return {"train": _waves(train, length, noise, generator), "eval": _waves(eval, length, noise, generator),
            "info": {"name": "waveforms", "classes": len(CLASSES)}}


def model(channels: int = 16, classes: int = len(CLASSES)) -> nn.Module:
    """The model factory: any torch.nn.Module taking a batch of inputs and returning class logits."""
    return nn.Sequential(
        nn.Conv1d(1, channels, kernel_size=5, padding=2), nn.GELU(),
        nn.Conv1d(channels, channels, kernel_size=5, padding=2, stride=2), nn.GELU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(channels, classes),
    )
