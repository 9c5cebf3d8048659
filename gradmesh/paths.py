"""Paths a user names, checked with `os.stat` before anything opens them.

A FIFO or a character device (/dev/zero, /dev/stdin at a terminal) where gradmesh expects a
file blocks on open or reads forever, and writing to one sends the bytes nowhere anyone can
find them; `os.stat` tells what a path is without opening it. Symbolic links are followed:
`--config /dev/stdin < settings.toml` names a regular file.
"""

import os
import stat
from pathlib import Path

from gradmesh.errors import UsageError

KINDS = {"file": stat.S_ISREG, "folder": stat.S_ISDIR}
_OTHERS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
           (stat.S_ISSOCK, "a socket"))


def _described(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    special = next((name for test, name in _OTHERS if test(mode)), "a special file")
    return f"{special} (opening it could block or read forever)"


def checked(text: str | Path, what: str, accepted: str, kinds: tuple[str, ...] = ("file",),
            missing_ok: bool = False) -> Path:
    """`text` as a Path when it is one of `kinds` (or absent, with missing_ok); else a UsageError
    naming what it is and what is accepted."""
    if not str(text).strip():
        raise UsageError(f"{what} is empty; give {accepted}")
    path = Path(text)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if missing_ok:
            return path
        raise UsageError(f"{what} {str(text)!r} does not exist; give {accepted}") from None
    except OSError as exc:
        raise UsageError(f"{what} {str(text)!r} cannot be read ({exc.strerror}); give {accepted}") from None
    if not any(KINDS[kind](mode) for kind in kinds):
        raise UsageError(f"{what} {str(text)!r} is {_described(mode)}; give {accepted}")
    return path
