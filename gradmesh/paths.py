"""Paths a user names, checked with `os.stat` before anything opens them.

A FIFO or a character device (/dev/zero, /dev/stdin at a terminal) where gradmesh expects a
file blocks on open or reads forever, and writing to one sends the bytes nowhere anyone can
find them; `os.stat` tells what a path is without opening it. Symbolic links are followed:
`--config /dev/stdin < settings.toml` names a regular file. A name no file system takes (a NUL
byte, a level longer than NAME_MAX) is refused by `check_name` before any of that: Python's
`os` functions raise ValueError on a NUL, not OSError.
"""

import os
import stat
from pathlib import Path

from gradmesh.errors import UsageError

NAME_MAX, PATH_MAX = 255, 4096
"""Linux's limits, in bytes: one level of a path (ext4, xfs, btrfs, tmpfs alike), and a whole path."""
KINDS = {"file": stat.S_ISREG, "folder": stat.S_ISDIR}
_OTHERS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def describe(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    special = next((name for test, name in _OTHERS if test(mode)), "a special file")
    return f"{special} (opening it could block or read forever)"


def check_name(text: str | Path, what: str) -> None:
    """A UsageError unless `text` is a path name the file system can take: no NUL, no level over
    NAME_MAX bytes, at most PATH_MAX bytes in all."""
    text = str(text)
    if "\0" in text:
        raise UsageError(f"{what} {text[:60]!r} contains a NUL character, which no path name may; give another path")
    try:
        encoded = os.fsencode(text)
    except UnicodeEncodeError:
        raise UsageError(f"{what} {text[:60]!r} cannot be encoded as a file name; give another path") from None
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        level = os.fsdecode(longest)
        raise UsageError(
            f"{what}: the name {level[:40] + '...'!r} is {len(longest)} bytes long; a file system takes "
            f"at most {NAME_MAX} bytes per folder level; give a shorter name"
        )
    if len(encoded) >= PATH_MAX:
        raise UsageError(
            f"{what} {text[:40] + '...'!r} is {len(encoded)} bytes long; a path may have at most "
            f"{PATH_MAX - 1}; give a shorter one"
        )


def checked(
    text: str | Path, what: str, accepted: str, kinds: tuple[str, ...] = ("file",), missing_ok: bool = False
) -> Path:
    """`text` as a Path when it is one of `kinds` (or absent, with missing_ok); else a UsageError
    naming what it is and what is accepted."""
    if not str(text).strip():
        raise UsageError(f"{what} is empty; give {accepted}")
    check_name(text, what)
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
        raise UsageError(f"{what} {str(text)!r} is {describe(mode)}; give {accepted}")
    return path
