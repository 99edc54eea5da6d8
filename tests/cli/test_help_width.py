"""`reproduce COMMAND --help` on an 80-column terminal: every option name whole, no word of the help cut off."""

from __future__ import annotations

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from reproduce.cli import app


def _commands() -> dict[str, click.Command]:
    root = typer.main.get_command(app)
    found = {}

    def walk(group: click.Group, prefix: tuple[str, ...]) -> None:
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                walk(command, (*prefix, name))
            found[" ".join((*prefix, name))] = command

    walk(root, ())
    return found


COMMANDS = _commands()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_at_80_columns_keeps_every_option_name_whole(name):
    result = CliRunner().invoke(app, [*name.split(), "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.output  # rich's ellipsis: a cut word
    names = [opt for param in COMMANDS[name].params for opt in param.opts + param.secondary_opts
             if opt.startswith("--")]
    assert names, name
    shown = set(re.findall(r"--[a-z0-9][a-z0-9-]*", result.output))
    missing = [n for n in names if n not in shown]
    assert not missing, f"{name} --help at 80 columns: {missing} not shown whole"


def test_the_longest_names_are_the_ones_that_were_cut():
    longest = max((opt for c in COMMANDS.values() for p in c.params for opt in p.opts), key=len)
    assert len(longest) >= len("--activation-checkpointing")
