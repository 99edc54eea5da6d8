"""Files written whole or not at all, and a write error said in one line.

Every output of a run is written to a uniquely named temporary beside its final name, flushed to disk and renamed
over it (`write_atomic`; `replace_folder` for a folder such as adapter/), so a kill, a full disk or a second process
leaves either the previous file or the new one, never half of one. The OS error of a failed write comes back as
`WriteFailed` naming the file; a full disk is `disk_full`.

torch's files are zip archives that store a CRC-32 of every record, which `torch.load` does not check: a flipped bit
in a tensor loads silently. `check_torch_file` reads every record against its checksum before anything is loaded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import DiskFull, UserError
from . import faults

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(Exception):
    """Writing `path` failed with the OS error `error` (its message: the file and the error, one line)."""

    def __init__(self, path: Path, error: OSError):
        self.path, self.error = Path(path), error
        super().__init__(f"{path}: cannot write: {error.strerror or error}")

    @property
    def disk_full(self) -> bool:
        return self.error.errno in FULL_DISK

    def said(self, resume: str | None) -> Exception:
        """The error to show, in one line: a full disk mid-run stops (exit code 3) with `resume`, the command that
        goes on from the last checkpoint once there is space (None: no checkpoint yet); any other write error is
        the user's to fix (UserError, exit code 2)."""
        if not self.disk_full:
            return UserError(str(self))
        if resume is None:
            return DiskFull(f"{self}; free space, then start the run again")
        return DiskFull(f"{self}; what was written before is whole; free space, then continue with: {resume}")


class _Recording:
    """A binary file that remembers the OS error of a failed write: torch.save reports one as a RuntimeError
    ("unexpected pos ...") that no longer says the disk was full."""

    def __init__(self, handle: BinaryIO, name: str = ""):
        self.handle, self.error, self.name, self.started = handle, None, name, False

    def write(self, data) -> int:
        try:
            written = self.handle.write(data)
        except OSError as error:
            self.error = error
            raise
        if not self.started:  # (the tests' exact point: inside the write, e.g. torch.save's, of `name`, begun)
            self.started = True
            if faults.armed():
                self.handle.flush()
                faults.at(f"write:{self.name}")
        return written

    def __getattr__(self, name):
        return getattr(self.handle, name)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(handle)` into a temporary beside `path`, flushed to disk, then renamed over `path`: a crash leaves the
    previous file whole, and two processes never share a temporary. A failed write raises WriteFailed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise WriteFailed(path, error) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the file should read like any other the user writes
    recording = None
    try:
        with os.fdopen(descriptor, "wb") as handle:
            recording = _Recording(handle, path.name)
            write(recording)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        cause = recording.error if recording is not None and recording.error is not None else error
        if isinstance(cause, OSError):
            raise WriteFailed(path, cause) from None
        raise


def write_text(path: str | Path, text: str) -> None:
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def replace_folder(path: str | Path, write: Callable[[Path], object]) -> None:
    """`write(folder)` into a new folder beside `path`, then put in the place of `path` (the previous folder, if
    any, is moved aside first and removed last): a crash leaves a whole folder, old or new, under `path`."""
    path = Path(path)
    try:
        building = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    except OSError as error:
        raise WriteFailed(path, error) from None
    try:
        write(building)
        old = path.with_name(f".{path.name}.old") if path.exists() else None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(building, path)
    except BaseException as error:
        shutil.rmtree(building, ignore_errors=True)
        if isinstance(error, OSError):
            raise WriteFailed(Path(error.filename or path), error) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_torch_file(path: str | Path) -> str | None:
    """Why the torch file at `path` is damaged (a record whose bytes do not match its stored CRC-32, a cut or garbled
    archive), or None when every record is whole. A file of torch's legacy (non-zip) format has no checksums: None."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != b"PK\x03\x04":  # not a zip: the legacy format, or garbage torch.load refuses
                return None if _legacy(path) else "not a torch file (no zip archive)"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as error:
        return f"damaged: {error}"
    except OSError as error:
        return f"cannot read: {error.strerror or error}"
    return None if bad is None else f"damaged: the record {bad} does not match its stored checksum"


def _legacy(path: Path) -> bool:
    """A file in torch's pre-1.6 format: a pickle that starts with the format's magic number (a protocol-2 pickle)."""
    with open(path, "rb") as handle:
        return handle.read(2) == b"\x80\x02"


# what write_atomic, replace_folder and the plan file leave while they write (mkstemp's 8 characters), what
# replace_folder moves aside for a moment, and the trackers' state on its way to trackers.json
TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$|^\.(adapter|merged)\.old$|^\.trackers\.json\.tmp$")


def dead_temporaries(out: Path) -> list[Path]:
    """The temporaries a writer left in `out` and `out/checkpoints` (hidden names of the patterns above). Only the
    process that holds `out`'s lock may call them dead: no other run is writing there (storage/lock.py)."""
    found = []
    for folder in (out, out / "checkpoints"):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        found += [entry for entry in entries if TEMPORARY.match(entry.name)]
    return sorted(found)


def remove_dead_temporaries(out: Path) -> list[Path]:
    """Remove what `dead_temporaries` finds; returns it."""
    found = dead_temporaries(out)
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return found
