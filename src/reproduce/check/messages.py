"""One line per validation error of a check file: `file: checks[1].min: must be ... (got ...)`."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from ..plan.validation import error_message, is_union_tag, unknown_key
from .schema import KINDS, AnyCheck, CheckFile, CompareCheck, MetricCheck, PlanCheck, VerifyCheck


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
        line = f"{source}: {_walk(root, loc)[0]}: {message}"
        if line not in lines:
            lines.append(line)
    return lines


CHECKS = {
    cls.model_fields["kind"].annotation.__args__[0]: cls for cls in (PlanCheck, VerifyCheck, MetricCheck, CompareCheck)
}


def _walk(root: type[BaseModel], loc: list) -> tuple[str, Any]:
    """`loc` as a dotted path (checks[1].min) and the annotation it leads to; the kind tag pydantic adds inside the
    union of checks picks its member and is left out of the path."""
    text, node = "", root
    for part in loc:
        if node == AnyCheck and part in CHECKS:
            node = CHECKS[part]
            continue
        node = _step(node, part)
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)", node


def _fields_at(root: type[BaseModel], loc: list) -> list[str]:
    node = _walk(root, loc)[1]
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
    for arg in args:  # Optional / Union / Annotated: the first member that knows the part
        found = _step(arg, part)
        if found is not None:
            return found
    return None
