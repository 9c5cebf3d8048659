"""The one error type for bad user input.

A `UsageError` carries a single line naming the bad value and what would be accepted; the CLI
prints it without a traceback and exits with code 2 (contract 7 in DESIGN.md).
"""

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    def __init__(self, message: str):
        super().__init__(message.replace("\n", " "))
