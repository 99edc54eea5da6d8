"""Calling a recipe's builder: a built-in by name, or the user's own `factory: "package.module:function"`.

No torch here. A recipe's `factory:` runs the user's own Python code, like importing it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UserError
from .recipe import Builder


def import_factory(spec: str, field: str) -> Callable[..., Any]:
    """`package.module:function`, imported with the working directory on the path."""
    module_name, _, attr = spec.partition(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of the user's module is their input's problem
        raise UserError(f"{field}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise UserError(f"{field}: {module_name!r} has no function {attr!r}")
    return function


def call_builder(builder: Builder, field: str, registry: dict, extra: dict | None = None) -> Any:
    kwargs = {**(extra or {}), **builder.kwargs}
    if builder.factory is not None:
        function, name = import_factory(builder.factory, f"{field}.factory"), builder.factory
    elif builder.builtin in registry:
        function, name = registry[builder.builtin], builder.builtin
    else:
        raise UserError(
            f"{field}.builtin: no built-in {builder.builtin!r} to run here (built-ins: {', '.join(registry)}); "
            "this recipe can be planned but not run"
        )
    try:
        return function(**kwargs)
    except TypeError as exc:
        raise UserError(f"{field}.kwargs: {name} rejected its arguments: {exc}") from None
