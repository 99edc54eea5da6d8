"""Models: the one place the run, the probe and verify build a recipe's model (a built-in of `MODELS`, a
`factory:`, or `hf:` from local files), from `model.weights` when it names some, in `model.dtype`, with LoRA.

`model.batchnorm` answers what accumulation cannot make exact (BatchNorm normalises each micro-batch by its own
statistics): `sync` is SyncBatchNorm (train/setup.py), `frozen` torchvision's FrozenBatchNorm2d (Detectron2's practice),
`group` GroupNorm (Wu & He 2018, arXiv 1803.08494) in 32 groups, or the largest divisor of the channels below it.
"""

from __future__ import annotations

import json
import math
import sys

import torch
from torch import nn

from ..errors import UserError
from ..plan.builtin_names import hf_model_folder
from ..plan.factory import call_builder, rejected
from ..plan.recipe import Recipe, SegmentationData
from ..plan.weightfiles import WeightsOnDisk
from . import checkpointing, small
from .architectures import ARCHITECTURES, SEGMENTATION_MODELS
from .architectures import LOSSES as LOSSES
from .hf import HFLogits
from .pretrained import builtin_from_folder, check_state_dict_file, load_hf_model, load_state_dict_file
from .segmentation import check_output_classes, load_backbone
from .weights import adapt, on_meta, place, weights_of

__all__ = [
    "LOSSES", "MODELS", "build_model", "check_context", "count_batchnorm", "count_parameters",
    "model_inputs", "place",
]

BATCHNORM = nn.modules.batchnorm._BatchNorm  # normalises by batch statistics (torchvision's FrozenBatchNorm2d does not)
GROUPS = 32  # Wu & He 2018, sec. 4: "we use G = 32 by default"
# attribute names of a token embedding, for models that do not say (`get_input_embeddings`)
TOKEN_EMBEDDING_NAMES = ("token", "tokens", "wte", "tok_emb", "tok_embeddings", "token_embedding", "embed_tokens",
                         "word_embeddings", "embedding", "embeddings")
BUILT_IN = {**ARCHITECTURES, **SEGMENTATION_MODELS}  # the papers' architectures, built from their libraries
MODELS = {**small.MODELS, **BUILT_IN}


def build_model(recipe: Recipe, data_info: dict | None = None) -> nn.Module:
    spec = recipe.model
    weights = weights_of(recipe)  # a missing path, a folder without config.json or weights: one line
    name = spec.builtin or spec.factory or spec.hf or "the model"
    if weights is not None and not weights.is_folder:  # keys and shapes checked strictly, on a model of no memory
        converted_keys = keys_after_conversion(recipe, weights, data_info, name)
        model = architecture(recipe, weights, data_info)
        if converted_keys:  # the tool's own model.pt of a frozen / group run: loaded after the same conversion
            model = convert(model, spec.batchnorm)
        load_state_dict_file(model, weights, name)  # else into the architecture as published, before the conversion
    else:
        model = architecture(recipe, weights, data_info)
        if spec.backbone_weights is not None:  # ImageNet weights into the backbone, before model.batchnorm
            load_backbone(model, recipe)
    model = convert(model, spec.batchnorm)
    if recipe.task == "segmentation" and recipe.data.classes:  # one line now, not at the first evaluation
        crop = recipe.data.crop if isinstance(recipe.data, SegmentationData) else None
        check_output_classes(model, recipe.data.classes, crop, name)
    if spec.batchnorm_momentum is not None:
        for module in model.modules():  # new = (1 - m) x old + m x batch (TensorFlow's decay is 1 - m)
            if isinstance(module, BATCHNORM):
                module.momentum = spec.batchnorm_momentum
    check_vocabulary(model, data_info)  # token ids the embedding has no row for: refused before any step
    if recipe.data.packing == "packed":  # a transformers model on sdpa attends through the varlen attention
        from .varlen import use_varlen

        use_varlen(model)
    model = adapt(model, recipe)
    if spec.activation_checkpointing:  # before DDP and FSDP2 wrap it: they see the checkpointed blocks
        checkpointing.enable(model, name, selective=spec.selective_checkpointing)
    if spec.loss_chunks:  # the head applied by the loss, chunk by chunk (train/losses.py)
        if model_inputs(recipe).get("targets") == "mlm-nsp":
            raise UserError(f"model.loss_chunks: {name} trains with its own pre-training loss (masked LM and next "
                            "sentence), which the chunked next-token loss does not replace; leave loss_chunks out")

        checkpointing.defer_head(model, name)
    if spec.offload_activations:
        model = checkpointing.offload_activations(model)
    return model


