"""Data: the one place the run, the probe and verify build a recipe's datasets, from a built-in (`DATA`), a
`factory:` or files in one of the `FORMATS`, each returning {"train", "eval", "info"} of `(input, target)` items.
Batch phases of other sequence lengths read `with_sequence_length(length)` cuts, in one index space (`ByLength`).
"""

from __future__ import annotations

import bisect
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from ..errors import UserError
from ..plan.factory import call_builder
from ..plan.recipe import Recipe, TextData, TokensData
from . import builtin
from .batches import fetch


def _pairs(name: str, **kwargs: Any) -> dict:
    """BERT's sentence pairs (data/pairs.py), imported when used."""
    return getattr(importlib.import_module(".pairs", __name__), name)(**kwargs)


DATA = {**builtin.DATA, "pysource-pairs": functools.partial(_pairs, "pysource_pairs"),
        "text-pairs": functools.partial(_pairs, "text_pairs")}
# data.format -> (module of this package, its builder, the library it needs); imported only when used
FORMATS = {
    "imagefolder": ("images", "build_imagefolder", "torchvision"),
    "tokens": ("tokens", "build_tokens", None),
    "instructions": ("text", "build_instructions", "transformers"),
    "chat": ("text", "build_chat", "transformers"),
    "hf-datasets": ("hfdata", "build_hf_datasets", "datasets"),
    "segmentation": ("segmentation", "build_segmentation", "torchvision"),
}
TEXT_FORMATS = ("instructions", "chat", "hf-datasets")  # tokenised here, truncated to data.max_length


# what `--data PATH` is, for each data.format
EXPECTED = {
    "tokens": "a binary file of {dtype} token ids, or a nanoGPT data folder holding train.bin (and val.bin)",
    "imagefolder": "a folder with one sub-folder of images per class (torchvision's ImageFolder layout)",
    "instructions": "an Alpaca-style JSON or JSONL file of instruction / input / output records",
    "chat": 'a JSON or JSONL file of {"messages": [{"role": ..., "content": ...}, ...]} records',
    "hf-datasets": "a folder saved with the datasets library's save_to_disk, or parquet / JSONL files",
    "segmentation": "Pascal VOC's folder (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/) or images/ and "
                    "masks/ folders of label-id PNGs",
}


@dataclass(frozen=True)
class Datasets:
    """A recipe's map-style datasets (a torch `Dataset`, a `datasets.Dataset`, a list of pairs)."""

    train: Any
    eval: Any = None  # None: the recipe has no evaluation data (no eval loss, no plateau decay)
    info: dict[str, Any] = field(default_factory=dict)  # name, vocab_size, classes, ...: what the model is built for


# name -> (channels, image size, classes) of the papers' datasets, so a recipe whose data is not here can be probed
IMAGE_DATASETS: dict[str, tuple[int, int, int]] = {
    "imagenet-1k": (3, 224, 1000),  # ILSVRC-2012; 224 crops (He et al. 2016 sec. 3.4, Goyal et al., ViT, MAE)
    # as ViT pre-trains on it (Dosovitskiy et al. 2021 sec. 4.1; vision_transformer's num_classes 21843), at 224
    "imagenet-21k": (3, 224, 21843),
}
ALIASES = {"imagenet": "imagenet-1k", "ilsvrc2012": "imagenet-1k", "ilsvrc-2012": "imagenet-1k",
           "imagenet1k": "imagenet-1k", "imagenet21k": "imagenet-21k", "imagenet-22k": "imagenet-21k"}


def image_dataset(name: str | None) -> dict | None:
    """{"channels", "image_size", "classes"} of a known image dataset by `data.name`, or None."""
    if not name:
        return None
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in IMAGE_DATASETS:
        return None
    channels, size, classes = IMAGE_DATASETS[key]
    return {"channels": channels, "image_size": size, "classes": classes}


