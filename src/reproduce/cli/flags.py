"""A user error's names as the user typed them: the core names a request's field (`micro_batch_max`) or a recipe's
dotted path (`batch.sharding`) in backticks, never a flag; here each becomes its flag. A field prints as its option's
flag (from what typer registered, so it cannot drift); a recipe path as its flag when the user typed that flag,
else as the path they wrote. Other names are left as they are.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache

import typer.main

from .app import app
from .options import FLAG_OF_FIELD

typed_args: list[str] = []  # the command's arguments as typed (set by `main`), for a "start again with" line
NAME = re.compile(r"`([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)`")


@cache
def request_flags() -> dict[str, str]:
    """Each option's parameter name and its flag, over every command (`micro_batch_max` -> `--micro-batch-max`)."""
    root = typer.main.get_command(app)  # the commands are its own, one level deep
    flags: dict[str, str] = {}
    for command in [root, *getattr(root, "commands", {}).values()]:
        for param in command.params:
            if param.param_type_name == "option":
                flags.setdefault(param.name, param.opts[0])
    return flags


def typed(flag: str, argv: Sequence[str]) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def shown(name: str, argv: Sequence[str]) -> str | None:
    """What the CLI prints for the field `name`: its flag, the path itself, or None for a name that is no field."""
    if name in FLAG_OF_FIELD:  # a recipe field an option aliases: the option when the user typed it
        return FLAG_OF_FIELD[name] if typed(FLAG_OF_FIELD[name], argv) else name
    if "." in name:  # a recipe's path no option sets
        return name
    return request_flags().get(name)


def as_typed(line: str, argv: Sequence[str]) -> str:
    """`line` with each field it names in backticks as the user can give it (see the module's docstring)."""
    return NAME.sub(lambda match: shown(match.group(1), argv) or match.group(0), line)