def build_on_meta(recipe: Recipe, data_info: dict | None = None) -> nn.Module:
    """`build_model` on the meta device: its shapes and parameters, no memory."""
    with torch.device("meta"):
        return build_model(recipe, data_info)


def keys_after_conversion(recipe: Recipe, weights: WeightsOnDisk, data_info: dict | None, name: str) -> bool:
    """Whether the file holds the keys after `model.batchnorm`'s conversion (a model.pt written by a run)."""
    with torch.device("meta"):
        try:
            check_state_dict_file(architecture(recipe, None, data_info), weights, name)
            return False
        except UserError as published:
            if recipe.model.batchnorm not in ("frozen", "group"):
                raise
            try:
                check_state_dict_file(convert(architecture(recipe, None, data_info), recipe.model.batchnorm),
                                      weights, name)
            except UserError:
                raise published from None
            return True


def architecture(recipe: Recipe, weights: WeightsOnDisk | None, data_info: dict | None) -> nn.Module:
    """The recipe's model before any adaptation: built, or loaded from a Hugging Face folder."""
    spec = recipe.model
    if spec.hf is not None or (weights is not None and weights.is_folder):  # (the folder's config is the architecture)
        return load_hf_model(recipe, data_info, weights) if spec.hf is not None else builtin_from_folder(
            recipe, weights, data_info)
    try:
        if spec.builtin in SEGMENTATION_MODELS:  # the recipe's kwargs with model.output_stride and model.aux_weight
            extra = {"output_stride": spec.output_stride, "aux_loss": spec.aux_weight is not None}
            kwargs = {**spec.kwargs, **{key: value for key, value in extra.items() if value is not None}}
            declared = {"classes": recipe.data.classes} if recipe.data.classes else {}  # the data's own count first
            return SEGMENTATION_MODELS[spec.builtin].build(kwargs, {**declared, **(data_info or {})})
        if spec.builtin in ARCHITECTURES:
            return ARCHITECTURES[spec.builtin].build(spec.kwargs, data_info)
    except UserError:
        raise
    except Exception as exc:  # the architecture's own error for the recipe's kwargs
        if on_meta() and not isinstance(exc, TypeError):  # a count's build: its caller says what it could not do
            raise
        raise rejected("model.kwargs", str(spec.builtin), exc) from None
    extra = {}
    if spec.builtin == "gpt":
        extra = {"vocab_size": (data_info or {}).get("vocab_size", 256)}
        if recipe.batch.sequence_length:  # the longest sequence of any batch phase
            extra["block_size"] = recipe.batch.sequence_lengths[-1]
    model = call_builder(spec, "model", MODELS, extra, own_errors=on_meta())  # (a count's build: its caller says)
    if not isinstance(model, nn.Module):
        raise UserError(f"model: the factory must return a torch.nn.Module (got {type(model).__name__})")
    transformers = sys.modules.get("transformers")  # (a factory that returned a transformers model imported it)
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return model
    # its forward returns a ModelOutput: its logits, with the head the task needs (HFLogits)
    kind = {"language-modeling": "masked-lm" if "MaskedLM" in type(model).__name__ else "causal-lm",
            "classification": "sequence-classification"}.get(recipe.task)
    if kind is None:
        raise UserError(f"model: the factory returned transformers' {type(model).__name__}, whose forward returns a "
                        f"ModelOutput; task {recipe.task} needs a module whose output the loss takes: return one "
                        "that gives it")
    return HFLogits(model, kind)


def model_inputs(recipe: Recipe) -> dict:
    """What the recipe's model fixes about its inputs (tokens: vocab_size, context; images: channels, classes,
    image_size), so data not on this machine can be given a shape; {} for a factory."""
    spec = recipe.model
    kwargs = spec.kwargs
    if spec.hf is not None:  # the folder's positions (RoBERTa's less the padding index + 1); {} if not here
        weights = weights_of(recipe)
        folder = weights.path if weights is not None and weights.is_folder else hf_model_folder(spec.hf)
        if folder is None or not (folder / "config.json").is_file():
            return {}
        config = json.loads((folder / "config.json").read_text())
        positions = config.get("n_positions") or config.get("max_position_embeddings")
        if positions and "roberta" in str(config.get("model_type")):
            positions -= int(config.get("pad_token_id") or 1) + 1
        return {"context": positions} if positions else {}
    arch = BUILT_IN.get(spec.builtin or "")
    weights = weights_of(recipe) if spec.builtin in ARCHITECTURES else None
    if weights is not None and weights.is_folder and arch.library == "transformers" and arch.kind != "mae":
        config = weights.config  # the folder's config is the architecture
        context = kwargs.get("block_size") or config.get("n_positions") or config.get("max_position_embeddings")
        return arch.token_inputs(kwargs.get("vocab_size", config.get("vocab_size")), context)
    if arch is not None:
        return arch.model_inputs(kwargs)
    if spec.builtin == "gpt":
        return {"inputs": "tokens", "vocab_size": kwargs.get("vocab_size", 256), "context": kwargs.get("block_size")}
    if spec.builtin in ("cnn-bn", "cnn-gn"):  # the digits: 1 x 8 x 8
        return {"inputs": "images", "channels": 1, "image_size": 8, "classes": kwargs.get("classes", 10)}
    if spec.builtin == "mlp":
        return {"inputs": "vectors", "features": kwargs.get("inputs", 64), "classes": kwargs.get("classes", 10)}
    return {}


