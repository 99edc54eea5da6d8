"""Command-line interface: thin typer commands over the core. User errors are caught here, in one place."""

from __future__ import annotations

import atexit
import gc
import os
import sys

import typer
from typer.exceptions import TyperException

from ..errors import DoesNotFit, GatePaused, Interrupted, TrainingStopped, UserError
from ..train.distributed import launched
from . import check, evaluate, memory, papers, plan, probe, report, run, verify  # noqa: F401  (each registers its command)
from .app import app
from .options import as_typed, typed_args

EXIT_USER_ERROR = 2
EXIT_DOES_NOT_FIT = DoesNotFit.exit_code  # 3: valid input, but not even micro-batch 1 fits the memory


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `reproduce` console script."""
    typed = sys.argv[1:] if argv is None else argv
    typed_args[:] = typed
    # the command itself, not a torchrun worker (whose process group's threads the collection must tear down)
    if argv is None and "TORCHELASTIC_RUN_ID" not in os.environ and "WORLD_SIZE" not in os.environ:
        atexit.register(leave_to_the_os)
    try:
        code = app(args=argv, prog_name="reproduce", standalone_mode=False)
    except DoesNotFit as error:
        _end([as_typed(line, typed) for line in error.lines], EXIT_DOES_NOT_FIT)
    except UserError as error:  # its fields named as the user gave them: the flag typed, or the recipe's path
        _end([f"error: {as_typed(line, typed)}" for line in error.lines], EXIT_USER_ERROR)
    except Interrupted as error:
        _end([f"interrupted: {error}"], error.exit_code, quiet=launched.quiet_rank())
    except GatePaused as error:  # exit status 4: a gate's checkpoint kept, and the two ways on
        _end([f"paused: {error}"], error.exit_code, quiet=launched.quiet_rank())
    except TrainingStopped as error:  # (the fields it names as flags, as an error's)
        _end([f"stopped: {as_typed(str(error), typed)}"], error.exit_code, peer=getattr(error, "peer", False))
    except TyperException as error:  # click's usage errors: bad option values, missing arguments
        print(f"error: {error.format_message()}", file=sys.stderr)
        sys.exit(error.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _end(lines: list[str], code: int, peer: bool = False, quiet: bool = False) -> None:
    """Say the command's ending and exit with its code; a launched worker leaves both to the launcher, which says
    the ranks' ending once. A rank stopped because another left (`peer`) still fails, so torchrun restarts the group
    under --max-restarts."""
    if launched.report(lines, code, peer):
        sys.exit(code if peer else 0)
    if not quiet:
        for line in lines:
            print(line, file=sys.stderr)
    sys.exit(code)


def leave_to_the_os() -> None:
    """At exit CPython collects every object once more: with torch, scipy and scikit-learn loaded about 1 s of CPU,
    a fifth of a short run. Frozen, they are left to the OS (registered first, so run after every other handler)."""
    gc.freeze()
