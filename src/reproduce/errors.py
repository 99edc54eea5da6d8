"""The one exception type for mistakes a user can fix (bad recipe, bad option, missing file).

The CLI catches it in one place and prints its lines, one per problem, with exit code 2. A message names what it is
about by the request's field (`micro_batch_max`, `device`, `world_size`) or the recipe's dotted path
(`batch.sharding`), in backticks, never by a command-line flag: a library caller (a script calling `make_plan`,
`reproduce check`) is told about the argument it passed, and the CLI turns each name into the flag the user typed
(`reproduce.cli.flags`). Its one subclass, `DoesNotFit`, is the honest "no micro-batch fits this memory" (exit
code 3): the input is valid, the hardware is too small, and its lines say what the step needs and what would fit.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input. Each line names the file or field, and what was expected.

    `field`, when given, is what the first line is about: the line then opens with it, "`micro_batch_max`: must be
    >= 1 (got 0)". Other names in the lines are written `in backticks` the same way."""

    def __init__(self, *lines: str, field: str | None = None):
        if not lines:
            raise ValueError("UserError needs at least one line")
        self.field = field
        self.lines = [line for line in lines if line]
        if field is not None:
            self.lines[0] = f"`{field}`: {self.lines[0]}"
        super().__init__("\n".join(self.lines))


class MicroBatchError(UserError):
    """A user error whose way out is another micro-batch, and which says so (it names `micro_batch_max`): the probe,
    which measures that maximum, passes it on as it is, with no hint to give one."""


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
    """A `pause` gate of the recipe missed its bound: the run checkpointed at the gate and stopped (exit status 4);
    the line says the gate, measured against its bound, and the two ways on (resume after a fix, or accept it)."""

    exit_code = 4


class Interrupted(TrainingStopped):
    """SIGINT or SIGTERM: the current optimizer step was finished and checkpointed before stopping."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
