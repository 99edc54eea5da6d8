"""Files written whole or not at all: a temporary beside the final name, flushed and renamed over it, so a kill, a full
disk or a second process leaves the previous file or the new one, never half; a failed write is `WriteFailed`.

`torch.load` checks none of the CRC-32s a torch zip stores, and they cover no header. So a torch file reproduce
writes is sealed: the archive's SHA-256 in the zip's own comment (which torch and zipfile read past), checked by
`check_torch_file` before any load; an unsealed one gets each record's CRC-32 and its headers checked.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import DiskFull, UserError
from ..plan.planfile import write_text_atomic
from . import signals

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(Exception):
    """Writing `path` failed with the OS error `error` (its message: the file and the error, one line)."""

    def __init__(self, path: Path, error: OSError):
        self.path, self.error = Path(path), error
        super().__init__(f"{path}: cannot write: {error.strerror or error}")

    def said(self, resume: str | None) -> Exception:
        """The error to show: a full disk stops (exit code 3) with `resume`, the command that goes on (None: no
        checkpoint yet); any other write error is the user's to fix (UserError, exit code 2)."""
        if self.error.errno not in FULL_DISK:
            return UserError(str(self))
        if resume is None:
            return DiskFull(f"{self}; free space, then start the run again")
        return DiskFull(f"{self}; what was written before is whole; free space, then continue with: {resume}")


class _Recording:
    """A binary file that remembers the OS error of a failed write (torch.save turns it into a RuntimeError)."""

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
            if os.environ.get(signals.FAULT_ENV):
                self.handle.flush()
                signals.fault_at(f"write:{self.name}")
        return written

    def __getattr__(self, name):
        return getattr(self.handle, name)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object] | bytes) -> None:
    """`write(handle)` (or the bytes `write`) written as the core's `write_text_atomic` writes, an OS error (the one a
    write met, though torch.save turns it into a RuntimeError) raised as WriteFailed."""
    path = Path(path)
    recording: _Recording | None = None

    def recorded(handle: BinaryIO) -> None:
        nonlocal recording
        recording = _Recording(handle, path.name)
        write(recording) if callable(write) else recording.write(write)

    try:
        write_text_atomic(path, recorded)
    except BaseException as error:
        cause = recording.error if recording is not None and recording.error is not None else error
        if isinstance(cause, OSError):
            raise WriteFailed(path, cause) from None
        raise


def replace_folder(path: str | Path, write: Callable[[Path], object]) -> None:
    """`write(folder)` into a new folder beside `path`, then put in its place (the previous one moved aside first,
    removed last): a crash leaves a whole folder, old or new."""
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


SEAL = b"reproduce-sha256:"  # the zip comment of a sealed torch file: this, then the archive's SHA-256 in hex
SEAL_LENGTH = len(SEAL) + 64
END_OF_ARCHIVE = b"PK\x05\x06"  # the end-of-central-directory record: 22 bytes, then the comment
END_LENGTH = 22
CHUNK = 1 << 20