def check_context(recipe: Recipe, fixed: dict | None = None) -> None:
    """The recipe's longest sequence within the model's positions, checked before any data is read."""
    length = recipe.batch.sequence_length or recipe.data.max_length
    context = (model_inputs(recipe) if fixed is None else fixed).get("context")
    if length is None or context is None or length <= context:
        return
    source = "batch.sequence_length" if recipe.batch.sequence_length else "data.max_length"
    spec = recipe.model
    name = spec.builtin or spec.hf or spec.factory
    weights = weights_of(recipe)
    where = f" (its config.json in {weights.path})" if weights is not None and weights.is_folder else ""
    raise UserError(f"{source}: {length} tokens is longer than {name}{where} takes ({context} positions)")


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, those that train): a tied one once, a quantised or sharded one by its whole shape."""
    parameters = list(model.parameters())
    sizes = [(state.shape.numel() if (state := getattr(p, "quant_state", None)) is not None else p.numel(),
              p.requires_grad) for p in parameters]
    return sum(size for size, _ in sizes), sum(size for size, trains in sizes if trains)


def count_batchnorm(model: nn.Module) -> int:
    """The BatchNorm layers of `model` (any dimension, SyncBatchNorm included)."""
    return sum(1 for module in model.modules() if isinstance(module, BATCHNORM))


def convert(model: nn.Module, mode: str) -> nn.Module:
    """`model` with every BatchNorm frozen (its parameters and statistics kept) or a fresh GroupNorm, by `mode`."""
    if mode not in ("frozen", "group"):
        return model
    if not isinstance(model, BATCHNORM):
        for name, child in model.named_children():
            converted = convert(child, mode)
            if converted is not child:
                setattr(model, name, converted)
        return model
    if mode == "group":
        new: nn.Module = nn.GroupNorm(math.gcd(GROUPS, model.num_features), model.num_features)
    else:
        from torchvision.ops.misc import FrozenBatchNorm2d

        new = FrozenBatchNorm2d(model.num_features)
        new.eps = model.eps
        with torch.no_grad():
            if model.affine:
                new.weight.copy_(model.weight)
                new.bias.copy_(model.bias)
            if model.track_running_stats:
                new.running_mean.copy_(model.running_mean)
                new.running_var.copy_(model.running_var)
    device = next(iter(model.parameters()), next(iter(model.buffers()), None))
    return new if device is None else new.to(device=device.device, dtype=device.dtype)


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's token embedding: as a Hugging Face model names it, by a usual name, or its only nn.Embedding."""
    for module in model.modules():
        getter = getattr(module, "get_input_embeddings", None)
        if callable(getter):
            try:
                found = getter()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(found, nn.Embedding):
                return found
    embeddings = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
    for name, module in embeddings:
        if name.rsplit(".", 1)[-1] in TOKEN_EMBEDDING_NAMES:
            return module
    return embeddings[0][1] if len(embeddings) == 1 else None


def check_vocabulary(model: nn.Module, info: dict | None) -> None:
    """Token ids the embedding has no row for (each token file's largest, in `info`): one line before a step."""
    info = info or {}
    if "max_token_id" not in info:
        return
    embedding = input_embedding(model)
    if embedding is None:
        return
    vocab = embedding.num_embeddings
    meta = info.get("meta_vocab_size")
    meta_note = f"; meta.pkl beside it says vocab_size {meta}" if meta else ""
    for field, path, key in (("data.path", info.get("path"), "max_token_id"),
                             ("data.eval_path", info.get("eval_path"), "eval_max_token_id")):
        largest = info.get(key)
        if largest is not None and largest >= vocab:
            raise UserError(
                f"{field}: {path}: token ids up to {largest}, but the model's vocabulary has {vocab} ids "
                f"(0-{vocab - 1}){meta_note}: is this data tokenised for this model (data.dtype {info.get('dtype')})?"
            )
    if meta and meta > vocab:
        raise UserError(f"data.path: {info.get('path')}: meta.pkl beside it says vocab_size {meta}, but the model's "
                        f"vocabulary has {vocab} ids")
