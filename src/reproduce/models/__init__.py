"""Models: the one place the training loop, the probe and verify build a recipe's model.

`build_model(recipe, data_info)` gives an `nn.Module` for a built-in name (`MODELS`), the user's own
`factory:`, or a Hugging Face model (`hf:`, local files only).
"""

from __future__ import annotations

from torch import nn

from ..errors import UserError
from ..factory import call_builder
from ..recipe import Recipe
from . import small
from .hf import load_hf_model

MODELS = dict(small.MODELS)


def build_model(recipe: Recipe, data_info: dict | None = None) -> nn.Module:
    if recipe.model.hf is not None:
        return load_hf_model(recipe, data_info)
    extra = {}
    if recipe.model.builtin == "gpt":
        extra = {"vocab_size": (data_info or {}).get("vocab_size", 256)}
        if recipe.batch.sequence_length:  # the longest sequence of any batch phase
            extra["block_size"] = recipe.batch.longest_sequence_length
    model = call_builder(recipe.model, "model", MODELS, extra)
    if not isinstance(model, nn.Module):
        raise UserError(f"model: the factory must return a torch.nn.Module (got {type(model).__name__})")
    return model


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
