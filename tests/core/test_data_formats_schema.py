"""The recipe's `data:` as a union on `format`: each format's class takes only its own fields, a field of another
format is one line naming the formats that take it, and a recipe's dump reads back as the same recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from reproduce.errors import UserError
from reproduce.plan.overlay import Change, overlay, resumed
from reproduce.plan.recipe import (
    DATA_FORMATS,
    FIELD_FORMATS,
    ChatData,
    HfDatasetsData,
    ImageFolderData,
    InstructionsData,
    NamedData,
    SegmentationData,
    TokensData,
    load_recipe,
    parse_recipe,
)

PAPERS = Path(__file__).resolve().parents[2] / "papers"
BASE = {
    "batch": {"effective": 32, "sequence_length": 64},
    "task": "custom",
    "model": {"builtin": "mlp"},
    "loss": {"builtin": "mae-masked-pixel-mse"},
    "optimizer": {"name": "sgd", "lr": 0.1},
    "schedule": {"total": {"steps": 10}},
}
# one data mapping of each kind, each valid as it stands
KINDS = {
    ImageFolderData: {"format": "imagefolder", "available": False, "augment": "none", "image_size": 8},
    TokensData: {"format": "tokens", "available": False, "dtype": "uint16"},
    InstructionsData: {"format": "instructions", "path": "a.jsonl", "template": "alpaca-lora", "tokenizer": "tok"},
    ChatData: {"format": "chat", "available": False, "eval_fraction": 0.1},
    HfDatasetsData: {"format": "hf-datasets", "available": False, "columns": {"text": "content"}},
    SegmentationData: {"format": "segmentation", "available": False, "crop": 33, "layout": "voc"},
    NamedData: {"builtin": "digits", "kwargs": {"seed": 1}},
}


def recipe_with(data: dict) -> dict:
    return {**BASE, "data": data}


def error(data: dict) -> str:
    with pytest.raises(UserError) as caught:
        parse_recipe(recipe_with(data), source="r.yaml")
    assert len(caught.value.lines) == 1
    return caught.value.lines[0]


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda kind: kind.__name__)
def test_each_format_reads_as_its_own_class_and_its_dump_reads_back(kind):
    recipe = parse_recipe(recipe_with(KINDS[kind]))
    assert type(recipe.data) is kind
    assert parse_recipe(recipe.model_dump(mode="json")) == recipe


def test_a_class_holds_only_the_fields_of_its_format():
    assert "dtype" in TokensData.model_fields and "dtype" not in ImageFolderData.model_fields
    assert "path" not in NamedData.model_fields and "builtin" not in TokensData.model_fields
    assert {"crop", "layout", "masks", "loss_pixels"} <= set(SegmentationData.model_fields)
    assert "tokenizer" in ChatData.model_fields and not {"crop", "layout", "columns"} & set(ChatData.model_fields)
    # the formats a field goes with are read from the classes, in DATA_FORMATS' order
    assert FIELD_FORMATS["augment"] == ("imagefolder", "hf-datasets")
    assert FIELD_FORMATS["tokenizer"] == ("instructions", "chat", "hf-datasets")
    assert FIELD_FORMATS["columns"] == ("instructions", "hf-datasets")
    assert FIELD_FORMATS["path"] == DATA_FORMATS


@pytest.mark.parametrize(("data", "line"), [
    ({"format": "imagefolder", "available": False, "dtype": "uint16"},
     "r.yaml: data.dtype: only used with format tokens (format is imagefolder)"),
    ({"format": "chat", "available": False, "columns": {"instruction": "q", "output": "a"}},
     "r.yaml: data.columns: only used with format instructions or hf-datasets (format is chat)"),
    ({"format": "tokens", "available": False, "crop": 5},
     "r.yaml: data.crop: only used with format segmentation (format is tokens)"),
    ({"builtin": "digits", "path": "x"},
     "r.yaml: data.path: only used with format: " + " | ".join(DATA_FORMATS)),
    ({"format": "imagefolder", "builtin": "digits", "path": "x"},
     "r.yaml: data.format: give format (with path) or builtin/factory, not both"),
    ({"format": "imagefolder", "available": False, "kwargs": {"a": 1}},
     "r.yaml: data.kwargs: only used with builtin or factory data (format is imagefolder)"),
    ({"format": "parquet", "path": "x"},
     "r.yaml: data.format: expected one of 'imagefolder', 'tokens', 'instructions', 'chat', 'hf-datasets' or "
     "'segmentation' (got 'parquet')"),
    ({"format": "imagefolder", "available": False, "augmnet": "none"},
     "r.yaml: data.augmnet: unknown key (did you mean 'augment'?)"),
    ({"format": "imagefolder"},
     "r.yaml: data.path: required for imagefolder data (a folder or file), or set available: false and give it on "
     "the command line: reproduce run `data_path` PATH"),
])
def test_a_field_the_format_does_not_take_is_one_line_naming_the_formats(data, line):
    assert error(data) == line


def test_another_formats_fields_left_null_are_dropped():
    """As a dump of one format holds them when `--set data.format=...` turns it into another."""
    recipe = parse_recipe(recipe_with({**KINDS[ImageFolderData], "dtype": None, "crop": None, "builtin": None}))
    assert type(recipe.data) is ImageFolderData
    tokens = overlay(recipe, [Change("data.format", "tokens", "--set"), Change("data.augment", None, "--set"),
                              Change("data.image_size", None, "--set")], "r.yaml")
    assert type(tokens.data) is TokensData and tokens.data.dtype is None
    with pytest.raises(UserError, match=r"^--set: data.dtype: only used with format tokens \(format is imagefolder\)$"):
        overlay(recipe, [Change("data.dtype", "uint8", "--set")], "r.yaml")


def test_an_override_of_a_shared_field_keeps_the_format():
    recipe = load_recipe(PAPERS / "taori2023-alpaca-7b.yaml")
    longer = overlay(recipe, [Change("data.max_length", 1024, "--set")], "r.yaml")
    assert type(longer.data) is InstructionsData and longer.data.max_length == 1024
    assert longer.data.template == recipe.data.template


@pytest.mark.parametrize("name", ["digits-mlp", "digits-imagefolder"])
def test_a_resume_compares_the_data_fields_its_format_has(tmp_path, name):
    """Built-in data has no data.path: the resume check neither adds one nor calls the recipes different."""
    recipe = load_recipe(PAPERS / f"{name}.yaml")
    assert resumed(recipe, [], recipe, tmp_path, "r.yaml") is recipe
    other = overlay(recipe, [Change("seed", 7, "--set")], "r.yaml")
    with pytest.raises(UserError, match="differs from the one"):
        resumed(other, [], recipe, tmp_path, "r.yaml")
