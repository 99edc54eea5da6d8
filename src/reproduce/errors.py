"""The one exception type for mistakes a user can fix (bad recipe, bad option, missing file).

The CLI catches it in one place and prints its lines, one per problem, with exit code 2. Its one
subclass, `DoesNotFit`, is the honest "no micro-batch fits this memory" (exit code 3): the input is
valid, the hardware is too small, and its lines say what the step needs and what would fit.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input. Each line names the file or option, the field, and what was expected."""

    def __init__(self, *lines: str):
        if not lines:
            raise ValueError("UserError needs at least one line")
        self.lines = [line for line in lines if line]
        super().__init__("\n".join(self.lines))


class DoesNotFit(UserError):
    """Not even micro-batch 1 fits the memory planned for: what one step needs and the ways out, one per line."""

    exit_code = 3


class TrainingStopped(Exception):
    """A run stopped for a reason that is not the user's input (a non-finite loss); its last checkpoint is kept."""

    exit_code = 1


class DiskFull(TrainingStopped):
    """No space left on the device mid-run: what was written is whole, and the line says how to go on."""

    exit_code = 3


class Interrupted(TrainingStopped):
    """SIGINT or SIGTERM: the current optimizer step was finished and checkpointed before stopping."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
