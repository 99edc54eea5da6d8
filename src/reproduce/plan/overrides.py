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
from pydantic import ValidationError

from ..errors import UserError
from .recipe import Recipe
from .validation import UniqueKeyLoader, format_validation_errors

SHOWN_AT_MOST = 80  # characters of an override echoed in a message


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_AT_MOST else text[:SHOWN_AT_MOST] + "..."


def parse_override(text: str) -> tuple[list[str], Any]:
    """`PATH=VALUE` as (the path's parts, the value read as YAML)."""
    shown = _shown(text)
    path, sep, raw = text.partition("=")
    parts = path.strip().split(".")
    if not sep or not all(part.strip() for part in parts):
        raise UserError(f"--set {shown}: expected FIELD.PATH=VALUE, e.g. --set optimizer.lr=1e-4")
    try:
        value = yaml.load(raw, Loader=UniqueKeyLoader) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"--set {shown}: the value is not YAML: {problem}") from None
    return [part.strip() for part in parts], value


def _put(data: dict[str, Any], parts: list[str], value: Any, shown: str) -> None:
    """Set `value` at `parts` in the nested mapping `data`, making the mappings on the way that are not there."""
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(f"--set {shown}: {where}: expected an item number below {len(node)} of the list")
            index = int(part)
            if last:
                node[index] = value
            else:
                node = node[index]
            continue
        if not isinstance(node, dict):
            raise UserError(f"--set {shown}: {'.'.join(parts[:depth])}: is {node!r}, not a mapping of fields")
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]


def overrides_of_recipe(recipe: Recipe, overrides: Sequence[str], plan_file: bool, source: str) -> Recipe:
    """`apply_overrides` on a recipe file's recipe; a plan file's recipe is what its plan was made for: refused."""
    if overrides and plan_file:
        raise UserError(f"--set: {source} is a plan file, whose recipe its plan was made for; give the recipe file "
                        "to set its fields (a resumed run's plan.yaml already holds the fields it was started with)")
    return apply_overrides(recipe, overrides)


def apply_overrides(recipe: Recipe, overrides: Sequence[str]) -> Recipe:
    """`recipe` with each `PATH=VALUE` of `overrides` applied in order, validated again as a whole."""
    if not overrides:
        return recipe
    data = recipe.model_dump(mode="json")
    for text in overrides:
        parts, value = parse_override(text)
        _put(data, parts, value, _shown(text))
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:  # the file alone was valid: the overrides made it wrong
        raise UserError(*format_validation_errors(exc, "--set", Recipe)) from None
