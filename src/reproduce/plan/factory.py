"""Calling a recipe's builder: a built-in by name, or the user's own `factory: "package.module:function"`.

No torch here. The module is looked for in the folders of the files that named it (`remember_folder`), then the
working directory, then PYTHONPATH, so `reproduce check checks/` works from any directory."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UserError

_FOLDERS: list[str] = []  # folders of the recipe / plan / check files read, searched before the working directory


def remember_folder(file: str | Path) -> None:
    """Search the folder of `file` (a recipe, plan or check file just read) for the factories it names."""
    folder = str(Path(file).expanduser().absolute().parent)
    if folder not in _FOLDERS:
        _FOLDERS.append(folder)


def import_factory(spec: str, field: str) -> Callable[..., Any]:
    """`package.module:function`, imported from the folders of the files that named it, the working directory, or
    PYTHONPATH (in that order)."""
    module_name, _, attr = spec.partition(":")
    cwd = str(Path.cwd())
    folders = [*_FOLDERS, *([cwd] if cwd not in _FOLDERS else [])]
    for folder in reversed(folders):
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):  # the factory's own module, not one it imports
            raise UserError(f"{field}: cannot import {module_name!r}: no module {exc.name!r} in {', '.join(folders)} "
                            "(the recipe's or check file's folder, then the working directory) or on PYTHONPATH"
                            ) from None
        raise UserError(f"{field}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # any import-time failure of the user's module is their input's problem
        raise UserError(f"{field}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise UserError(f"{field}: {module_name!r} has no function {attr!r}")
    return function  # type: ignore[no-any-return]  # callable() above: a function of the user's module


def call_builder(builder: Any, field: str, registry: dict[str, Any], extra: dict[str, Any] | None = None,
                 own_errors: bool = False) -> Any:
    """Build `builder` (a recipe's `model` or `data`: recipe.Builder): its `factory`, or its `builtin` from `registry`,
    called with its `kwargs` over `extra`. Its own errors are the recipe's (one line naming `field.kwargs`), unless
    `own_errors`: a count made on the meta device, whose caller knows what such a build cannot do."""
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
    except UserError:
        raise
    except Exception as exc:
        if own_errors and not isinstance(exc, TypeError):  # (a TypeError: the kwargs do not fit the function)
            raise
        raise rejected(f"{field}.kwargs", name, exc) from None


def rejected(field: str, name: str, exc: Exception) -> UserError:
    """A builder's own error for the arguments a recipe gave it (`hidden: -5`: a negative tensor size; `hidden:
    10000000000000`: no memory for it; a config's validation), as one line: the recipe's input is the cause."""
    text = " ".join(str(exc).split()) or type(exc).__name__  # one line, however many the error has
    return UserError(f"{field}: {name} rejected its arguments: {text if len(text) <= 240 else text[:237] + '...'}")
