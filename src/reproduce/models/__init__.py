"""Models: the one place the training loop, the probe and verify build a recipe's model.

`build_model(recipe, data_info)` gives an `nn.Module` for a built-in name (`MODELS`: the small built-ins and the
papers' architectures), the user's own `factory:`, or a Hugging Face model (`hf:`, local files only), starting from
the pretrained weights of `model.weights` when it names some (models/pretrained.py), with its weights in
`model.dtype` and, with `model.lora`, LoRA adapters. `model_inputs(recipe)` says what the model fixes
about its inputs (vocabulary, context, image size), so data that is not on this machine can still be given a shape.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError
from ..plan.factory import call_builder
from ..plan.recipe import Recipe
from ..plan.weightfiles import WeightsOnDisk
from . import small
from .architectures import ARCHITECTURES
from .architectures import LOSSES as LOSSES
from .normalization import convert, count_batchnorm, is_batchnorm, set_momentum
from .pretrained import (
    builtin_from_folder,
    check_state_dict_file,
    folder_inputs,
    load_hf_model,
    load_state_dict_file,
    on_meta,
    weights_of,
    wrap_transformers,
)
from .segmentation import SEGMENTATION_MODELS
from .vocabulary import check_vocabulary
from .weights import adapt, place

__all__ = [
    "LOSSES", "MODELS", "build_model", "count_batchnorm", "count_parameters", "counted_batchnorm", "has_batchnorm",
    "model_inputs", "parameter_counts", "place",
]

BUILT_IN = {**ARCHITECTURES, **SEGMENTATION_MODELS}  # the papers' architectures, built from their libraries
MODELS = {**small.MODELS, **BUILT_IN}


def build_model(recipe: Recipe, data_info: dict | None = None) -> nn.Module:
    spec = recipe.model
    weights = weights_of(recipe)  # a missing path, a folder without config.json or weights: one line
    name = spec.builtin or spec.factory or spec.hf or "the model"
    if weights is not None and not weights.is_folder:  # keys and shapes checked strictly, on a model of no memory
        if not on_meta():
            with torch.device("meta"):
                check_state_dict_file(architecture(recipe, None, data_info), weights, name)
        model = architecture(recipe, weights, data_info)
        load_state_dict_file(model, weights, name)  # into the architecture as published, before model.batchnorm
    else:
        model = architecture(recipe, weights, data_info)
    model = convert(model, spec.batchnorm)
    if spec.batchnorm_momentum is not None:
        set_momentum(model, spec.batchnorm_momentum)
    check_vocabulary(model, data_info)  # token ids the embedding has no row for: refused before any step
    model = adapt(model, recipe)
    if spec.activation_checkpointing:  # before DDP and FSDP2 wrap it: they see the checkpointed blocks
        from .checkpointing import enable

        enable(model, name, selective=spec.selective_checkpointing)
    if spec.loss_chunks:  # the head applied by the loss, chunk by chunk (train/chunked_loss.py)
        from .loss_head import defer_head

        if model_inputs(recipe).get("targets") == "mlm-nsp":
            raise UserError(f"model.loss_chunks: {name} trains with its own pre-training loss (masked LM and next "
                            "sentence), which the chunked next-token loss does not replace; leave loss_chunks out")

        defer_head(model, name)
    if spec.offload_activations:
        from .offload import offload_activations

        model = offload_activations(model)
    return model


def architecture(recipe: Recipe, weights: WeightsOnDisk | None, data_info: dict | None) -> nn.Module:
    """The recipe's model before any adaptation: built, or loaded from a Hugging Face folder."""
    spec = recipe.model
    if spec.hf is not None:
        return load_hf_model(recipe, data_info, weights)
    if weights is not None and weights.is_folder:  # the folder's own config is the architecture
        return builtin_from_folder(recipe, weights, data_info)
    if spec.builtin in SEGMENTATION_MODELS:
        declared = {"classes": recipe.data.classes} if recipe.data.classes else {}  # the data's own count first
        return SEGMENTATION_MODELS[spec.builtin].build(segmentation_kwargs(recipe), {**declared, **(data_info or {})})
    if spec.builtin in ARCHITECTURES:
        return ARCHITECTURES[spec.builtin].build(spec.kwargs, data_info)
    extra = {}
    if spec.builtin == "gpt":
        extra = {"vocab_size": (data_info or {}).get("vocab_size", 256)}
        if recipe.batch.sequence_length:  # the longest sequence of any batch phase
            extra["block_size"] = recipe.batch.longest_sequence_length
    model = call_builder(spec, "model", MODELS, extra)
    if not isinstance(model, nn.Module):
        raise UserError(f"model: the factory must return a torch.nn.Module (got {type(model).__name__})")
    return wrap_transformers(model, recipe)


