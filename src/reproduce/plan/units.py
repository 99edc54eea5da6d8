"""Memory sizes as people write them: `24GiB`, `24 GB`, `512MiB`, `1.5TB`, or a plain number of bytes."""

from __future__ import annotations

import os
import re

from ..errors import UserError

_FACTORS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
BARE_BYTES_MIN = 2**20  # a bare number below 1 MiB is a unit left out, not a memory size
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "`memory`") -> int:
    """Bytes in `text`; a UserError naming `what` when it is not a size."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _FACTORS:
        raise UserError(f"{what}: expected a memory size such as 24GiB, 16GB or 512MiB (got {text!r})")
    size = int(float(match.group(1)) * _FACTORS[unit])
    if size <= 0:
        raise UserError(f"{what}: must be > 0 (got {text!r})")
    if not unit and size < BARE_BYTES_MIN:  # `--memory 8`: surely 8 GiB, not 8 bytes
        number = match.group(1)
        raise UserError(f"{what}: {number} bytes? give a unit, e.g. {number}GiB")
    return size


def format_size(n: float) -> str:
    """`n` bytes for people: 1.50 GiB, 37.2 MiB."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: int) -> str:
    """A count of parameters for people: 6.74B, 124.5M, 393.2k, 512."""
    for unit, factor in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if abs(n) >= factor:
            digits = 2 if abs(n) < 10 * factor else 1
            return f"{n / factor:.{digits}f}{unit}"
    return str(int(n))


def available_host_memory() -> int | None:
    """Free RAM (`MemAvailable`), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