class _Hashing:
    """A binary file that hashes what is written to it, in order (torch.save only writes and flushes)."""

    def __init__(self, handle) -> None:
        self.handle, self.digest, self.written, self.tail, self.in_order = handle, hashlib.sha256(), 0, b"", True

    def write(self, data) -> int:
        written = self.handle.write(data)
        view = memoryview(data).cast("B")[:written]
        self.digest.update(view)
        self.written += written
        self.tail = (self.tail + bytes(view[-END_LENGTH:]))[-END_LENGTH:]
        return written

    def seek(self, *args):  # (never called by torch.save: then the file is hashed again from disk)
        self.in_order = False
        return self.handle.seek(*args)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def write_torch_file(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(handle)` (a torch.save) written as `write_atomic` does, then sealed with its SHA-256."""

    def sealed(handle: BinaryIO) -> None:
        hashing = _Hashing(handle)
        write(hashing)  # type: ignore[arg-type]
        if not hashing.tail.startswith(END_OF_ARCHIVE) or hashing.tail[-2:] != b"\0\0":
            raise ValueError(f"{path}: not a zip archive without a comment (torch.save's format): cannot seal it")
        handle.flush()
        size = handle.seek(0, os.SEEK_END)
        digest = hashing.digest if hashing.in_order and hashing.written == size else _archive_digest(handle, size)
        handle.seek(size - 2)
        handle.write(SEAL_LENGTH.to_bytes(2, "little") + SEAL + digest.hexdigest().encode("ascii"))

    write_atomic(path, sealed)


def _archive_digest(handle: BinaryIO, size: int) -> hashlib._Hash:
    """The SHA-256 of the archive as torch wrote it: its first `size` - 2 bytes, then an empty comment's length."""
    digest, left = hashlib.sha256(), size - 2
    handle.seek(0)
    while left > 0:
        chunk = handle.read(min(CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    digest.update(b"\0\0")
    return digest


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file, in hex (a sharded checkpoint's shard files: last.pt, sealed itself, keeps theirs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _seal_problem(path: Path) -> str | None:
    """Why a sealed torch file does not match its seal: None when it matches, `NO_SEAL` when it carries none."""
    size = path.stat().st_size
    if size < END_LENGTH + SEAL_LENGTH:
        return NO_SEAL
    with open(path, "rb") as handle:
        handle.seek(size - SEAL_LENGTH)
        comment = handle.read(SEAL_LENGTH)
        if not comment.startswith(SEAL):
            return NO_SEAL
        handle.seek(size - SEAL_LENGTH - END_LENGTH)
        end = handle.read(END_LENGTH)
        if not end.startswith(END_OF_ARCHIVE) or end[20:] != SEAL_LENGTH.to_bytes(2, "little"):
            return "damaged: its end-of-archive record is not where its SHA-256 seal says (a cut or garbled archive)"
        digest = _archive_digest(handle, size - SEAL_LENGTH)
    if digest.hexdigest().encode("ascii") != comment[len(SEAL):]:
        return "damaged: its bytes do not match the SHA-256 written into it when it was saved"
    return None


NO_SEAL = "no seal"


def check_torch_file(path: str | Path) -> str | None:
    """Why the torch file at `path` is damaged, or None when it is whole (or of torch's legacy format, which has no
    checksums)."""
    path = Path(path)
    try:
        sealed = _seal_problem(path)
        if sealed != NO_SEAL:
            return sealed
        with open(path, "rb") as handle:
            head = handle.read(4)
        if head != b"PK\x03\x04":  # not a zip: torch's pre-1.6 format (a protocol-2 pickle), or garbage
            return None if head[:2] == b"\x80\x02" else "not a torch file (no zip archive)"
        with zipfile.ZipFile(path) as archive:
            problem = _header_problem(path, archive.infolist())
            bad = None if problem else archive.testzip()
    except OSError as error:
        return f"cannot read: {error.strerror or error}"
    except Exception as error:  # zipfile's own (BadZipFile, an encrypted record's RuntimeError, zlib.error, ...)
        return f"damaged: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    if problem:
        return f"damaged: {problem}"
    return None if bad is None else f"damaged: the record {bad} does not match its stored checksum"


def _header_problem(path: Path, records: list[zipfile.ZipInfo]) -> str | None:
    """What of an unsealed archive's headers torch would misread."""
    with open(path, "rb") as handle:
        for info in records:
            if info.flag_bits & 0x1:
                return f"the record {info.filename} is marked encrypted"
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                return f"the record {info.filename} has compression method {info.compress_type}"
            if info.is_dir() or info.external_attr & 0x10:
                return f"the record {info.filename} is marked a directory"
            handle.seek(info.header_offset)
            local = handle.read(30)
            if len(local) < 30 or not local.startswith(b"PK\x03\x04"):
                return f"the record {info.filename} has no local header where the directory says"
            flags, method = int.from_bytes(local[6:8], "little"), int.from_bytes(local[8:10], "little")
            name = handle.read(int.from_bytes(local[26:28], "little"))
            if name != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
                return f"the record {info.filename}'s local header names another record"
            if method != info.compress_type or (flags ^ info.flag_bits) & 0x1:
                return f"the record {info.filename}'s local header differs from the directory's"
    return None


# what the writers leave while they write (mkstemp's 8 characters), and replace_folder's and the trackers' state's
TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$|^\.(adapter|merged)\.old$|^\.trackers\.json\.tmp$")
