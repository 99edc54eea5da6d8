"""Factories for the memory tests (recipes' `factory: "memory_factories:NAME"`; tests/ is on sys.path)."""

from __future__ import annotations

import torch
from torch import nn


def small_images(items: int = 16, size: int = 16, classes: int = 4, seed: int = 0) -> dict:
    """RGB images of size x size with class labels, from a fixed generator."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(items, 3, size, size, generator=generator)
    labels = torch.randint(0, classes, (items,), generator=generator)
    return {"train": torch.utils.data.TensorDataset(images, labels),
            "info": {"name": "small-images", "classes": classes, "channels": 3, "image_size": size}}


def single_linear() -> nn.Module:
    """A model with nothing to checkpoint: one Linear."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.layer(x))


class DeclaredBlocks(nn.Module):
    """A factory model that names its blocks the way Hugging Face models do."""

    _no_split_modules = ["Residual"]

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.Sequential(Residual(width), Residual(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def declared_blocks() -> nn.Module:
    return DeclaredBlocks()
