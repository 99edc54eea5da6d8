"""Micro-batches: the (inputs, targets) of a set of sample indices, collated and moved to the device."""

from __future__ import annotations

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


class LazyMicroBatch:
    """A micro-batch fetched and moved to the device only when its forward runs.

    The window's loss-bearing items are counted first from the targets alone, so memory holds one
    micro-batch's inputs at a time, as a single micro-batch step does.
    """

    def __init__(self, dataset: Any, indices: torch.Tensor, device: torch.device, dtype: torch.dtype):
        self.dataset, self.indices, self.device, self.dtype = dataset, indices, device, dtype

    def targets(self) -> Any:
        if isinstance(self.dataset, TensorDataset):
            return self.dataset.tensors[-1][self.indices]
        return fetch(self.dataset, self.indices)[1]

    def load(self) -> tuple[Any, Any]:
        return to_device(fetch(self.dataset, self.indices), self.device, self.dtype)
