"""Exact points for the fault tests: `REPRODUCE_FAULT_AT=POINT[#N]:SIGNAL[,...]` makes this process send itself
SIGNAL the Nth time (default the first) it reaches POINT: `start` (plan.yaml written, before the first step),
`write:NAME` (inside the write of the file NAME, not yet in place), `aside` (--force: the previous run set aside,
not yet removed), `end` (after the last step, before the run's end is written).
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "REPRODUCE_FAULT_AT"
_seen: dict[str, int] = {}


def at(point: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    _seen[point] = _seen.get(point, 0) + 1
    for item in spec.split(","):
        where, _, name = item.rpartition(":")
        where, _, count = where.partition("#")
        if where == point and _seen[point] == int(count or 1):
            os.kill(os.getpid(), getattr(signal, name))
