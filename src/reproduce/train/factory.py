"""Build a recipe's model, data and loss: a built-in by name, or the user's own `factory: "module:function"`.

Contracts for factories (a recipe's `factory:` runs the user's own Python code, like importing it):
- model factory: `fn(**kwargs) -> torch.nn.Module`;
- data factory: `fn(**kwargs) -> {"train": Dataset, "eval": Dataset (optional)}`, items `(input, target)`;
  for `language-modeling` targets are token ids aligned with the inputs, `-100` where no loss is taken;
- loss factory (task `custom`): `fn(**kwargs) -> callable(output, target) -> summed loss`, with an optional
  `count(target) -> int` attribute giving the loss-bearing items of a batch (default: `len(target)`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..recipe import Builder, Recipe
from . import builtins

IGNORE_INDEX = -100


def import_factory(spec: str, field: str) -> Callable[..., Any]:
    """`package.module:function`, imported with the working directory on the path."""
    module_name, _, attr = spec.partition(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of the user's module is their input's problem
        raise UserError(f"{field}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise UserError(f"{field}: {module_name!r} has no function {attr!r}")
    return function


def _call(builder: Builder, field: str, registry: dict, extra: dict | None = None) -> Any:
    kwargs = {**(extra or {}), **builder.kwargs}
    if builder.factory is not None:
        function, name = import_factory(builder.factory, f"{field}.factory"), builder.factory
    elif builder.builtin in registry:
        function, name = registry[builder.builtin], builder.builtin
    else:
        raise UserError(
            f"{field}.builtin: no built-in {builder.builtin!r} to run here (built-ins: {', '.join(registry)}); "
            "this recipe can be planned but not run"
        )
    try:
        return function(**kwargs)
    except TypeError as exc:
        raise UserError(f"{field}.kwargs: {name} rejected its arguments: {exc}") from None


def build_data(recipe: Recipe) -> dict:
    if not recipe.data.available:
        raise UserError(
            f"data: {recipe.data.name!r} is marked available: false: this recipe can be planned but not run here"
        )
    extra = {}
    if recipe.data.builtin == "pysource" and recipe.batch.sequence_length:
        extra["sequence_length"] = recipe.batch.sequence_length
    data = _call(recipe.data, "data", builtins.DATA, extra)
    if not isinstance(data, dict) or "train" not in data:
        raise UserError(f"data: the factory must return a dict with a 'train' dataset (got {type(data).__name__})")
    for split in ("train", "eval"):
        if split in data and not hasattr(data[split], "__len__"):
            raise UserError(f"data: {split!r} must be a sized dataset (got {type(data[split]).__name__})")
    if len(data["train"]) == 0:
        raise UserError("data: the training set is empty")
    data.setdefault("info", {"name": recipe.data.name or recipe.data.builtin or recipe.data.factory})
    return data


def build_model(recipe: Recipe, data_info: dict | None = None) -> nn.Module:
    extra = {}
    if recipe.model.builtin == "gpt":
        extra = {"vocab_size": (data_info or {}).get("vocab_size", 256)}
        if recipe.batch.sequence_length:
            extra["block_size"] = recipe.batch.sequence_length
    model = _call(recipe.model, "model", builtins.MODELS, extra)
    if not isinstance(model, nn.Module):
        raise UserError(f"model: the factory must return a torch.nn.Module (got {type(model).__name__})")
    return model


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _upcast(output: torch.Tensor) -> torch.Tensor:
    """Half-precision logits (autocast) are upcast for the loss; float32 and float64 are kept as they are."""
    return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output


class SampleLoss:
    """Classification: summed cross-entropy; every sample bears loss."""

    def count(self, target: torch.Tensor) -> int:
        return int(target.shape[0])

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_upcast(output), target, reduction="sum")


class TokenLoss:
    """Language modelling: summed cross-entropy over target tokens that are not IGNORE_INDEX."""

    def count(self, target: torch.Tensor) -> int:
        return int((target != IGNORE_INDEX).sum())

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            _upcast(output.flatten(0, -2)), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )


class CustomLoss:
    def __init__(self, function: Callable):
        self.function = function
        self.counter = getattr(function, "count", None)

    def count(self, target: Any) -> int:
        return int(self.counter(target)) if self.counter else len(target)

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        return self.function(output, target)


def build_loss(recipe: Recipe) -> SampleLoss | TokenLoss | CustomLoss:
    if recipe.task == "classification":
        return SampleLoss()
    if recipe.task == "language-modeling":
        return TokenLoss()
    function = _call(recipe.loss, "loss", {})
    if not callable(function):
        raise UserError(f"loss: the factory must return a callable (got {type(function).__name__})")
    return CustomLoss(function)
