"""Reading YAML files strictly and turning pydantic's validation errors into one line per problem, no torch:
`papers/x.yaml: batch.effective: must be > 0 (got -3)`."""

from __future__ import annotations

import difflib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from ..errors import UserError


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # `? [a, b]`: a list or mapping as a key
                raise yaml.constructor.ConstructorError(
                    None, None, f"a {type(key).__name__} as a key; keys are names", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, what: str = "recipe") -> dict[str, Any]:
    """A mapping from a YAML file, read with `yaml.safe_load` only; errors name the line and column."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such {what} file" if not path.exists() else f"{path}: is not a file")
    try:
        size = path.stat().st_size
        if size > MOST_BYTES:
            raise UserError(f"{path}: {size:,} bytes, more than {MOST_BYTES:,}; a {what} is a few kilobytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None
    try:
        check_shape(text, path)
        data = yaml.load(text, Loader=UniqueKeyLoader)  # SafeLoader: plain data only, never Python objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise UserError(f"{path}: YAML syntax error at {where}{exc.problem or exc}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (a NUL byte, say): where it is
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise UserError(f"{path}: YAML syntax error at line {line}, column {column}: the character "
                        f"U+{exc.character:04X} is not allowed here")  from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: YAML syntax error: {' '.join(str(exc).split())}") from None
    if data is None:
        raise UserError(f"{path}: the file is empty; expected a {what}")
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of {what} fields at the top level (got {type(data).__name__})")
    return data


MOST_BYTES = 1 << 20  # the largest shipped recipe or plan file is under 10 kB
MOST_DEPTH = 64  # a recipe nests a few levels; PyYAML's composer recurses once per level
MOST_VALUES = 100_000  # a recipe holds a few hundred values; aliases (*name) could expand to billions


def check_shape(text: str, path: Path) -> None:
    """Refuse, in bounded time and memory, YAML nested deeper than MOST_DEPTH (the event parser does not recurse)
    or whose aliases expand to more than MOST_VALUES values (counted once per node, not expanded)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MOST_DEPTH:
                where = f"line {event.start_mark.line + 1}: " if event.start_mark is not None else ""
                raise UserError(f"{path}: {where}nested more than {MOST_DEPTH} levels deep; a recipe nests a few")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) not in sizes:
            children = [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else (
                node.value if isinstance(node, yaml.SequenceNode) else [])
            sizes[id(node)] = 1 + sum(size(child) for child in children)
        return sizes[id(node)]

    for document in yaml.compose_all(text, Loader=yaml.SafeLoader):
        if document is not None and size(document) > MOST_VALUES:
            raise UserError(f"{path}: its aliases (*name) expand to {size(document):.3g} values, more than "
                            f"{MOST_VALUES:,}; a recipe holds a few hundred")


def echo(value: Any, most: int = 80) -> str:
    """A value as a message shows it: its repr, cut to `most` characters."""
    text = repr(value)
    return text if len(text) <= most else f"{text[: most - 5]}...{text[-2:]}"


def unknown_key(key: str, known: list[str]) -> str:
    """"unknown key" with the closest known field name, or the list of known ones."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})" if known else ""
    return f"unknown key{hint}"


MOST_LINES = 20  # problems shown of one file; a file with more is not one mistake to fix line by line
MOST_UNKNOWN = 3  # unknown keys of one mapping shown one a line (each with its closest field); more share a line


def format_validation_errors(exc: ValidationError, source: str, root: type[BaseModel]) -> list[str]:
    """One line per problem: `source: dotted.path: message (got value)`. Many unknown keys of one mapping share a
    line, and no more than MOST_LINES lines are shown."""
    errors = exc.errors(include_url=False)
    unknown: dict[tuple[str, ...], list[str]] = {}
    for error in errors:
        if error["type"] == "extra_forbidden":
            loc = error_loc(error)
            unknown.setdefault(tuple(loc[:-1]), []).append(loc[-1])
    lines = []
    for error in errors:
        loc = error_loc(error)
        if error["type"] == "extra_forbidden" and len(unknown[tuple(loc[:-1])]) > MOST_UNKNOWN:
            keys = unknown[tuple(loc[:-1])]
            known = field_names_at(root, loc[:-1])
            message = (f"{len(keys):,} unknown keys ({', '.join(echo(key, 40) for key in keys[:MOST_UNKNOWN])}, ...)"
                       + (f"; known: {', '.join(known)}" if known else ""))
            loc = loc[:-1]
        else:
            message = error_message(error, root)
        head = message.split(":", 1)[0]
        if ":" in message and head.split(".")[0] in field_names_at(root, loc) and " " not in head:
            # a cross-field check already names its (dotted) field: attach it to the path
            loc = [*loc, *head.split(".")]
            message = message.split(":", 1)[1].strip()
        path = ".".join(part if len(part) <= 60 else f"{part[:57]}..." for part in loc) or "(top level)"
        line = f"{source}: {path}: {message}"
        if line not in lines:
            lines.append(line)
    if len(lines) > MOST_LINES:
        lines = [*lines[: MOST_LINES - 1], f"{source}: and {len(lines) - MOST_LINES + 1:,} more problems"]
    return lines


def error_loc(error: ErrorDetails) -> list[str]:
    """An error's location as the file's keys, without the member names pydantic adds inside unions and literals;
    an unknown key is the file's own, whatever it reads (`foo[0]`, `list`), so it stays."""
    parts = list(error["loc"])
    last = [str(parts.pop())] if error["type"] == "extra_forbidden" and parts else []
    return [str(part) for part in parts if not is_union_tag(part)] + last


def is_union_tag(part: Any) -> bool:
    """Whether a location part is the member-type name pydantic adds inside unions and literals."""
    return isinstance(part, str) and ("[" in part or part in ("list", "tuple", "dict", "int", "float", "str"))


def error_message(error: ErrorDetails, root: type[BaseModel]) -> str:
    """The message of one pydantic error, in the words a recipe's author reads (without the path)."""
    kind, ctx, got = error["type"], error.get("ctx", {}), error.get("input")
    loc = error_loc(error)
    if kind == "extra_forbidden":
        return unknown_key(loc[-1], field_names_at(root, loc[:-1]))
    if kind == "missing":
        return "required field is missing"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound} (got {echo(got)})"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected', '')} (got {echo(got)})"
    if kind == "string_pattern_mismatch":
        return f"expected 'package.module:function' (got {echo(got)})"
    if kind == "too_short":
        least = ctx.get("min_length", 1)
        return f"expected at least {least} item{'s' if least != 1 else ''} (got {echo(got)})"
    if kind == "int_from_float":
        return f"expected an integer (got {echo(got)})"
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "model_type":
        expected = {
            "int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
            "list": "a list", "dict": "a mapping", "model": "a mapping", "tuple": "a list of two numbers",
            "model_attributes": "a mapping",
        }.get(kind.rsplit("_", 1)[0], kind.replace("_", " "))
        return f"expected {expected} (got {echo(got)})"
    return f"{error['msg']} (got {echo(got)})"


def field_names_at(root: type[BaseModel], loc: list[str]) -> list[str]:
    """The field names of the model found by following `loc` from `root` (empty when it leads elsewhere); of all
    the members of a union of models (the data formats), in their order."""
    models: list[type[BaseModel]] = [root]
    for part in loc:
        if part.isdigit():  # an item of a list: the list's model, already found
            continue
        models = [found for model in models if part in model.model_fields
                  for found in models_in(model.model_fields[part].annotation)]
        if not models:
            return []
    return list(dict.fromkeys(name for model in models for name in model.model_fields))


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's type holds: itself, the item of a list, the members of a union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [found for arg in getattr(annotation, "__args__", ()) for found in models_in(arg)]
