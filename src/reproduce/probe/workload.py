"""What a trial runs: the recipe's model, optimizer, loss and precision, on one micro-batch of real shape.

The micro-batch comes from the recipe's dataset when it is available here (the first b items, cycling;
for items of different shapes, the largest item seen in a sample of the data, repeated: the worst case
is what has to fit). Otherwise it is synthetic, of the shapes the recipe declares: token sequences of
`batch.sequence_length` for language modelling (vocabulary `model.kwargs.vocab_size`, default 256), or
`data.kwargs.input_shape` (and `data.kwargs.classes`, default 10) for classification.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import torch
from torch.utils.data import TensorDataset

from ..data import build_data
from ..data.batches import collate, fetch
from ..errors import UserError
from ..planner import Plan, plan
from ..recipe import Recipe

SHAPE_SAMPLE = 256  # items looked at to tell fixed-shape data from variable-length data


class SyntheticTokens:
    """Token sequences of one length: input the first L of L + 1 random tokens, target the last L."""

    def __init__(self, items: int, sequence_length: int, vocab_size: int):
        self.items, self.length, self.vocab = items, sequence_length, vocab_size

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(torch.tensor([index]))
        return inputs[0], targets[0]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (len(indices), self.length + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]


class SyntheticSamples:
    """Random inputs of one shape with class labels."""

    def __init__(self, items: int, input_shape: tuple[int, ...], classes: int):
        self.items, self.shape, self.classes = items, input_shape, classes

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(torch.tensor([index]))
        return inputs[0], targets[0]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn((len(indices), *self.shape), generator=generator)
        return inputs, torch.randint(0, self.classes, (len(indices),), generator=generator)


def synthetic_data(recipe: Recipe) -> dict:
    """A stand-in training set of the recipe's declared shapes, for data that is not available here."""
    items = recipe.batch.sequences
    if recipe.task == "language-modeling":
        if recipe.batch.sequence_length is None:
            raise UserError("batch.sequence_length: needed to probe with synthetic tokens (the data is not available)")
        vocab = int(recipe.model.kwargs.get("vocab_size", 256))
        dataset = SyntheticTokens(items, recipe.batch.sequence_length, vocab)
        return {"train": dataset, "info": {"name": "synthetic tokens", "vocab_size": vocab}}
    shape = recipe.data.kwargs.get("input_shape")
    if recipe.task == "classification" and shape:
        classes = int(recipe.data.kwargs.get("classes", 10))
        dataset = SyntheticSamples(items, tuple(int(s) for s in shape), classes)
        return {"train": dataset, "info": {"name": f"synthetic {list(shape)} inputs", "classes": classes}}
    raise UserError(
        f"data: {recipe.data.name!r} is not available here and the recipe declares no input shape to probe "
        "with (data.kwargs.input_shape: [C, H, W])"
    )


class Workload:
    """The recipe, its (real or synthetic) data, built on first use, and one micro-batch of any size."""

    def __init__(self, recipe: Recipe, data: dict | None = None):
        self.recipe = recipe
        self._data = data

    @cached_property
    def data(self) -> dict:
        if self._data is not None:
            return self._data
        return build_data(self.recipe) if self.recipe.data.available else synthetic_data(self.recipe)

    def prepare(self) -> Workload:
        """Build the data and the plan now, outside any trial (so no trial counts or times them)."""
        _ = self.plan, self._largest_item
        return self

    @property
    def synthetic(self) -> bool:
        return isinstance(self.data["train"], (SyntheticTokens, SyntheticSamples))

    @property
    def description(self) -> str:
        name = self.data.get("info", {}).get("name") or "data"
        return f"{name} ({'synthetic' if self.synthetic else 'real'} inputs)"

    @cached_property
    def plan(self) -> Plan:
        """A plan for `trainer.build`: its optimizer and schedule (the learning rate does not change memory)."""
        return plan(self.recipe, micro_batch_max=1, dataset_size=len(self.data["train"]))

    @cached_property
    def _largest_item(self) -> int | None:
        """The index of the largest item when items differ in shape; None when they all have one shape."""
        dataset = self.data["train"]
        if hasattr(dataset, "longest_item"):  # variable-length data that indexed its lengths (tokenised text)
            return dataset.longest_item()
        if isinstance(dataset, TensorDataset) or hasattr(dataset, "batch"):
            return None
        step = max(1, len(dataset) // SHAPE_SAMPLE)
        sizes = {index: _numel(dataset[index]) for index in range(0, len(dataset), step)}
        if len(set(sizes.values())) <= 1:
            return None
        return max(sizes, key=sizes.get)

    def batch(self, micro_batch: int) -> tuple[Any, Any]:
        """`micro_batch` items as (inputs, targets), on the CPU."""
        dataset = self.data["train"]
        if self._largest_item is not None:
            return collate([dataset[self._largest_item]] * micro_batch)
        return fetch(dataset, torch.arange(micro_batch) % len(dataset))


def _numel(item: Any) -> int:
    inputs = item[0] if isinstance(item, (tuple, list)) else item
    return math.prod(torch.as_tensor(inputs).shape)
