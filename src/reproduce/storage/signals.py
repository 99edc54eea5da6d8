"""SIGINT and SIGTERM for the whole of `reproduce run`, not only its step loop.

`guard()` is held by the command from its start to its end. Outside a deferred section a signal raises
`SignalReceived` where the process is (setting up: nothing is lost by stopping there, and every `finally` and
`except BaseException` on the way puts the folder back as it was); inside `deferred()` (the step loop, the final
writes, a folder moved aside or put back) it only sets `received()`, which the section checks at its safe points:
the step loop after its step, the final writes between files. Either way the command ends with one line and the
command that goes on, with exit code 130 (SIGINT) or 143 (SIGTERM). Without the guard (a library caller's
`train`), nothing here changes the process's signals.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class SignalReceived(BaseException):
    """SIGINT or SIGTERM outside a deferred section (a BaseException, as KeyboardInterrupt: no `except Exception`
    on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[signal.Signals(self.signum)]


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
    """A signal inside the block only sets `pending()`. With `raise_on_exit`, a signal the block deferred is
    raised (`SignalReceived`) when it ends without an error of its own and nothing outside it defers."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    if raise_on_exit and not _state.deferring and _state.pending is not None:
        signum, _state.pending = _state.pending, None
        raise SignalReceived(signum)


def pending() -> int | None:
    """The SIGINT / SIGTERM received in a deferred section and not yet acted on (None: none)."""
    return _state.pending


def take() -> int | None:
    """`pending()`, now acted on."""
    signum, _state.pending = _state.pending, None
    return signum
