"""The one exception type for mistakes a user can fix, caught in one place by the CLI (exit code 2). A
message names the request's field or the recipe's dotted path in backticks, never a flag, so a library caller is
told about its argument; the CLI maps names to the flags typed (`reproduce.cli.options`). `DoesNotFit` (exit 3):
valid input, too small hardware.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, one line per problem, each naming the file or field and what was
    expected. `field`: what the first line is about ("`micro_batch_max`: must be >= 1 (got 0)")."""

    def __init__(self, *lines: str, field: str | None = None):
        if not lines:
            raise ValueError("UserError needs at least one line")
        self.field = field
        self.lines = [line for line in lines if line]
        if field is not None:
            self.lines[0] = f"`{field}`: {self.lines[0]}"
        super().__init__("\n".join(self.lines))


class MicroBatchError(UserError):
    """A user error whose way out is another micro-batch and which says so: the probe passes it on as
    it is."""


class DoesNotFit(UserError):
    """Not even micro-batch 1 fits the memory planned for: what one step needs and the ways out, one per line."""

    exit_code = 3


class TrainingStopped(Exception):
    """A run stopped for a reason that is not the user's input (a non-finite loss); its last checkpoint is kept."""

    exit_code = 1


class DiskFull(TrainingStopped):
    """No space left on the device mid-run: what was written is whole, and the line says how to go on."""

    exit_code = 3


class GatePaused(TrainingStopped):
    """A `pause` gate missed its bound: the run checkpointed and stopped (exit status 4); the line says
    the gate and the two ways on."""

    exit_code = 4


class Interrupted(TrainingStopped):
    """SIGINT or SIGTERM: the current optimizer step was finished and checkpointed before stopping."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
