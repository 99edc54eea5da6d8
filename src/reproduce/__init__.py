"""reproduce: run a paper's large-batch training recipe on the hardware you have, exactly.

The public API is what `__all__` lists (docs/library.md); everything else is private. The names are imported when
first used, so `import reproduce` imports neither torch nor the CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "Accumulator": "reproduce.accumulate",
    "Window": "reproduce.accumulate",
    "OptimizerStepOutOfMemory": "reproduce.accumulate",
    "split_items": "reproduce.accumulate",
    "UserError": "reproduce.errors",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:
    from .accumulate import Accumulator, OptimizerStepOutOfMemory, Window, split_items
    from .errors import UserError


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'reproduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
