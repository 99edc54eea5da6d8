"""The one exception type for mistakes a user can fix (bad recipe, bad option, missing file).

The CLI catches it in one place and prints its lines, one per problem, with exit code 2.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input. Each line names the file or option, the field, and what was expected."""

    def __init__(self, *lines: str):
        if not lines:
            raise ValueError("UserError needs at least one line")
        self.lines = [line for line in lines if line]
        super().__init__("\n".join(self.lines))


class TrainingStopped(Exception):
    """A run stopped for a reason that is not the user's input (a non-finite loss); its last checkpoint is kept."""


class Interrupted(TrainingStopped):
    """SIGINT or SIGTERM: the current optimizer step was finished and checkpointed before stopping."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
