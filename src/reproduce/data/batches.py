"""Micro-batches: the (inputs, targets) of a set of sample indices, collated and moved to the device."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import TensorDataset

IGNORE_INDEX = -100  # targets that bear no loss (padding, prompt tokens)


def fetch(dataset: Any, indices: torch.Tensor) -> tuple[Any, Any]:
    """The (inputs, targets) of `indices`: sliced directly from tensors where possible, else collated."""
    if isinstance(dataset, TensorDataset):
        inputs, targets = dataset.tensors[0], dataset.tensors[-1]
        return inputs[indices], targets[indices]
    if hasattr(dataset, "batch"):
        return dataset.batch(indices)
    return collate([dataset[int(i)] for i in indices])


def collate(items: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """Stack equal shapes; pad sequences of different lengths (inputs with 0, targets with -100)."""
    inputs = [torch.as_tensor(x) for x, _ in items]
    targets = [torch.as_tensor(y) for _, y in items]
    if all(x.shape == inputs[0].shape for x in inputs) and all(y.shape == targets[0].shape for y in targets):
        return torch.stack(inputs), torch.stack(targets)
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(inputs, batch_first=True, padding_value=0), pad(targets, batch_first=True, padding_value=IGNORE_INDEX)


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device != device:
            value = value.to(device, non_blocking=True)
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    return value


class DataClock:
    """Seconds an optimizer step spent waiting for its data (fetching, or waiting on the loader's workers)."""

    def __init__(self) -> None:
        self.seconds = 0.0


class LazyMicroBatch:
    """A micro-batch fetched (from `source`, or here) and moved to the device when its forward runs, its loss-bearing
    items counted first, so memory holds one micro-batch's inputs at a time; the time is added to `clock`."""

    def __init__(self, dataset: Any, indices: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 source: Callable[[torch.Tensor], tuple[Any, Any]] | None = None, clock: DataClock | None = None,
                 step: int | None = None, seed: int = 0,
                 drawn: Callable[[torch.Tensor], tuple[Any, Any]] | None = None):
        self.dataset, self.indices, self.device, self.dtype = dataset, indices, device, dtype
        self.source, self.clock = source, clock
        # the loader's draws for this one's items, and `drawn`: the fetch here with them (loader.fetch_seeded)
        self.step, self.seed, self.drawn = step, seed, drawn

    def targets(self) -> Any:
        started = time.perf_counter()
        if isinstance(self.dataset, TensorDataset):
            targets = self.dataset.tensors[-1][self.indices]
        elif self.drawn is not None:  # with the loader's per-sample draws, so the count is that of what trains
            targets = self.drawn(self.indices)[1]
        else:
            targets = fetch(self.dataset, self.indices)[1]
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - started
        return targets

    def known_count(self) -> int | None:
        """The targets that bear loss, where the dataset counts them without fetching; else None."""
        counts = getattr(self.dataset, "target_counts", None)
        if counts is not None:
            return int(counts(self.indices).sum())
        counts_at = getattr(self.dataset, "target_counts_at", None)
        if counts_at is not None and self.step is not None:
            return int(counts_at(self.seed, self.step, self.indices).sum())
        return None

    def load(self) -> tuple[Any, Any]:
        started = time.perf_counter()
        batch = self.source(self.indices) if self.source is not None else fetch(self.dataset, self.indices)
        batch = to_device(batch, self.device, self.dtype)
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - started
        return batch
