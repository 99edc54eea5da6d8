"""reproduce: run a paper's large-batch training recipe on the hardware you have, exactly.

The public API is what `__all__` lists (docs/library.md); everything else is private. The names are imported when
first used, so `import reproduce` imports neither torch nor the CLI. (`reproduce.plan` and `reproduce.probe` are the
packages of the CLI's planner and probe: the library's functions are `plan_recipe`, `plan_batch`, `probe_step`.)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "Accumulator": "reproduce.accumulate",
    "Window": "reproduce.accumulate",
    "OptimizerStepOutOfMemory": "reproduce.accumulate",
    "split_items": "reproduce.accumulate",
    "UserError": "reproduce.errors",
    "plan_recipe": "reproduce.library.planning",
    "plan_batch": "reproduce.library.planning",
    "lr_at": "reproduce.library.planning",
    "probe_step": "reproduce.library.probing",
    "PROBE_WINDOW": "reproduce.library.probing",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'reproduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
