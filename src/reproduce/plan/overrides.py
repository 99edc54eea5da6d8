"""`--set PATH=VALUE`: any recipe field by its dotted path, as torchtune's `key=value` overrides.

`--set optimizer.lr=1e-4 --set data.max_length=1024 --set model.lora.target_modules=[q_proj,v_proj]`. The value
is read as YAML (a number, `true`, `null`, a `[list]` or a `{mapping}`), put at its path in the recipe's fields
(a number in the path is an item of a list: `batch.phases.1.effective`), and the whole recipe is validated again
as the file is, so an override obeys every rule the file does. A problem names the field's path after `--set`,
not the file: `--set: optimizer.lr: must be > 0 (got -1)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from ..errors import UserError
from .overlay import Change, overlay, shortened
from .recipe import Recipe
from .validation import UniqueKeyLoader


def parse_override(text: str) -> tuple[list[str], Any]:
    """`PATH=VALUE` as (the path's parts, the value read as YAML)."""
    shown = shortened(text)
    path, sep, raw = text.partition("=")
    parts = path.strip().split(".")
    if not sep or not all(part.strip() for part in parts):
        raise UserError(f"`overrides` {shown}: expected FIELD.PATH=VALUE, e.g. `overrides` optimizer.lr=1e-4")
    try:
        value = yaml.load(raw, Loader=UniqueKeyLoader) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"`overrides` {shown}: the value is not YAML: {problem}") from None
    return [part.strip() for part in parts], value


def changes_of(overrides: Sequence[str]) -> list[Change]:
    """Each `PATH=VALUE` of `overrides` (`--set` on the command line) as the change of its field."""
    return [Change(".".join(parts), value, "`overrides`") for parts, value in map(parse_override, overrides)]


def apply_overrides(recipe: Recipe, overrides: Sequence[str], source: str = "the recipe") -> Recipe:
    """`recipe` with each `PATH=VALUE` of `overrides` applied in order, validated again as a whole."""
    return overlay(recipe, changes_of(overrides), source)
