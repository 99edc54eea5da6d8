"""Data: the one place the training loop, the probe and verify build a recipe's datasets.

`build_data(recipe)` gives the recipe's `Datasets` (training set, evaluation set, info) from a built-in name
(`DATA`), the user's own `factory:`, or data on disk in one of the `FORMATS` (`data.format` with `data.path`).
Each of these builders returns a dict with "train", "eval" (optional) and "info" (optional) keys, the contract a
user's factory follows; `build_data` checks it and gives the `Datasets`. Items are `(input, target)` pairs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import UserError
from ..plan.factory import call_builder
from ..plan.recipe import Recipe, TextData, TokensData
from . import builtin

DATA = dict(builtin.DATA)
# data.format -> (module of this package, its builder); imported only when used (torchvision, datasets)
FORMATS = {
    "imagefolder": ("images", "build_imagefolder"),
    "tokens": ("tokens", "build_tokens"),
    "instructions": ("text", "build_instructions"),
    "chat": ("chat", "build_chat"),
    "hf-datasets": ("hfdata", "build_hf_datasets"),
    "segmentation": ("segmentation", "build_segmentation"),
}
TEXT_FORMATS = ("instructions", "chat", "hf-datasets")  # tokenised here, truncated to data.max_length
NEEDS = {"imagefolder": "torchvision", "segmentation": "torchvision", "hf-datasets": "datasets",
         "instructions": "transformers", "chat": "transformers"}


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


class SizedDataset(Protocol):
    """A map-style dataset: a torch `Dataset` with a length, a `datasets.Dataset`, a list of pairs."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclass(frozen=True)
class Datasets:
    """A recipe's data, as `build_data` gives it to the run, the probe and verify."""

    train: SizedDataset
    eval: SizedDataset | None = None  # None: the recipe has no evaluation data (no eval loss, no plateau decay)
    info: dict[str, Any] = field(default_factory=dict)  # name, vocab_size, classes, ...: what the model is built for


def unavailable_message(recipe: Recipe) -> str:
    """Data marked `available: false`: the fix is the data's path (`data_path`) when the recipe names its format."""
    data = recipe.data
    head = f"data: {data.name!r} is marked available: false"
    if data.format is None:
        return (f"{head} and names no data.format: this recipe can be planned but not run here; to run it, give "
                "data.factory (your own data) or data.format, and its path with `data_path` PATH")
    expected = EXPECTED[data.format].format(dtype=(data.dtype if isinstance(data, TokensData) else None) or "uint16")
    return f"{head}: give its path with `data_path` PATH (format {data.format}: {expected})"


def build_format(recipe: Recipe) -> dict:
    """The datasets of `data.format` data read from `data.path` (and `data.eval_path`)."""
    name = recipe.data.format
    module_name, builder = FORMATS[name]
    try:
        module = importlib.import_module(f".{module_name}", __name__)
    except Exception as exc:  # ImportError, or a library built for another torch failing as it imports
        raise UserError(
            f"data.format: {name} data needs {NEEDS.get(name, exc)}, which does not import here "
            f"({type(exc).__name__}: {exc})"
        ) from None
    return getattr(module, builder)(recipe)


def build_data(recipe: Recipe) -> Datasets:
    if not recipe.data.available:
        raise UserError(unavailable_message(recipe))
    if recipe.data.format is not None:
        if recipe.data.format in TEXT_FORMATS:  # before a token is read: the longest sequence the model takes
            from ..models import check_context

            check_context(recipe)
        data = build_format(recipe)
        spec = recipe.data
        share = spec.eval_fraction if isinstance(spec, TextData) else None
        if isinstance(spec, TextData) and (spec.eval_size is not None or share is not None):  # held out, with the seed
            from .text import hold_out

            field = "data.eval_size" if share is None else "data.eval_fraction"
            if not hasattr(data["train"], "select"):
                raise UserError(f"{field}: holds out text examples; this data is not text (give eval_path)")
            size = spec.eval_size if share is None else max(1, round(share * len(data["train"])))
            data = hold_out(data, size, recipe.seed, spec.path, field)
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
