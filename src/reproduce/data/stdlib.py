"""The standard library's own source files: the offline text the built-in `pysource` data and the test samples read."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_sources(max_bytes: int) -> list[Path]:
    """The standard library's top-level Python files, sorted, up to about `max_bytes` in total."""
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    return files
