"""One run per folder: an OS lock on `--out`, held by the process that owns the run for the whole run or resume.

A POSIX lock (`lockf`) on `--out/.reproduce.lock`, released by the OS when its holder dies. Its owner is the
in-process run, or the one-machine `--nproc-per-node` launcher for its whole life; a job of several nodes has its
rank 0 take it. The folder itself is `flock`ed too (a deleted lock file cannot undo that), its descriptor closed in
forked children (DataLoader workers), so a SIGKILLed run frees the folder at once; where folders cannot be flocked
(NFS), the lock file's lock is the lock. Holding it, the process removes the temporaries a dead writer left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError
from .files import TEMPORARY, WriteFailed

LOCK_NAME = ".reproduce.lock"  # in --out; not an output, and never a reason to call the folder "not empty"
_held: set[Path] = set()  # the folders this process holds
_folders: dict[Path, int] = {}  # folder -> the descriptor of the folder itself, holding its flock


def _close_folders_in_child() -> None:
    """A forked child (a DataLoader worker) drops its copy of the folders' descriptors, which hold the flock."""
    for descriptor in _folders.values():
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _folders.clear()
    _held.clear()


os.register_at_fork(after_in_child=_close_folders_in_child)


@contextlib.contextmanager
def hold(out: str | Path) -> Iterator[None]:
    """Hold the lock on `out` (created when missing, removed again when left empty), or UserError: another holds it."""
    out = Path(out).absolute()
    if out in _held:  # (a POSIX lock taken twice in one process is released by the first release)
        raise RuntimeError(f"{out}: this process holds its lock already")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        locked = _locked(out)
    except OSError as error:
        raise UserError(str(WriteFailed(out, error)), field="out") from None
    if locked is None:
        raise UserError(f"another run is using {out} (it holds {LOCK_NAME}'s lock); wait for it to end, "
                        "or choose another folder", field="out")
    descriptor, folder = locked
    _held.add(out)
    if folder >= 0:
        _folders[out] = folder
    try:
        try:  # one byte written and removed: an unwritable or full folder is said now, before any set-up
            with tempfile.TemporaryFile(dir=out) as handle:
                handle.write(b"\0")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as error:
            raise UserError(str(WriteFailed(out, error)), field="out") from None
        for place in (out, out / "checkpoints"):  # the temporaries a dead writer left: no other run writes here
            try:
                found = [entry for entry in sorted(place.iterdir()) if TEMPORARY.match(entry.name)]
            except OSError:
                continue
            for entry in found:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()
        yield
    finally:
        _held.discard(out)
        _folders.pop(out, None)
        with contextlib.suppress(OSError):
            (out / LOCK_NAME).unlink()  # before the lock goes: a process that opened it retries (`_locked`)
            if created:
                out.rmdir()  # only when empty: nothing was written
        os.close(descriptor)  # (releases the lock)
        if folder >= 0:
            os.close(folder)


def _locked(out: Path) -> tuple[int, int] | None:
    """Descriptors of the lock file, holding its POSIX lock (the process's, not its forked workers'), and of the
    folder, holding its flock (-1 where the filesystem locks no folders); None when another process holds either."""
    path = out / LOCK_NAME
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(descriptor)
            if error.errno in (errno.EACCES, errno.EAGAIN):
                return None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same = False
        if same:  # (not a file its holder removed while this process opened it)
            break
        os.close(descriptor)
    try:
        folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return descriptor, -1
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(folder)
        if error.errno in (errno.EAGAIN, errno.EACCES):
            os.close(descriptor)
            return None
        return descriptor, -1
    return descriptor, folder


LAUNCHER_ENV = "REPRODUCE_LAUNCHED_WITH"  # set by `reproduce run --nproc-per-node` for its torchrun (cli/run.py)
HELD_ENV = "REPRODUCE_LAUNCHER_HOLDS_THE_LOCK"  # set by a one-machine launcher that holds --out's lock


@contextlib.contextmanager
def hold_for_launch(out: str | Path, nodes: int) -> Iterator[None]:
    """The `--nproc-per-node` launcher's part: on one machine it holds the lock and tells its workers so; the
    launchers of several nodes hold none (the job's rank 0 does)."""
    if nodes > 1:
        yield
        return
    os.environ[HELD_ENV] = "1"
    with hold(out):
        yield


def owns_the_run(distributed: bool, rank: int) -> bool:
    """Whether this process takes the lock: a run of one process, else the job's rank 0 unless a one-machine launcher
    holds it."""
    return not distributed or (rank == 0 and HELD_ENV not in os.environ)
