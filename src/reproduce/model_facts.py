"""What the session knows of a recipe's model before a run builds it: its pretrained weights' record, a
factory's BatchNorm layers, a built-in's parameter counts. Torch is imported only where something is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .errors import UserError
from .plan.builtin_names import MODELS
from .plan.overlay import variant
from .plan.recipe import Recipe
from .plan.weightfiles import WeightsRecord
from .plan.weightfiles import inspect as inspect_weights
from .plan.weightfiles import record as weights_record
from .probe import cache

if TYPE_CHECKING:
    from .data import Datasets


def weights_of(recipe: Recipe) -> WeightsRecord | None:
    """The record of the pretrained weights a run of `recipe` starts from; None for random weights."""
    spec = recipe.model
    if spec.weights is None:
        return None
    builtin, vocab = None, None
    if spec.builtin is not None and Path(spec.weights).expanduser().is_dir():
        from .models.architectures import ARCHITECTURES  # (torch: only for a folder in place of a built-in)
        from .models.pretrained import check_family

        check_family(spec.builtin, inspect_weights(spec.weights))
        builtin = getattr(ARCHITECTURES.get(spec.builtin), "config", None)
        vocab = spec.kwargs.get("vocab_size")  # (builtin_from_folder widens the folder's embeddings to it)
    return weights_record(spec.weights, builtin, vocab)


def count_factory_batchnorm(recipe: Recipe, data: Datasets | None) -> int | None:
    """The BatchNorm layers of the user's factory model, counted on the meta device; None
    for other models and for a factory that needs its data (the run counts the built model). A segmentation factory
    whose logits are not the data's classes is refused here, as the run would."""
    if recipe.model.factory is None:
        return None
    from .models import build_on_meta, count_batchnorm  # imports torch: only for a factory model
    from .models.segmentation import ClassesDiffer

    try:
        kept = variant(recipe, {"model.batchnorm": "keep"})  # its own layers, before model.batchnorm converts them
        return count_batchnorm(build_on_meta(kept, data.info if data else None))
    except ClassesDiffer:  # built: its logits are not the data's classes (models/segmentation.check_output_classes)
        raise
    except Exception:  # not importable here, or needs its data's shape: the run builds it (and says what fails)
        return None


def parameter_counts(recipe: Recipe, build: bool = True) -> tuple[int, int] | None:
    """(all, trainable) parameters of a built-in model (built unquantised on the meta device); None for a factory or
    Hugging Face model. Kept in the probe's cache, so `build=False` only reads it (and imports no torch)."""
    if recipe.model.builtin not in MODELS:
        return None
    versions = {"reproduce": __version__, **cache.library_versions()}
    key = cache.cache_key({"parameters": recipe.model_dump(mode="json"), "versions": versions,
                           "counted": "unquantised"})
    saved = cache.load(key)
    if saved is not None and isinstance(saved.get("parameters"), int) and isinstance(saved.get("trainable"), int):
        return saved["parameters"], saved["trainable"]
    if not build:
        return None
    from .models import build_on_meta, count_parameters
    from .probe.workload import synthetic_data

    try:
        info = synthetic_data(recipe).info  # the head and vocabulary the recipe's data declares
    except UserError:
        info = None
    try:
        total, trainable = count_parameters(build_on_meta(variant(recipe, {"model.quantize": None}), info))
    except (UserError, ImportError):
        return None
    cache.store(key, {"parameters": total, "trainable": trainable})
    return total, trainable
