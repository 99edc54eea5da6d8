"""Options and helpers shared by several commands."""

from __future__ import annotations

import sys

from rich.console import Console

stdout = Console(highlight=False, soft_wrap=False)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def is_terminal() -> bool:
    return sys.stdout.isatty()
