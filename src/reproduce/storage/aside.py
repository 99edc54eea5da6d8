"""`--force` takes a folder over from a previous run without losing it to a run that never starts.

The previous run's outputs are moved aside (into a hidden folder in `--out`) when the new run takes the folder, and
deleted only once the new run has started for real: its model, data and plan built and its first optimizer step
taken (`Previous.started`). Any failure before that (a late check, an error in the first step, a signal) puts them
back (`setting_aside`'s exit), whatever raised it, so a check added later needs nothing of its own. A run killed
before its first step leaves them aside, where they can be moved back by hand (see docs/run.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

ASIDE_PREFIX = ".previous-run."


class Previous:
    """The previous run's outputs set aside in `folder` (None: nothing was there)."""

    def __init__(self, out: Path, names: list[str]):
        self.out, self.names, self.folder, self.moved = out, names, None, []
        present = [name for name in names if (out / name).exists()]
        if not present:
            return
        self.folder = Path(tempfile.mkdtemp(dir=out, prefix=ASIDE_PREFIX))
        for name in present:
            (self.folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / name, self.folder / name)
            self.moved.append(name)

    def started(self) -> None:
        """The new run has taken its first step: the previous outputs go."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def put_back(self) -> None:
        """The new run failed before its first step: what it wrote goes, and the previous outputs return."""
        if self.folder is None:
            return
        for name in self.names:  # what the new run wrote of its outputs
            target = self.out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
        for name in self.moved:
            (self.out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.folder / name, self.out / name)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None


@contextlib.contextmanager
def setting_aside(out: Path, names: list[str], enabled: bool) -> Iterator[Previous | None]:
    """The previous run's `names` set aside while the block runs (when `enabled`), put back if it raises before
    `started()` was called."""
    if not enabled:
        yield None
        return
    previous = Previous(out, names)
    try:
        yield previous
    except BaseException:
        previous.put_back()
        raise
    previous.started()  # (a run of no steps at all: done is started)
