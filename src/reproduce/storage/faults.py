"""Exact points for the fault tests: `REPRODUCE_FAULT_AT=POINT[#N]:SIGNAL[,...]` makes this process send itself
SIGNAL (SIGINT, SIGTERM, SIGKILL) the Nth time (default the first) it reaches POINT, so a test can stop a real
`reproduce run` in the middle of a write or between two renames, not only between steps. Unset (always, outside
the tests), `at` costs a dictionary look-up.

Points: `start` (the run set up, plan.yaml written, before its first step), `write:NAME` (inside the write of the
file NAME, e.g. model.pt, last.pt, plan.yaml: its temporary holds the first bytes, the file is not yet in
place), `aside` (--force:
the previous run set aside, its outputs not yet removed from the folder), `end` (after the last step, before the
run's end is written).
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
