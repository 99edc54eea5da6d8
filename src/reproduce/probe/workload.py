"""What a trial runs: the recipe's model, optimizer, loss and precision, on one micro-batch of real shape: from the
dataset when it is here (the first b items, cycling; items of different shapes: the largest in a sample, repeated),
else synthetic, of the shape `declared_inputs(recipe)` gives (tokens, segmentation crops, images with labels, or
`data.kwargs.input_shape`).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.data import TensorDataset

from ..data import Datasets, build_data, image_dataset
from ..data.batches import collate, fetch
from ..errors import UserError
from ..models import check_context, model_inputs
from ..plan.planner import Plan, make_plan
from ..plan.recipe import NamedData, Recipe, SegmentationData

SHAPE_SAMPLE = 256  # items looked at to tell fixed-shape data from variable-length data


class SyntheticSamples:
    """Random inputs of one shape with class labels, made a batch at a time (the same for every index); `masks`:
    segmentation crops (C x H x W) with a mask of random class ids each (H x W), every pixel valid: the most pixels
    a crop can bring to the loss."""

    def __init__(self, items: int, input_shape: tuple[int, ...], classes: int, masks: bool = False):
        self.items, self.shape, self.classes, self.masks = items, input_shape, classes, masks

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        inputs, targets = self.batch(torch.tensor([index]))  # (sentence pairs: a dict of tensors)
        return tree_map_only(torch.Tensor, lambda rows: rows[0], inputs), targets[0]

    def batch(self, indices: torch.Tensor) -> tuple[Any, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn((len(indices), *self.shape), generator=generator)
        targets = (len(indices), *self.shape[1:]) if self.masks else (len(indices),)
        return inputs, torch.randint(0, self.classes, targets, generator=generator)


class SyntheticTokens(SyntheticSamples):
    """Token sequences of one length: input the first L of L + 1 random tokens, target the last L."""

    def __init__(self, items: int, sequence_length: int, vocab_size: int):
        self.items, self.length, self.vocab = items, sequence_length, vocab_size

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (len(indices), self.length + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]


class SyntheticPairs(SyntheticTokens):
    """BERT's sentence pairs of one length (data/pairs.py's layout): random tokens, the first half sentence A and
    the second B, no padding; 15% of the positions masked-LM targets, and a next-sentence label per row."""

    def batch(self, indices: torch.Tensor) -> tuple[dict, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        rows, length = len(indices), self.length
        tokens = torch.randint(0, self.vocab, (rows, length), generator=generator)
        types = (torch.arange(length) >= length // 2).long().expand(rows, length).contiguous()
        labels = torch.full((rows, length + 1), -100, dtype=torch.long)
        masked = torch.rand((rows, length), generator=generator) < 0.15
        labels[:, :-1][masked] = tokens[masked]
        labels[:, -1] = torch.randint(0, 2, (rows,), generator=generator)
        inputs = {"input_ids": tokens, "token_type_ids": types, "attention_mask": torch.ones_like(tokens)}
        return inputs, labels


def declared_inputs(recipe: Recipe) -> dict:
    """The shape of the recipe's samples without its data: `{"inputs": "tokens", "sequence_length", "vocab_size"}`
    or `{"inputs": "samples", "shape", "classes"}` (images C x H x W, or the MLP's vectors)."""
    fixed, data, spec = model_inputs(recipe), recipe.data, recipe.model
    kwargs = data.kwargs if isinstance(data, NamedData) else {}  # (data in a format takes none)
    given = kwargs.get("input_shape")
    kind = fixed.get("inputs") or ("tokens" if recipe.task == "language-modeling" and not given else "images")
    if kind == "tokens":
        length = recipe.batch.sequence_length or data.max_length
        if length is None:
            raise UserError(
                "batch.sequence_length: needed to probe with synthetic tokens (the data is not available here); "
                "for variable-length text give data.max_length, its longest sequence"
            )
        check_context(recipe, fixed)
        vocab = int(fixed.get("vocab_size") or spec.kwargs.get("vocab_size", 256))
        shape = {"inputs": "tokens", "sequence_length": length, "vocab_size": vocab}
        return {**shape, "targets": fixed["targets"]} if "targets" in fixed else shape
    if isinstance(data, SegmentationData) and data.crop is not None:  # the training crop, with a mask of class ids
        channels = data.channels or fixed.get("channels") or 3
        return {"inputs": "masks", "shape": (int(channels), *data.crop), "classes": int(data.classes)}
    known = image_dataset(data.name) or {}
    classes = data.classes or kwargs.get("classes") or known.get("classes") or fixed.get("classes")
    if given:
        return {"inputs": "samples", "shape": tuple(int(size) for size in given), "classes": int(classes or 10)}
    if kind == "vectors":
        return {"inputs": "samples", "shape": (int(fixed["features"]),), "classes": int(classes or 10)}
    channels = data.channels or known.get("channels") or fixed.get("channels")
    size = data.image_size or known.get("image_size") or fixed.get("image_size")
    missing = [name for name, value in (("data.channels", channels), ("data.image_size", size)) if value is None]
    if recipe.task == "classification" and classes is None:
        missing.append("data.classes")
    if missing:
        raise UserError(
            f"data: {data.name!r} is not available here and its image shape is not known: give {', '.join(missing)} "
            "(or data.kwargs.input_shape: [C, H, W] for another kind of input)"
        )
    return {"inputs": "samples", "shape": (int(channels), int(size), int(size)), "classes": int(classes or 1000)}


def synthetic_data(recipe: Recipe) -> Datasets:
    """A stand-in training set of the recipe's declared shapes, for data that is not available here."""
    items = recipe.batch.sequences
    shape = declared_inputs(recipe)
    if shape["inputs"] == "tokens":
        length, vocab = shape["sequence_length"], shape["vocab_size"]
        pairs = shape.get("targets") == "mlm-nsp"
        dataset = SyntheticPairs(items, length, vocab) if pairs else SyntheticTokens(items, length, vocab)
        return Datasets(dataset, info={"name": f"synthetic tokens ({length} x vocabulary {vocab})",
                                       "vocab_size": vocab})
    dims, classes = shape["shape"], shape["classes"]
    masks = shape["inputs"] == "masks"
    dataset = SyntheticSamples(items, dims, classes, masks)
    what = "images with masks" if masks else "inputs"
    info = {"name": f"synthetic {' x '.join(map(str, dims))} {what}, {classes} classes", "classes": classes}
    if len(dims) == 3:
        info.update(channels=dims[0], image_size=dims[1])
    return Datasets(dataset, info=info)


class Workload:
    """The recipe, its (real or synthetic) data, built on first use, and one micro-batch of any size."""

    def __init__(self, recipe: Recipe, data: Datasets | None = None):
        self.recipe = recipe
        self._data = data

    @cached_property
    def data(self) -> Datasets:
        if self._data is not None:
            return self._data
        return build_data(self.recipe) if self.recipe.data.available else synthetic_data(self.recipe)

    def prepare(self) -> Workload:
        """Build the data and the plan now, outside any trial (so no trial counts or times them)."""
        _ = self.plan, self._largest_item
        return self

    @property
    def synthetic(self) -> bool:
        return isinstance(self.data.train, (SyntheticTokens, SyntheticSamples))

    @property
    def description(self) -> str:
        name = self.data.info.get("name") or "data"
        return f"{name} ({'synthetic' if self.synthetic else 'real'} inputs)"

    @cached_property
    def plan(self) -> Plan:
        """A plan for `trainer.build`: its optimizer and schedule (the learning rate does not change memory). Planned
        at a micro-batch of 2 where the batch allows: the plan refuses a BN batch of 1 for a model whose image
        pooling cannot train on one (DeepLabV3, plan.batchnorm), and the split changes no memory."""
        return make_plan(self.recipe, micro_batch_max=min(2, self.recipe.batch.sequences),
                         dataset_size=len(self.data.train))

    @cached_property
    def _largest_item(self) -> int | None:
        """The index of the largest item when items differ in shape; None when they all have one shape."""
        dataset = self.data.train
        if hasattr(dataset, "longest_item"):  # variable-length data that indexed its lengths (tokenised text)
            return dataset.longest_item()
        if isinstance(dataset, TensorDataset) or hasattr(dataset, "batch"):
            return None
        step = max(1, len(dataset) // SHAPE_SAMPLE)
        sizes = {index: math.prod(torch.as_tensor(item[0] if isinstance(item, (tuple, list)) else item).shape)
                 for index, item in ((i, dataset[i]) for i in range(0, len(dataset), step))}
        if len(set(sizes.values())) <= 1:
            return None
        return max(sizes, key=sizes.get)

    def batch(self, micro_batch: int) -> tuple[Any, Any]:
        """`micro_batch` items as (inputs, targets) on the CPU (packed: `packed_rows`)."""
        dataset = self.data.train
        if self.recipe.data.packing == "packed":
            return self.packed_rows(micro_batch)
        if self._largest_item is not None:
            return collate([dataset[self._largest_item]] * micro_batch)
        return fetch(dataset, torch.arange(micro_batch) % len(dataset))

    def longest(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The longest example's (inputs, targets): token sequences (any item when they all have one length)."""
        inputs, targets = self.data.train[self._largest_item or 0]
        return torch.as_tensor(inputs), torch.as_tensor(targets)

    def rows(self, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` rows of the longest example's first `length` tokens: a `sorted` micro-batch of that shape."""
        inputs, targets = self.longest()
        return inputs[:length].repeat(count, 1), targets[:length].repeat(count, 1)

    def packed_rows(self, count: int) -> tuple[dict, torch.Tensor]:
        """A `data.packing: packed` micro-batch of T = `count` x the longest example's L tokens, as the run feeds it
        to the varlen attention build_model selects for it (models/varlen.py): ONE row of `count` samples of L
        tokens back to back, position ids restarting at each, so the probe measures the run's own kernel."""
        inputs, targets = self.rows(count, len(self.longest()[0]))
        positions = torch.arange(inputs.shape[1]).repeat(count, 1)
        return {"input_ids": inputs.reshape(1, -1), "position_ids": positions.reshape(1, -1)}, targets.reshape(1, -1)
