"""SIGINT and SIGTERM for the whole of `reproduce run`, not only its step loop.

Under `guard()` a signal raises `SignalReceived` where the process is (setting up: every `finally` on the way puts
the folder back), except inside `deferred()` (the step loop, the final writes, a folder moved aside), where it is
only recorded until the section's safe points. Either way the command ends with one line, the command that goes
on, and exit code 130 (SIGINT) or 143 (SIGTERM). Without the guard (a library caller), no handler is installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class SignalReceived(BaseException):
    """SIGINT or SIGTERM outside a deferred section (a BaseException, which no `except Exception` swallows)."""

    def __init__(self, signum: int):
        self.signum, self.name = signum, signal.Signals(signum).name
        self.exit_code = EXIT_CODES[signal.Signals(signum)]
        super().__init__(self.name)


class _State:
    installed = False
    deferring = 0
    pending: int | None = None  # received and not yet acted on
    previous: dict = {}


_state = _State()


def _handle(signum: int, frame: object) -> None:
    if _state.pending is None:
        _state.pending = signum
    if not _state.deferring:
        _state.pending = None
        raise SignalReceived(signum)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """SIGINT / SIGTERM handled by this module while the block runs (main thread only; elsewhere a no-op)."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.pending, _state.deferring = None, 0
    _state.previous = {signum: signal.signal(signum, _handle) for signum in EXIT_CODES}
    _state.installed = True
    try:
        yield
    finally:
        for signum, handler in _state.previous.items():
            signal.signal(signum, handler)
        _state.installed, _state.previous = False, {}


@contextlib.contextmanager
def deferred(raise_on_exit: bool = False) -> Iterator[None]:
    """A signal inside the block only sets `pending()`; with `raise_on_exit` it is raised when the block ends without
    an error of its own and nothing outside it defers."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    if raise_on_exit and not _state.deferring and _state.pending is not None:
        raise SignalReceived(take())


def pending() -> int | None:
    """The SIGINT / SIGTERM received in a deferred section and not yet acted on (None: none)."""
    return _state.pending


def take() -> int | None:
    """`pending()`, now acted on."""
    signum, _state.pending = _state.pending, None
    return signum


# Exact points for the fault tests: `REPRODUCE_FAULT_AT=POINT[#N]:SIGNAL[,...]` makes this process send itself SIGNAL
# the Nth time (default the first) it reaches POINT: `start` (plan.yaml written, before the first step), `write:NAME`
# (inside the write of the file NAME, not yet in place), `aside` (--force: the previous run set aside, not yet
# removed), `end` (after the last step, before the run's end is written).
FAULT_ENV = "REPRODUCE_FAULT_AT"
_seen: dict[str, int] = {}


def fault_at(point: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    _seen[point] = _seen.get(point, 0) + 1
    for item in spec.split(","):
        where, _, name = item.rpartition(":")
        where, _, count = where.partition("#")
        if where == point and _seen[point] == int(count or 1):
            os.kill(os.getpid(), getattr(signal, name))
