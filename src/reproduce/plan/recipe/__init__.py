"""The recipe: one paper's batch recipe as published, read from YAML and validated strictly. No torch.

`load_recipe(path)` returns a `Recipe` or raises one `UserError` listing every problem, one line each:
`papers/x.yaml: batch.effective: must be > 0 (got -3)`. One module a section; the names are re-exported here."""

from ..validation import read_yaml  # check/load.py reads YAML through here (as before the package)
from .batch import Batch, BatchPhase, BatchRamp
from .common import LENGTH_UNITS, Builder, Length, Name, Names, Strict
from .data import (
    DATA_FORMATS,
    DEFAULT_IGNORE_INDEX,
    FIELD_FORMATS,
    FORMATS,
    HF_COLUMN_SETS,
    INSTRUCTION_COLUMN_SETS,
    PACKING_WAYS,
    SEGMENTATION_LAYOUTS,
    TEMPLATES,
    TOKEN_DTYPES,
    BaseData,
    ChatData,
    Data,
    FileData,
    HfDatasetsData,
    ImageFolderData,
    InstructionsData,
    NamedData,
    SegmentationData,
    TextData,
    TokensData,
)
from .evaluation import LOSS_METRICS, PLATEAU_METRICS, REPORTED_METRICS, Evaluation, Reported
from .gates import AT_UNITS, RUN_METRICS, Gate, GateAt, Reference
from .model import (
    BATCHNORM_CHOICES,
    NORM_LAYERS,
    NORMALIZATIONS,
    QUANTIZED_BASES,
    SEGMENTATION_MODELS,
    WEIGHT_DTYPES,
    Lora,
    Loss,
    Model,
)
from .optimizer import ADAM_FAMILY, IMPLEMENTED_BY_TORCH, OPTIMIZER_IMPLEMENTATIONS, OPTIMIZERS, SGD_FAMILY, Optimizer
from .recipe import Budget, Paper, Recipe, default_packing, load_recipe, packing_problem, parse_recipe
from .schedule import PLATEAU_FIELDS, Decay, Milestones, Schedule, Warmup

__all__ = [
    "ADAM_FAMILY", "AT_UNITS", "RUN_METRICS", "Gate", "GateAt", "Reference",
    "BATCHNORM_CHOICES", "DATA_FORMATS", "DEFAULT_IGNORE_INDEX", "FIELD_FORMATS", "FORMATS",
    "HF_COLUMN_SETS", "IMPLEMENTED_BY_TORCH", "INSTRUCTION_COLUMN_SETS", "LENGTH_UNITS", "LOSS_METRICS",
    "NORMALIZATIONS", "NORM_LAYERS", "OPTIMIZERS", "OPTIMIZER_IMPLEMENTATIONS", "PACKING_WAYS", "PLATEAU_FIELDS",
    "PLATEAU_METRICS", "QUANTIZED_BASES", "REPORTED_METRICS", "SEGMENTATION_LAYOUTS", "SEGMENTATION_MODELS",
    "SGD_FAMILY", "TEMPLATES", "TOKEN_DTYPES", "WEIGHT_DTYPES", "BaseData", "Batch", "BatchPhase", "BatchRamp",
    "Budget", "Builder", "ChatData", "Data", "Decay", "Evaluation", "FileData", "HfDatasetsData", "ImageFolderData",
    "InstructionsData", "Length", "Lora", "Loss", "Milestones", "Model", "Name", "NamedData", "Names", "Optimizer",
    "Paper", "Recipe", "Reported", "Schedule", "SegmentationData", "Strict", "TextData", "TokensData", "Warmup",
    "default_packing", "load_recipe", "packing_problem", "parse_recipe", "read_yaml"
]
