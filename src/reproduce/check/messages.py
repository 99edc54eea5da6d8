"""One line per validation error of a check file: `file: checks[1].min: must be ... (got ...)`."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from ..plan.validation import error_message, is_union_tag, unknown_key
from .schema import KINDS, CheckFile, _Check


def format_errors(exc: ValidationError, source: str, root: type[BaseModel] = CheckFile) -> list[str]:
    """recipe.format_validation_errors' style for check files: `file: checks[1].min: must be ... (got ...)`."""
    lines = []
    for error in exc.errors(include_url=False):
        kind = error["type"]
        parts = list(error["loc"])
        key = [parts.pop()] if kind == "extra_forbidden" and parts else []  # the file's own key, whatever it reads
        loc = [part for part in parts if not (isinstance(part, str) and is_union_tag(part))] + key
        if kind == "union_tag_not_found":
            loc, message = [*loc, "kind"], f"required: one of {', '.join(KINDS)}"
        elif kind == "union_tag_invalid":
            tag = error.get("ctx", {}).get("tag")
            close = difflib.get_close_matches(str(tag), KINDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            loc, message = [*loc, "kind"], f"expected one of {', '.join(KINDS)} (got {tag!r}{hint})"
        elif kind == "extra_forbidden":
            message = unknown_key(str(loc[-1]), _fields_at(root, loc[:-1]))
        else:
            message = error_message(error, root)
            head = message.split(":", 1)[0]
            if ":" in message and " " not in head and head in _fields_at(root, loc):
                loc, message = [*loc, head], message.split(":", 1)[1].strip()
        line = f"{source}: {_path(root, loc)}: {message}"
        if line not in lines:
            lines.append(line)
    return lines


def _path(root: type[BaseModel], loc: list) -> str:
    """checks[1].min, with the discriminator tag pydantic adds to the location left out."""
    text, node = "", root
    for part in loc:
        if isinstance(part, str) and part in KINDS and _union_member(node, part) is not None:
            node = _union_member(node, part)
            continue
        node = _step(node, part)
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _fields_at(root: type[BaseModel], loc: list) -> list[str]:
    node: Any = root
    for part in loc:
        member = _union_member(node, part) if isinstance(part, str) else None
        node = member if member is not None else _step(node, part)
        if node is None:
            return []
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _step(node: Any, part: Any) -> Any:
    """The annotation found one step into `node` (a model, list, dict, or union of them)."""
    if node is None:
        return None
    origin, args = getattr(node, "__origin__", None), getattr(node, "__args__", ())
    if isinstance(node, type) and issubclass(node, BaseModel):
        field_info = node.model_fields.get(str(part))
        return field_info.annotation if field_info else None
    if origin is list and isinstance(part, int):
        return args[0] if args else None
    if origin is dict and isinstance(part, str):
        return args[1] if len(args) > 1 else None
    if args:  # Optional / Union / Annotated: the first member that knows the part
        for arg in args:
            found = _step(arg, part)
            if found is not None:
                return found
    metadata = getattr(node, "__metadata__", None)
    if metadata is not None:
        return _step(getattr(node, "__origin__", None), part)
    return None


def _union_member(node: Any, tag: str) -> Any:
    """The member of a discriminated union of checks whose `kind` is `tag` (None when `node` is no union)."""
    if isinstance(node, type) or node is None:
        return None
    for arg in _flatten(node):
        if isinstance(arg, type) and issubclass(arg, _Check):
            literal = arg.model_fields["kind"].annotation
            if tag in getattr(literal, "__args__", ()):
                return arg
    return None


def _flatten(node: Any) -> list:
    args = getattr(node, "__args__", ())
    if not args:
        origin = getattr(node, "__origin__", None)
        return _flatten(origin) if origin is not None else [node]
    return [leaf for arg in args for leaf in _flatten(arg)]
