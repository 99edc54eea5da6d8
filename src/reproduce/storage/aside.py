"""`--force` takes a folder over from a previous run, all or nothing.

The previous run's outputs are linked (hard links; copies where there are none) into a hidden temporary with a list
of their names, which one rename makes `.previous-run.XXXXXXXX`: the commit. Only then are they removed from the
folder. The aside folder goes once the new run has a checkpoint of its own (`Previous.started`); any failure or
signal before that puts it back in place of what the new run wrote, with signals deferred so none splits a move. A
SIGKILL in between leaves the aside folder, which the next run holding the lock settles (`settle`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from . import signals

ASIDE_PREFIX = ".previous-run."
NAMES = ".names.json"  # in the aside folder: the outputs set aside, relative to the run's folder


def _link_tree(source: Path, target: Path) -> None:
    """`target` made the same tree as `source`: files hard-linked (copied where links are not possible)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink() or not source.is_dir():
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
            return
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
        return
    target.mkdir()
    for entry in source.iterdir():
        _link_tree(entry, target / entry.name)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Previous:
    """The previous run's outputs set aside in `folder` (None: nothing was there, or they are gone or back)."""

    def __init__(self, out: Path, names: list[str]):
        self.folder: Path | None = None
        self.present = [name for name in names if (out / name).exists() or (out / name).is_symlink()]

    def started(self) -> None:
        """The new run has a checkpoint of its own: the previous outputs go (renamed to a temporary first, so a kill
        half-way leaves litter, never half a previous run that looks whole)."""
        if self.folder is None:
            return
        with signals.deferred():
            gone = self.folder.with_name(self.folder.name + ".gone.tmp")
            with contextlib.suppress(OSError):
                os.rename(self.folder, gone)
                self.folder = gone
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _put_back(out: Path, folder: Path, names: list[str]) -> None:
    aside = json.loads((folder / NAMES).read_text())
    for name in names:  # what the new run wrote of the outputs the previous run did not have
        if name not in aside:
            _remove(out / name)
    for name in aside:
        if (folder / name).exists() or (folder / name).is_symlink():
            _remove(out / name)
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder / name, out / name)
    shutil.rmtree(folder, ignore_errors=True)


def _same(a: Path, b: Path) -> bool:
    """The same file (a hard link), or its copy (shutil.copy2 keeps the time of the last change)."""
    one, other = a.stat(), b.stat()
    return (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino) or (
        one.st_size == other.st_size and one.st_mtime_ns == other.st_mtime_ns)


def settle(out: Path, names: list[str], checkpoint: str = "checkpoints/last.pt") -> str | None:
    """The aside folders a killed `--force` run left in `out` (the caller holds the lock): dropped when the new run
    has a checkpoint of its own (not the previous run's file still in place), else put back. A note, or None."""
    notes = []
    for folder in sorted(out.glob(f"{ASIDE_PREFIX}*")):
        if folder.name.endswith(".tmp") or not (folder / NAMES).is_file():
            continue
        mine, theirs = out / checkpoint, folder / checkpoint
        own = mine.is_file() and not (theirs.is_file() and _same(mine, theirs))
        if own:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        with signals.deferred():
            _put_back(out, folder, names)
        notes.append(f"{out}: a `force` run was stopped before its first checkpoint; the previous run it set aside "
                     f"in {folder.name} is back in place")
    return "; ".join(notes) or None


@contextlib.contextmanager
def setting_aside(out: Path, names: list[str], enabled: bool,
                  committed: Callable[[], bool] = lambda: True) -> Iterator[Previous | None]:
    """The previous run's `names` set aside while the block runs (when `enabled`): on its exit they go when
    `committed()`, else they are put back; a signal before that also removes what the new run wrote."""
    if not enabled:
        yield None
        return
    previous = Previous(out, names)
    try:
        if previous.present:
            with signals.deferred(raise_on_exit=True):
                building = Path(tempfile.mkdtemp(dir=out, prefix=ASIDE_PREFIX, suffix=".tmp"))
                try:
                    for name in previous.present:
                        _link_tree(out / name, building / name)
                    (building / NAMES).write_text(json.dumps(previous.present))
                    folder = building.with_name(building.name[: -len(".tmp")])
                    os.rename(building, folder)  # the commit: the previous run is whole in `folder`
                except BaseException:
                    shutil.rmtree(building, ignore_errors=True)
                    raise
                previous.folder = folder
                signals.fault_at("aside")
                for name in previous.present:
                    _remove(out / name)
        yield previous
    except BaseException as error:
        if committed():
            previous.started()
        elif previous.folder is not None:  # what the new run wrote goes, the previous outputs return
            with signals.deferred():  # (a signal here is the one being handled, or is said by the caller)
                _put_back(out, previous.folder, names)
        elif isinstance(error, signals.SignalReceived):  # stopped while starting: the folder as it was
            with signals.deferred():
                for name in names:
                    if name not in previous.present:
                        _remove(out / name)
        raise
    previous.started()  # (a run of no steps at all: done is started)
