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
    if recipe.model.hf is not None:
        return _hf_model(recipe, data_info)
    extra = {}
    if recipe.model.builtin == "gpt":
        extra = {"vocab_size": (data_info or {}).get("vocab_size", 256)}
        if recipe.batch.sequence_length:
            extra["block_size"] = recipe.batch.sequence_length
    model = _call(recipe.model, "model", builtins.MODELS, extra)
    if not isinstance(model, nn.Module):
        raise UserError(f"model: the factory must return a torch.nn.Module (got {type(model).__name__})")
    return model


HF_KIND_FOR_TASK = {"language-modeling": "causal-lm", "classification": "sequence-classification"}


class HFLogits(nn.Module):
    """A Hugging Face model whose forward returns only its logits, so the usual losses apply to it.

    causal-lm: (B, T, V) for input ids (B, T). No labels go to the model and nothing is shifted here: by the
    data contract the targets are already aligned with the inputs (target[t] is the token after input[t],
    -100 where no loss is taken), and TokenLoss sums over them and divides by the window's target tokens,
    exactly as for the built-in GPT. Right padding (collate pads inputs with 0) is harmless under causal
    attention, and padded positions carry target -100.
    sequence-classification: (B, C), for SampleLoss; the model finds each row's last token by pad_token_id.
    A dict input (input_ids, attention_mask, ...) is passed to the model as keyword arguments.
    """

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, inputs: Any) -> torch.Tensor:
        kwargs = dict(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}
        if self.kind == "causal-lm":
            kwargs.setdefault("use_cache", False)
        return self.model(**kwargs).logits


def _hf_model(recipe: Recipe, data_info: dict | None) -> nn.Module:
    """`model: {hf: NAME_OR_PATH}`: from a local folder or the local Hugging Face cache, never the network."""
    spec = recipe.model
    expected = HF_KIND_FOR_TASK.get(recipe.task)
    kind = spec.kind or expected
    if kind is None:
        raise UserError("model.kind: required with hf for task custom (causal-lm or sequence-classification)")
    if expected is not None and kind != expected:
        raise UserError(
            f"model.kind: {kind} does not fit task {recipe.task} (which needs {expected}: "
            f"{'token logits (B, T, V)' if expected == 'causal-lm' else 'one row of class logits per sample'})"
        )
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"model.hf: loading {spec.hf!r} needs transformers, which is not installed (pip install transformers)"
        ) from None
    auto = transformers.AutoModelForCausalLM if kind == "causal-lm" else transformers.AutoModelForSequenceClassification
    folder = Path(spec.hf).expanduser()
    if spec.hf.startswith(("/", ".", "~")) and not folder.is_dir():
        raise UserError(f"model.hf: no such folder {spec.hf!r}")
    try:
        model = auto.from_pretrained(str(folder) if folder.is_dir() else spec.hf, local_files_only=True, **spec.kwargs)
    except OSError:  # not in the folder nor in the local cache (local_files_only: nothing was fetched)
        raise UserError(
            f"model.hf: {spec.hf!r} is not on this machine (a local folder, or the local Hugging Face cache); "
            f"reproduce never downloads at run time: fetch it first (huggingface-cli download {spec.hf})"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"model.hf: cannot load {spec.hf!r} as {kind}: {type(exc).__name__}: {exc}") from None
    config = model.config
    vocab = (data_info or {}).get("vocab_size")
    if kind == "causal-lm" and vocab is not None and vocab > config.vocab_size:
        raise UserError(f"model.hf: the data has {vocab} token ids but {spec.hf!r} has a vocabulary of "
                        f"{config.vocab_size}")
    if kind == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        raise UserError(
            f"model.kwargs: {spec.hf!r} has no pad_token_id, which sequence classification needs to find each "
            "row's last token; inputs are padded with 0, so add kwargs: {pad_token_id: 0} if 0 is the padding id"
        )
    return HFLogits(model, kind)


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