def build_data(recipe: Recipe) -> Datasets:
    spec = recipe.data
    if not spec.available:  # the fix is the data's path (`data_path`) when the recipe names its format
        head = f"data: {spec.name!r} is marked available: false"
        if spec.format is None:
            raise UserError(f"{head} and names no data.format: this recipe can be planned but not run here; to run "
                            "it, give data.factory (your own data) or data.format, and its path with `data_path` PATH")
        dtype = (spec.dtype if isinstance(spec, TokensData) else None) or "uint16"
        raise UserError(f"{head}: give its path with `data_path` PATH (format {spec.format}: "
                        f"{EXPECTED[spec.format].format(dtype=dtype)})")
    if recipe.data.format is not None:
        if recipe.data.format in TEXT_FORMATS:  # before a token is read: the longest sequence the model takes
            from ..models import check_context

            check_context(recipe)
        module_name, builder, needs = FORMATS[spec.format]
        try:  # data.path (and data.eval_path) read by the format's module
            module = importlib.import_module(f".{module_name}", __name__)
        except Exception as exc:  # ImportError, or a library built for another torch failing as it imports
            raise UserError(f"data.format: {spec.format} data needs {needs or exc}, which does not "
                            f"import here ({type(exc).__name__}: {exc})") from None
        data = getattr(module, builder)(recipe)
        if isinstance(spec, TextData) and (spec.eval_size is not None or spec.eval_fraction is not None):
            from .text import hold_out

            data = hold_out(data, recipe)
    else:
        extra = {}
        if recipe.data.made_by in ("pysource", "pysource-pairs", "text-pairs") and recipe.batch.sequence_length:
            extra["sequence_length"] = recipe.batch.sequence_length
        data = call_builder(recipe.data, "data", DATA, extra)
    if not isinstance(data, dict) or "train" not in data:
        raise UserError(f"data: the factory must return a dict with a 'train' dataset (got {type(data).__name__})")
    for split in ("train", "eval"):
        if split in data and not hasattr(data[split], "__len__"):
            raise UserError(f"data: {split!r} must be a sized dataset (got {type(data[split]).__name__})")
    if len(data["train"]) == 0:
        path = next(iter(recipe.data.files), None)
        raise UserError(f"data: the training set is empty{f' ({path})' if path else ''}")
    info = data.get("info")
    if info is None:
        info = {"name": recipe.data.name or recipe.data.made_by}
    return Datasets(data["train"], data.get("eval"), info)


def text_warnings(info: dict) -> list[str]:
    """What tokenising changed in the data, with counts, and a tokenizer without EOS."""
    lines = []
    for split, where in (("train", info.get("path")), ("eval", info.get("eval_path"))):
        examples, length = info.get(f"{split}_examples"), info.get(f"{split}_max_length")
        if examples is None:
            continue
        counted = [("truncated", "are longer than data.max_length ({length} tokens): truncated, the end of the "
                    "response and its EOS cut off"),
                   ("without_response_tokens", "keep no response token within data.max_length ({length} tokens): "
                    "they bear no loss"),
                   ("skipped_too_short", "have fewer than two tokens (nothing to predict): left out")]
        for key, what in counted:
            count = info.get(f"{split}_{key}") or 0
            total = examples + (info.get(f"{split}_skipped_too_short") or 0)
            if count:
                lines.append(f"{where}: {count} of {total} examples {what.format(length=length)}")
    if info.get("train_eos_appended") is False:
        lines.append(f"data.tokenizer: {info.get('tokenizer', 'the tokenizer')} has no EOS token: the examples end "
                     "without one, so the model does not learn where a response stops")
    return lines


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
    lengths = recipe.batch.sequence_lengths
    if len(lengths) == 1:
        return len(train)
    return {length: len(dataset) for length, dataset in cut_at_lengths(recipe, train, lengths).items()}


def training_set(recipe: Recipe, train: Any, lengths: list[int | None]) -> Any:
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
        self.in_memory = all(getattr(dataset, "in_memory", False) for dataset in self.datasets)

    def __len__(self) -> int:
        return self.total

    def sizes(self) -> dict[int | None, int]:
        return {length: len(dataset) for length, dataset in zip(self.lengths, self.datasets, strict=True)}

    def _locate(self, indices: torch.Tensor) -> tuple[Any, torch.Tensor]:
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
