"""Run files that survive a crash: JSONL read past torn lines, whole files replaced atomically.

A process killed mid-append leaves a last line without its newline (and, once appending goes
on, a garbled line in the middle); readers skip such lines instead of failing, since every
other line is still good. A file written whole (summary.json, config.toml, model.safetensors)
goes to a temporary name in its own folder, is synced and then renamed over the old one, so a
reader or a crash sees the old file or the new one, never part of one (contract 9).

No torch here: the CLI, the run directory and the monitor all import it.
"""

import json
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gradmesh import manifest
from gradmesh.errors import UsageError
from gradmesh.paths import describe

TMP_PREFIX = ".gradmesh-tmp-"
"""Temporary files start so, under rundir.OWN_PREFIX: a crash's leftovers are known as gradmesh's."""


READ_LIMIT = 512 * 2**20
"""The most of one run file gradmesh reads (metrics.jsonl of a long run with many ranks stays well below)."""


def read_regular(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file (a link to one too); FileNotFoundError when there is none."""
    limit = READ_LIMIT if limit is None else limit
    with os.fdopen(open_regular(path, limit), "rb") as handle:
        return handle.read(limit)  # a file still growing is cut at the limit too


def open_regular(path: str | Path, limit: int | None = None) -> int:
    """A descriptor to read a regular file, FileNotFoundError when there is none. Anything else where
    a run file belongs (a FIFO, /dev/zero, a folder, a socket) or a file over `limit` (READ_LIMIT)
    is a UsageError: reading it could block, never end, or fill the memory."""
    limit = READ_LIMIT if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO to read would wait for a writer
    except FileNotFoundError:
        raise
    except OSError as exc:  # a socket (ENXIO), no permission, a loop of links
        raise UsageError(
            f"{str(path)!r} cannot be read ({exc.strerror}); gradmesh reads only regular files in a run dir"
        ) from None
    info = os.fstat(fd)  # of what was opened: no race with a rename between a check and the read
    if stat.S_ISREG(info.st_mode) and info.st_size <= limit:
        return fd
    os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(
            f"{str(path)!r} is {describe(info.st_mode)}; gradmesh reads only regular files in a run "
            "dir: remove it (or put the file itself there)"
        )
    raise UsageError(
        f"{str(path)!r} has {info.st_size:,} bytes, more than the {limit:,} gradmesh reads of one "
        "run file; move it away"
    )


def read_jsonl(path: Path) -> list[dict]:
    """Every complete, well-formed line of a JSONL file; [] when it does not exist yet (read_regular's
    UsageError when it is no regular file or too big)."""
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return []
    return parse_jsonl(data)


def parse_jsonl(data: bytes) -> list[dict]:
    return [row for _, row in jsonl_lines(data)]


def jsonl_lines(data: bytes) -> Iterator[tuple[bytes, dict]]:
    """(line, object) for each complete line holding a JSON object. Bytes after the last newline
    are a line still being written, or torn by a crash: never parsed."""
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # torn by a crash mid-write, then appended to; the other lines are still good
        if isinstance(row, dict):
            yield line, row


def _ends_torn(path: Path) -> bool:
    try:
        with open(path, "rb") as tail:
            if tail.seek(0, os.SEEK_END) == 0:
                return False
            tail.seek(-1, os.SEEK_END)
            return tail.read(1) != b"\n"
    except FileNotFoundError:
        return False


def open_append(path: str | Path, buffering: int = -1):
    """A JSONL file opened to append records; a last line torn by a crash is ended first, so the
    next record starts a line of its own instead of being lost with the torn one. A new file is
    recorded in its run directory's manifest first; a link is never followed (ELOOP)."""
    torn = _ends_torn(Path(path))
    manifest.record_new(path)
    handle = open(path, "a", buffering=buffering, opener=_no_follow)
    if torn:
        handle.write("\n")
    return handle


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


def abandoned_temporaries(folder: Path) -> list[Path]:
    """Temporary files of atomic writes whose writer is gone (a crash cut them short). A live
    writer's are left alone: the launchers of a multi-node job share the run directory."""
    found = []
    for path in Path(folder).glob(f"{TMP_PREFIX}*"):
        pid = path.name.rsplit("-", 2)[-2] if path.name.count("-") >= 2 else ""
        if not (re.fullmatch(r"[0-9]{1,9}", pid) and _alive(int(pid))):
            found.append(path)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that wants a path of its own (safetensors);
    when the block ends without an error it is synced and renamed to `path`. On an error `path`
    is left as it was and the temporary file removed. A new `path` is recorded in its run
    directory's manifest first."""
    path = Path(path)
    manifest.record_new(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield tmp
        _fsync(tmp)  # the data is on disk before the rename makes it the file
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write a whole file (text as UTF-8) so that a crash leaves the old one or the new one."""
    with replacing(path) as tmp, open(tmp, "xb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` survive a power cut, not only a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
