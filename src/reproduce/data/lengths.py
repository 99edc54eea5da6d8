"""The training data at each sequence length a run's batch phases use (BERT: 128 tokens, then 512).

A dataset that can be cut at another length says so with a `with_sequence_length(length)` method returning the same
data cut into sequences of `length` (the built-in `pysource` does; so can a user's factory dataset). `ByLength`
puts the cuts into one index space, shortest length first (`train.windows.rank_shares`), so `train.windows.window`
can name a phase's samples with plain indices and every consumer of indices (the loop, DataLoader workers) fetches
them unchanged; a window never mixes lengths.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch.utils.data import Dataset

from ..errors import UserError
from ..plan.recipe import Recipe
from .batches import fetch


def cut_at_lengths(recipe: Recipe, train: Any, lengths: list[int | None]) -> dict[int | None, Any]:
    """`train` (cut at batch.sequence_length) and the same data cut at each other length in `lengths`."""
    main = recipe.batch.sequence_length
    others = [length for length in lengths if length != main]
    if others and not hasattr(train, "with_sequence_length"):
        name = recipe.data.made_by or recipe.data.name or "the data"
        raise UserError(
            f"batch.phases: sequence length {others[0]} differs from batch.sequence_length {main}, but the training "
            f"data ({name}, {type(train).__name__}) cannot be cut at another length: its dataset has no "
            "with_sequence_length(length) method"
        )
    return {length: train if length == main else train.with_sequence_length(length) for length in lengths}


def training_sizes(recipe: Recipe, train: Any) -> int | dict[int | None, int]:
    """The training samples: one number, or one per sequence length when the batch phases change it."""
    lengths = recipe.batch.sequence_lengths
    if len(lengths) == 1:
        return len(train)
    return {length: len(dataset) for length, dataset in cut_at_lengths(recipe, train, lengths).items()}


def training_set(recipe: Recipe, train: Any, lengths: list[int | None]) -> Any:
    """What the run's windows index: `train` itself, or a `ByLength` of its cuts when phases change the length."""
    if len(lengths) <= 1:
        return train
    return ByLength(cut_at_lengths(recipe, train, lengths))


class ByLength(Dataset):
    """Datasets of one data cut at several sequence lengths, as one: indices of the shortest length first."""

    def __init__(self, datasets: dict[int | None, Any]):
        self.lengths = sorted(datasets, key=lambda length: length or 0)
        self.datasets = [datasets[length] for length in self.lengths]
        self.starts, start = [], 0
        for dataset in self.datasets:
            self.starts.append(start)
            start += len(dataset)
        self.total = start
        # slices of memory throughout: loader workers would only add copying (as for the data it is cut from)
        self.in_memory = all(getattr(dataset, "in_memory", False) for dataset in self.datasets)

    def __len__(self) -> int:
        return self.total

    def sizes(self) -> dict[int | None, int]:
        return {length: len(dataset) for length, dataset in zip(self.lengths, self.datasets, strict=True)}

    def _locate(self, indices: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The dataset holding `indices` (a window's indices all come from one length) and their indices in it."""
        part = bisect.bisect_right(self.starts, int(indices[0])) - 1
        local = indices - self.starts[part]
        if int(local.min()) < 0 or int(local.max()) >= len(self.datasets[part]):
            raise IndexError("a micro-batch's indices span two sequence lengths")
        return self.datasets[part], local

    def __getitem__(self, index: int) -> Any:
        dataset, local = self._locate(torch.tensor([index]))
        return dataset[int(local[0])]

    def batch(self, indices: torch.Tensor) -> tuple[Any, Any]:
        dataset, local = self._locate(indices)
        return fetch(dataset, local)
