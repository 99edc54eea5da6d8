"""Reading a recipe file (YAML reading and error formatting: plan/validation.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ...errors import UserError
from ..validation import format_validation_errors, read_yaml
from .recipe import Recipe


def load_recipe(path: str | Path) -> Recipe:
    data = read_yaml(path)
    if data.get("format", "").startswith("reproduce-plan"):
        raise UserError(f"{path}: this is a plan file, not a recipe; give the recipe it was made from")
    from ..factory import remember_folder  # its factories are looked for beside it first

    remember_folder(path)
    return parse_recipe(data, source=str(path))


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(*format_validation_errors(exc, source, Recipe)) from None
