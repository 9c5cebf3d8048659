"""One run per run directory at a time (contract 9): the launcher holds a lock file.

`RUN_DIR/.gradmesh-lock` names its holder (PID, host, job). On one host the lock is an
`fcntl.flock` on that file, which the kernel drops when the holder dies however it dies, so a
lock left by a dead process never blocks a new run; the PID in the file is only for the message.
The launchers of one multi-node job share the run directory (a shared file system): a launcher
whose job key (rendezvous endpoint and id) matches the holder's is its peer, not a rival.
"""

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from gradmesh.errors import UsageError
from gradmesh.files import read_regular
from gradmesh.paths import describe

LOCK = ".gradmesh-lock"
NAMING_S = 2.0
"""How long a lock may stand unnamed before it is refused as held by an unknown process."""


def _holder(path: Path) -> dict:
    try:
        holder = json.loads(read_regular(path, limit=4096))
    except (OSError, ValueError, UsageError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _refuse(run_dir: Path, holder: dict) -> UsageError:
    where = f" on {holder['host']}" if holder.get("host") not in (None, socket.gethostname()) else ""
    return UsageError(
        f"run dir {str(run_dir)!r} is in use by another gradmesh run (pid {holder.get('pid', '?')}{where}); "
        "wait for it to finish, stop it, or give another --run-dir"
    )


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


class RunLock:
    """Held from before the run directory is touched until the launcher exits."""

    def __init__(self, run_dir: str | Path, job: str = ""):
        self.run_dir, self.job = Path(run_dir), job
        self.path = self.run_dir / LOCK
        self.fd: int | None = None

    def check(self) -> None:
        """Refuse (UsageError naming the holder) when a live rival holds the lock; takes nothing."""
        if os.path.lexists(self.path):
            self.acquire()
            self.release()

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                holder = self._named_holder()
                if self.job and holder.get("job") == self.job:
                    return self  # a peer launcher of the same multi-node job
                raise _refuse(self.run_dir, holder) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # locked a file its holder unlinked on release: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": self.job}).encode())
        self.fd = fd
        return self

    def _open(self) -> int:
        """The lock file, never through a link and only as a regular file: it is written and
        truncated (a link to /dev/zero had the truncate fail with EINVAL, a traceback)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:  # ELOOP: a link; ENXIO: a socket
            raise UsageError(
                f"{str(self.path)!r} cannot be opened as gradmesh's lock file ({exc.strerror}); it is "
                "gradmesh's own: remove it (or give another --run-dir)"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError(
                f"{str(self.path)!r} is {describe(os.lstat(self.path).st_mode)}, not gradmesh's lock file; "
                "remove it (or give another --run-dir)"
            )
        return fd

    def _named_holder(self) -> dict:
        """The holder as its file names it. A holder writes its name just after taking the lock,
        so an empty file is read again for a moment: the launchers of a multi-node job start
        together, and a peer read the file between the two and refused its own job."""
        deadline = time.monotonic() + NAMING_S
        while not (holder := _holder(self.path)) and time.monotonic() < deadline:
            time.sleep(0.02)
        return holder

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: no rival can have taken it meanwhile
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
