"""Options and helpers shared by several commands."""

from __future__ import annotations

import sys

from rich.console import Console

# Off a terminal (CI logs) rich would wrap at 80 columns; give tables room instead.
_WIDTH = None if sys.stdout.isatty() else 120
stdout = Console(highlight=False, width=_WIDTH)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def is_terminal() -> bool:
    return sys.stdout.isatty()


def show_note(line: str) -> None:
    """A line the core hands back about how it reached its answer (the probe's result, a timing), on stderr."""
    stderr.print(line, markup=False)