def segmentation_kwargs(recipe: Recipe) -> dict:
    """A segmentation model's kwargs: the recipe's, with model.output_stride and model.aux_weight."""
    spec = recipe.model
    extra = {"output_stride": spec.output_stride, "aux_loss": spec.aux_weight is not None}
    return {**spec.kwargs, **{key: value for key, value in extra.items() if value is not None}}


def model_inputs(recipe: Recipe) -> dict:
    """What the recipe's built-in model fixes about its inputs; {} for a factory or Hugging Face model.

    Token models: `{"inputs": "tokens", "vocab_size": V, "context": T}` (the longest sequence it takes, or None);
    image models: `{"inputs": "images", "channels": C, "classes": K, "image_size": S}` (image_size only where
    the architecture fixes it, as ViT's position embeddings do; classes is its default head, which the data's
    classes override).
    """
    spec = recipe.model
    kwargs = spec.kwargs
    if spec.weights is not None and spec.builtin in ARCHITECTURES:
        weights = weights_of(recipe)
        if weights.is_folder:  # the folder's config is the architecture
            return folder_inputs(ARCHITECTURES[spec.builtin], weights.config, kwargs)
    if spec.builtin in BUILT_IN:
        return BUILT_IN[spec.builtin].model_inputs(kwargs)
    if spec.builtin == "gpt":
        return {"inputs": "tokens", "vocab_size": kwargs.get("vocab_size", 256), "context": kwargs.get("block_size")}
    if spec.builtin in ("cnn-bn", "cnn-gn"):  # the digits: 1 x 8 x 8
        return {"inputs": "images", "channels": 1, "image_size": 8, "classes": kwargs.get("classes", 10)}
    if spec.builtin == "mlp":
        return {"inputs": "vectors", "features": kwargs.get("inputs", 64), "classes": kwargs.get("classes", 10)}
    return {}


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, those that train); `parameters()` counts a tied parameter once."""
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)


def parameter_counts(recipe: Recipe, data_info: dict | None = None) -> tuple[int, int]:
    """(all parameters, those that train) of the recipe's model, built on the meta device: no memory, no weights.
    Counted unquantised: bitsandbytes packs two 4-bit weights in a byte, so a quantised base would count half."""
    plain = recipe.model_copy(update={"model": recipe.model.model_copy(update={"quantize": None})})
    with torch.device("meta"):
        return count_parameters(build_model(plain, data_info))


def counted_batchnorm(recipe: Recipe, data_info: dict | None = None) -> int | None:
    """The BatchNorm layers of a factory model as the recipe builds it with `batchnorm: keep`, counted on the meta
    device (no memory, no weights); None for other models (built-ins are known: plan/batchnorm.py)."""
    if recipe.model.factory is None:
        return None
    kept = recipe.model_copy(update={"model": recipe.model.model_copy(update={"batchnorm": "keep"})})
    with torch.device("meta"):
        return count_batchnorm(build_model(kept, data_info))


def has_batchnorm(model: nn.Module) -> bool:
    return any(is_batchnorm(m) for m in model.modules())
