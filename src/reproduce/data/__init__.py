"""Data: the one place the training loop, the probe and verify build a recipe's datasets.

`build_data(recipe)` gives `{"train": Dataset, "eval": Dataset (optional), "info": {...}}` from a built-in
name (`DATA`) or the user's own `factory:`; items are `(input, target)` pairs.
"""

from __future__ import annotations

from ..errors import UserError
from ..factory import call_builder
from ..recipe import Recipe
from . import builtin

DATA = dict(builtin.DATA)


def build_data(recipe: Recipe) -> dict:
    if not recipe.data.available:
        raise UserError(
            f"data: {recipe.data.name!r} is marked available: false: this recipe can be planned but not run here"
        )
    extra = {}
    if recipe.data.builtin == "pysource" and recipe.batch.sequence_length:
        extra["sequence_length"] = recipe.batch.sequence_length
    data = call_builder(recipe.data, "data", DATA, extra)
    if not isinstance(data, dict) or "train" not in data:
        raise UserError(f"data: the factory must return a dict with a 'train' dataset (got {type(data).__name__})")
    for split in ("train", "eval"):
        if split in data and not hasattr(data[split], "__len__"):
            raise UserError(f"data: {split!r} must be a sized dataset (got {type(data[split]).__name__})")
    if len(data["train"]) == 0:
        raise UserError("data: the training set is empty")
    data.setdefault("info", {"name": recipe.data.name or recipe.data.builtin or recipe.data.factory})
    return data
