"""The overlay: what a command changes of a recipe, applied in one order and validated once (pure Python, no torch).

Every change is a recipe field by its dotted path: `--set optimizer.lr=1e-4` (its value YAML, a number in the path a
list item: `batch.phases.1.effective`, as torchtune's `key=value` overrides), or an option that aliases one
(`--weights` is `model.weights`). `--set` comes first, as if the file said it; a value carries its field's rules
(absolute paths, a BatchNorm choice recording the paper's). A problem line names how the field was given (`--packing:
data.packing: ...`), else the file. A resumed run (`resumed`) keeps the fields its plan.yaml was run with
(`FIXED_ON_RESUME`) and refuses any other difference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import UserError
from .recipe import DATA_FORMATS, Recipe
from .validation import UniqueKeyLoader, format_validation_errors

PATH_FIELDS = ("model.weights", "model.backbone_weights", "data.path", "data.eval_path")  # made absolute
FIXED_ON_RESUME = (
    "data.path", "data.eval_path", "data.available", "model.weights", "model.backbone_weights", "batch.sharding",
    "model.quantize", "model.activation_checkpointing", "batch.sharded_gradients", "batch.offload", "data.packing",
    "data.token_budget", "model.batchnorm", "model.paper_batchnorm",
)


@dataclass(frozen=True)
class Change:
    """One recipe field set by a command: its dotted `path`, the `value` (as YAML reads it), and `given_as`, how the
    user gave it, for messages (`--set`, an option's flag; a library caller may leave the path itself)."""

    path: str
    value: Any
    given_as: str = ""

    @property
    def label(self) -> str:
        return self.given_as or self.path


def variant(recipe: Recipe, fields: dict[str, Any]) -> Recipe:
    """A recipe the code derives from the user's to build or measure something (one phase's batch, the dtype
    `verify` checks in): `fields` (`section` or `section.field`) set without the rules between fields, never written
    to a plan. The one place, beside `overlay`, that changes a recipe."""
    for path, value in fields.items():
        section, _, name = path.partition(".")
        part = value if not name else getattr(recipe, section).model_copy(update={name: value})
        recipe = recipe.model_copy(update={section: part})
    return recipe


def phase_recipe(recipe: Recipe, sequences: int, sequence_length: int | None) -> Recipe:
    """`recipe` with one fixed batch of `sequences` samples of `sequence_length`, as one phase is planned and
    probed."""
    batch = recipe.batch
    effective = sequences * (sequence_length or batch.token_length) if batch.unit == "tokens" else sequences
    fixed = {"effective": effective, "sequence_length": sequence_length, "phases": None, "ramp": None,
             "devices": None, "per_device": None, "accumulation": None}
    return variant(recipe, {f"batch.{name}": value for name, value in fixed.items()})


def value_at(data: Any, path: str) -> Any:
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else (data or {}).get(part)
    return data


def put_at(data: dict[str, Any], parts: list[str], value: Any, shown: str) -> None:
    """Set `value` at `parts` in the nested mapping `data`, making the mappings on the way that are not there."""
    node: Any = data
    key: int | str
    for depth, part in enumerate(parts):
        last, key = depth == len(parts) - 1, part
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(f"{shown}: {'.'.join(parts[: depth + 1])}: expected an item number below {len(node)} "
                                "of the list")
            key = int(part)
        elif not isinstance(node, dict):
            raise UserError(f"{shown}: {'.'.join(parts[:depth])}: is {node!r}, not a mapping of fields")
        elif not last and node.get(part) is None:
            node[part] = {}
        if last:
            node[key] = value
        else:
            node = node[key]


def overlay(recipe: Recipe, changes: Sequence[Change], source: str) -> Recipe:
    """`recipe` with `changes` applied in order, validated once as a whole (the recipe itself when none)."""
    if not changes:
        return recipe
    data = recipe.model_dump(mode="json")
    for change in changes:
        value = change.value
        if change.path in PATH_FIELDS and value is not None:
            value = str(Path(str(value)).expanduser().absolute())
        if change.path in ("data.path", "data.eval_path"):
            _check_data_format(data, change, source)
        if change.path == "model.backbone_weights" and value is not None:
            from .weightfiles import inspect

            inspect(value, change.label)  # a missing file: one line now
        if change.path == "model.batchnorm" and value != data["model"]["batchnorm"]:
            data["model"]["paper_batchnorm"] = data["model"].get("paper_batchnorm") or data["model"]["batchnorm"]
        put_at(data, change.path.split("."), value, f"{change.label} {shortened(f'{change.path}={change.value}')}")
        if change.path in ("data.path", "data.eval_path"):
            data["data"]["available"] = data["data"]["path"] is not None
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(*_labelled(format_validation_errors(exc, source, Recipe), changes, source)) from None


SHOWN_AT_MOST = 80  # characters of a change echoed in a message


def shortened(text: str) -> str:
    """`text` as a message echoes it: at most SHOWN_AT_MOST characters, then `...`."""
    return text if len(text) <= SHOWN_AT_MOST else text[:SHOWN_AT_MOST] + "..."


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


def _check_data_format(data: dict[str, Any], change: Change, source: str) -> None:
    """A data path is for data in a `data.format`; built-in and factory data have none."""
    spec = data["data"]
    if spec.get("format") is None:
        kind = f"built-in data {spec.get('builtin')!r}" if spec.get("builtin") else (
            f"factory data {spec.get('factory')!r}" if spec.get("factory") else "no data format")
        raise UserError(f"{change.label}: {source} reads {kind}; {change.label} gives the path of data.format data "
                        f"({', '.join(DATA_FORMATS)})")


def _labelled(lines: list[str], changes: Sequence[Change], source: str) -> list[str]:
    """Each `source: path: message` line named by how its field was given: by the change that set `path` (or a
    field holding it), or the changes within it when they were all given alike, or the one change whose field the
    message names; else by the file with the changes that made it wrong (the file alone was valid)."""
    labels = {change.path: change.label for change in changes}
    shown = ", ".join(dict.fromkeys(change.label for change in changes))
    result = []
    for line in lines:
        rest = line[len(source) + 2:]
        path = rest.split(":", 1)[0]
        parts = path.split(".")
        owner = next((labels[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                      if ".".join(parts[:n]) in labels), None)
        within = {label for given, label in labels.items() if given.startswith(path + ".")}
        named = {label for given, label in labels.items() if given in rest.split(":", 1)[-1]}
        if owner is None and len(within) == 1:
            owner = within.pop()
        elif owner is None and len(named) == 1:  # a rule between fields, which names the one a change set
            owner = named.pop()
        result.append(f"{owner}: {rest}" if owner else f"{source} with {shown}: {rest}")
    return result


def resumed(recipe: Recipe, changes: Sequence[Change], saved: Recipe, out: Path, source: str) -> Recipe:
    """The recipe of a resumed run: `saved` (its plan.yaml's), after refusing a change to a field it fixes and any
    other difference between `recipe` (the file with the changes) and the run's."""
    now, then = recipe.model_dump(mode="json"), saved.model_dump(mode="json")
    for change in changes:
        if change.path in FIXED_ON_RESUME and value_at(now, change.path) != value_at(then, change.path):
            raise UserError(f"{change.label}: the run in {out} was started with {change.path} "
                            f"{value_at(then, change.path)}; resume it as it was started (its plan.yaml keeps "
                            f"{change.path}; got {value_at(now, change.path)})")
    for path in FIXED_ON_RESUME:  # what the plan may have taken by itself (memory knobs), and the data it read
        if value_at(now, path) != value_at(then, path):  # (a field the data's format lacks is in neither)
            put_at(now, path.split("."), value_at(then, path), path)
    if now != then:
        raise UserError(f"`resume`: the recipe in {source} differs from the one {out}/plan.yaml was run with")
    return saved
