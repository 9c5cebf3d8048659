"""A checkpoint's checksums: every file in it, its state file included, is sealed when published.

`trainer_state.json` lists the size and CRC-32 of every other file of the checkpoint under
`files`, and carries `checksum`, the CRC-32 of its own content without that key (serialised
canonically: sorted keys, JSON types only). So an edited step, sampler position or config in the
state file is caught as surely as a flipped bit in a shard, and a checkpoint with no `files`
entry (torn, forged, or from before checksums) cannot be verified: it counts as damaged, like
one that fails. Names in `files` must be plain file names in the checkpoint's own folder, and a
file found as a symlink is damage, never followed. Hand-written: DCP has no integrity check of
its own, and CRC-32 (zlib) is what is needed against torn and altered files, not an adversary
who can also rewrite the checksums.
"""

import json
import os
import stat
import zlib
from pathlib import Path

STATE_FILE = "trainer_state.json"
DCP_METADATA = ".metadata"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_digests(folder: Path) -> dict[str, list[int]]:
    return {
        p.name: [p.stat().st_size, _crc32(p)] for p in sorted(folder.iterdir()) if p.is_file() and p.name != STATE_FILE
    }


def state_checksum(state: dict) -> int:
    """CRC-32 of a state's canonical JSON, its `checksum` key left out."""
    body = {key: value for key, value in state.items() if key != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def seal(state: dict, folder: Path) -> dict:
    """`state` with the digests of every file in `folder` and its own checksum: what to write as
    the state file. Round-tripped through JSON first, so the checksum is of what a reader sees."""
    sealed = json.loads(json.dumps(dict(state, files=file_digests(folder))))
    return dict(sealed, checksum=state_checksum(sealed))


def verify(path: Path) -> str | None:
    """None if the checkpoint at `path` is intact, else what is wrong with it (one phrase)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:  # a UnicodeDecodeError is a ValueError
        return f"{STATE_FILE} unreadable ({str(exc).splitlines()[0][:120]})"
    problem = _state_problem(path, state)
    if problem:
        return problem
    for name, (size, crc) in state["files"].items():
        try:
            info = (path / name).lstat()
        except FileNotFoundError:
            return f"{name} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a plain file"
        if info.st_size != size:
            return f"{name} has {info.st_size} bytes, expected {size}"
        if _crc32(path / name) != crc:
            return f"{name} fails its checksum"
    return None


def _state_problem(path: Path, state) -> str | None:
    if not isinstance(state, dict):
        return f"{STATE_FILE} holds a JSON {type(state).__name__}, not an object"
    if "files" not in state:
        return f"{STATE_FILE} has no checksums (no 'files' entry), so the checkpoint cannot be verified"
    if state.get("checksum") != state_checksum(state):
        return f"{STATE_FILE} fails its checksum (edited or torn after it was written)"
    files = state["files"]
    if not isinstance(files, dict) or DCP_METADATA not in files:
        return f"{STATE_FILE}'s 'files' entry does not list the checkpoint's {DCP_METADATA}"
    for name, digest in files.items():
        if not _plain_name(name) or not _digest(digest):
            return f"{STATE_FILE} lists {name!r}, which is not a file of the checkpoint's own folder"
    step = state.get("step")
    if type(step) is not int or f"step-{step}" != path.name:
        return f"{STATE_FILE} holds step {step!r}, not the step its folder {path.name} names"
    if not isinstance(state.get("sampler"), dict) or not isinstance(state.get("run", {}), dict):
        return f"{STATE_FILE} has no sampler position or a malformed 'run' entry"
    return None


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..", STATE_FILE) and os.sep not in name and "\0" not in name


def _digest(digest) -> bool:
    return isinstance(digest, list) and len(digest) == 2 and all(type(x) is int for x in digest)
