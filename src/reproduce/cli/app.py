"""The typer application every command registers itself on, and its `--help` at 80 columns with every option name
whole: where the columns do not fit, rich would cut an option name with an ellipsis; here the name columns never
wrap, and the type and help columns fold a long word instead of cutting it.
"""

from __future__ import annotations

import typer
from rich.columns import Columns
from rich.table import Table
from rich.text import Text
from typer import core


def _is_name(cell) -> bool:
    """An option's names (`--world-size`, `-h`), its negative form, or the required mark: short, never wrapped."""
    text = cell.plain if isinstance(cell, Text) else cell if isinstance(cell, str) else None
    return text is not None and (text in ("", "*") or text.startswith("-"))


class OptionsTable(Table):
    """rich's Table, with typer's option-name columns kept whole and the other columns folding long words."""

    def add_row(self, *renderables, **kwargs) -> None:
        super().add_row(*renderables, **kwargs)
        for column, cell in zip(self.columns, renderables, strict=False):
            if not _is_name(cell):
                column.no_wrap = False
                column.overflow = "fold"
                for part in cell.renderables if isinstance(cell, Columns) else [cell]:  # typer's help: Columns
                    if isinstance(part, Text):
                        part.overflow = "fold"
            elif not column._cells or all(_is_name(c) for c in column._cells):
                column.no_wrap = True


def _with_options_table(format_help):
    """typer's help panels built from OptionsTable, only when help is printed: importing typer's rich_utils costs a
    tenth of a second a command that prints no help should not pay."""

    def wrapped(self, ctx, formatter) -> None:
        from typer import rich_utils

        rich_utils.Table = OptionsTable
        return format_help(self, ctx, formatter)

    return wrapped


for _command in (core.TyperCommand, core.TyperGroup):  # --help keeps option names whole at 80 columns
    _command.format_help = _with_options_table(_command.format_help)

app = typer.Typer(
    name="reproduce",
    help=(
        "Reproduce a paper's large-batch training recipe on the hardware you have: plan the micro-batch and "
        "accumulation steps that keep the paper's effective batch exact, run it, and check it in CI."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"reproduce {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True, help="Print the version."),
) -> None:
    """Reproduce a paper's large-batch recipe: `plan`, `run`, and check it in CI."""
