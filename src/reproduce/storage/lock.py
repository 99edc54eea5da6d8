"""One run per folder: an OS lock on `--out`, held by the process that owns the run for the whole run or resume.

The lock is a POSIX lock (`lockf`) on `--out/.reproduce.lock`; the OS releases it when its holder exits, killed or
not, so a dead run never blocks the next (a lock file a killed run leaves is never taken for an output). The owner
is the in-process run, or the `reproduce run --nproc-per-node` launcher of a one-machine job for its whole life (its
torchrun workers do not take it). A job of several nodes shares `--out` (a filesystem every node sees): no launcher
takes it, the job's rank 0 worker does, wherever it runs, so the nodes of one job share the folder and a second job
is refused. It is taken once: by the CLI before it sets up (`train` takes it for a library caller).

A lock file can be deleted under a live run, and a new file of that name locked by another: the folder itself is
locked too (`flock` on a descriptor of the folder, which no deletion of a path undoes), so a second run is refused
while the first lives. The processes this one forks (DataLoader workers) close their copy of that descriptor at
once (`os.register_at_fork`), so a run killed with SIGKILL frees the folder at once, as the POSIX lock does. On a
filesystem without flock on folders (NFS) the lock file's lock is the lock, as before.

Whoever takes the lock first in a process removes the temporaries a dead writer left in the folder
(`files.remove_dead_temporaries`): holding the lock, no other run is writing there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError
from .files import WriteFailed, remove_dead_temporaries

LOCK_NAME = ".reproduce.lock"  # in --out; not an output, and never a reason to call the folder "not empty"
_held: set[Path] = set()  # the folders this process holds
_folders: dict[Path, int] = {}  # folder -> the descriptor of the folder itself, holding its flock


def _close_folders_in_child() -> None:
    """A forked child (a DataLoader worker) drops its copy of the folders' descriptors: the flock belongs to the
    descriptor, and the folder is free once the run itself is gone, whatever its workers do."""
    for descriptor in _folders.values():
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _folders.clear()
    _held.clear()


os.register_at_fork(after_in_child=_close_folders_in_child)


@contextlib.contextmanager
def hold(out: str | Path) -> Iterator[None]:
    """Hold the lock on `out` (created when missing, removed again when it is left empty) or raise UserError
    naming the folder when another process holds it."""
    out = Path(out).absolute()
    if out in _held:  # (a POSIX lock taken twice in one process is released by the first release)
        raise RuntimeError(f"{out}: this process holds its lock already")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        descriptor = _locked(out / LOCK_NAME)
    except OSError as error:
        raise UserError(str(WriteFailed(out, error)), field="out") from None
    folder = _folder_locked(out) if descriptor is not None else None
    if descriptor is None or folder is None:
        if descriptor is not None:
            os.close(descriptor)
        raise UserError(f"another run is using {out} (it holds {LOCK_NAME}'s lock); wait for it to end, "
                        "or choose another folder", field="out")
    _held.add(out)
    if folder >= 0:
        _folders[out] = folder
    try:
        try:  # one byte written and removed: a read-only, unwritable or full folder is said now, in one line, not
            # after the model and data are set up
            with tempfile.TemporaryFile(dir=out) as handle:
                handle.write(b"\0")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as error:
            raise UserError(str(WriteFailed(out, error)), field="out") from None
        remove_dead_temporaries(out)
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


def _locked(path: Path) -> int | None:
    """An open descriptor of `path` holding its POSIX lock, or None when another process holds it. A POSIX lock
    belongs to the process: the DataLoader workers it forks do not hold it, so a run killed with SIGKILL frees the
    folder at once, while its workers are still winding down (a flock would be theirs too)."""
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
            return descriptor
        os.close(descriptor)


def _folder_locked(out: Path) -> int | None:
    """A descriptor of the folder `out` holding its flock; None when another process holds it; -1 where the
    filesystem locks no folders (the lock file's lock is then the lock)."""
    try:
        descriptor = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return -1
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        return None if error.errno in (errno.EAGAIN, errno.EACCES) else -1
    return descriptor


def held(out: str | Path) -> bool:
    """Whether this process holds the lock on `out`."""
    return Path(out).absolute() in _held


LAUNCHER_ENV = "REPRODUCE_LAUNCHED_WITH"  # set by `reproduce run --nproc-per-node` for its torchrun (cli/resume.py)
HELD_ENV = "REPRODUCE_LAUNCHER_HOLDS_THE_LOCK"  # set by a one-machine launcher that holds --out's lock


@contextlib.contextmanager
def hold_for_launch(out: str | Path, nodes: int) -> Iterator[None]:
    """The `reproduce run --nproc-per-node` launcher's part: on one machine it holds the lock for its whole life
    and tells its workers so (`owns_the_run`); the launchers of several nodes hold none (the job's rank 0 does)."""
    if nodes > 1:
        yield
        return
    os.environ[HELD_ENV] = "1"
    with hold(out):
        yield


def owns_the_run(distributed: bool, rank: int) -> bool:
    """Whether this process takes the lock: a run of one process; under torchrun, none of the workers when a
    one-machine `reproduce run --nproc-per-node` launched them (the launcher holds it), else (several nodes, or
    torchrun started by hand, as under SLURM) the job's rank 0."""
    return not distributed or (rank == 0 and HELD_ENV not in os.environ)
