"""The one error type for bad user input, and the one way out when there is nothing to do.

A `UsageError` carries a single line naming the bad value and what would be accepted; the CLI
prints it without a traceback and exits with code 2 (contract 7). `NothingToDo`
is a request already fulfilled (resuming a finished run): one line, exit code 0.
"""

EXIT_USAGE = 2
EXIT_HANG = 3
"""A worker whose step watchdog found the run hung (`--step-timeout`)."""
EXIT_NONFINITE = 4
"""A run stopped on NaN or infinite values (`--on-nonfinite`)."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    def __init__(self, message: str):
        super().__init__(message.replace("\n", " "))


class NothingToDo(Exception):
    """The command would change nothing: printed as one line, exit code 0."""
