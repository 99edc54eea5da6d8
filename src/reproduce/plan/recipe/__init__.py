"""The recipe: one paper's batch recipe as published, read from YAML and validated strictly. No torch.

`load_recipe(path)` returns a `Recipe` or raises one `UserError` listing every problem, one line each:
`papers/x.yaml: batch.effective: must be > 0 (got -3)`. One module a section; the names other modules read through
the package are re-exported here."""

from .common import Length, Strict
from .data import (
    DATA_FORMATS,
    FIELD_FORMATS,
    PACKING_WAYS,
    ChatData,
    FileData,
    HfDatasetsData,
    ImageFolderData,
    InstructionsData,
    NamedData,
    SegmentationData,
    TextData,
    TokensData,
)
from .evaluation import REPORTED_METRICS, Evaluation, Reported
from .gates import Gate, GateAt, Reference
from .model import QUANTIZED_BASES, SEGMENTATION_MODELS, Lora
from .recipe import Budget, Recipe, default_packing, load_recipe, parse_recipe
from .schedule import Decay

__all__ = [
    "DATA_FORMATS", "FIELD_FORMATS", "PACKING_WAYS", "QUANTIZED_BASES", "REPORTED_METRICS", "SEGMENTATION_MODELS",
    "Budget", "ChatData", "Decay", "Evaluation", "FileData", "Gate", "GateAt", "HfDatasetsData", "ImageFolderData",
    "InstructionsData", "Length", "Lora", "NamedData", "Recipe", "Reference", "Reported", "SegmentationData", "Strict",
    "TextData", "TokensData", "default_packing", "load_recipe", "parse_recipe"
]
