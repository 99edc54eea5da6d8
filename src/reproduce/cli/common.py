"""Options and helpers shared by several commands."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console

from ..shipped import described, resolve_recipe
from ..train.reporter import loss_text  # noqa: F401  (the run's lines and the commands': one format)

# Off a terminal (CI logs) rich would wrap at 80 columns; give tables room instead.
_WIDTH = None if sys.stdout.isatty() else 120
stdout = Console(highlight=False, width=_WIDTH)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def print_lines(lines: Iterable[str]) -> None:
    """Each line on stdout as it is: no rich markup, not wrapped."""
    for line in lines:
        stdout.print(line, markup=False, soft_wrap=True)


def parameters_line(counts: tuple[int, int]) -> str:
    """`parameters: 6,742,609,920, of which 4,194,304 train (0.06%)`: what `plan` and `run` print."""
    total, trainable = counts
    return f"parameters: {total:,}, of which {trainable:,} train ({trainable / max(total, 1):.2%})"


def show_note(line: str) -> None:
    """A line the core hands back about how it reached its answer (the probe's result, a timing), on stderr; the
    fields it names in backticks as the user gives them (cli/options.py, as for an error: `micro_batch_max` prints as
    `--micro-batch-max`)."""
    from .options import as_typed, typed_args

    stderr.print(as_typed(line, typed_args), markup=False)


def recipe_argument(given: Path, what: str = "recipe", say: bool = True) -> Path:
    """The file a RECIPE argument names (a file, else a recipe's name); with `say`, a name is said on stderr."""
    path = resolve_recipe(given, what)
    if say and path != given:
        stderr.print(f"recipe {given}: {described(path, given)}", markup=False)
    return path


def token_budget_text(result) -> str | None:
    """How the probe found `sorted`'s token budget, or None when it searched none (`probe` and `plan` print it)."""
    if result is None or result.token_budget is None:
        return None
    rows, longest = result.micro_batch_max, result.longest
    failed = [t.micro_batch for t in result.token_trials if not t.fits]
    above = min(failed) if failed else (rows + 1) * longest
    return (f"{result.token_budget:,} tokens per micro-batch (sorted), measured: {rows} rows of the longest example "
            f"({longest} tokens) fit, then {len(result.token_trials)} trials above {rows * longest:,} tokens in steps "
            f"of {result.token_step}; {above:,} does not fit")
