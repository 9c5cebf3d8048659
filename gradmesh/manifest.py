"""The run directory's manifest: every path gradmesh created there, and the only ones it deletes.

contract 9. A user may keep notes in a run directory, even inside `checkpoints/`,
`report/` or `tensorboard/`; gradmesh tells its own files from theirs by this list, never by
name. `RUN_DIR/.gradmesh-manifest` holds one JSON object per line: `{"file": "summary.json"}`,
`{"dir": "report"}`, or `{"tree": "checkpoints/.tmp-step-5"}` (a hidden working folder that
gradmesh made and a library filled with files it names itself, DCP's shards: all of it is
gradmesh's). Paths are relative to the run directory; an entry that is absolute or climbs out
with `..` is ignored, so an edited manifest cannot aim a deletion elsewhere. A removal appends
`{"gone": path}`: the list is a log, read in order, so a user's file made later at a path
gradmesh once used is not taken for gradmesh's, and no line is ever rewritten under a writer.

A path is recorded *before* it is created, with a single write(2) on the manifest opened
O_APPEND: every rank of a run appends to it at once without losing another's record, and a
crash leaves at worst a record of a file never made (removing it finds nothing), never a
gradmesh file missing from the list. Deletion walks down from the run directory with
O_NOFOLLOW on every folder and deletes by directory descriptor, so a symlink on the way (a
`checkpoints/` linking elsewhere) stops it, and nothing outside the run directory is touched.

No torch here: the CLI and the run directory import it.
"""

import errno
import json
import os
import shutil
import stat
from pathlib import Path

MANIFEST = ".gradmesh-manifest"
MARKER = ".gradmesh-run"
"""The marker of a gradmesh run directory (rundir writes it): where a written path's manifest is."""
DEPTH = 3
"""How far up a written path its run directory can be (RUN_DIR/checkpoints/step-N/file)."""
KINDS = ("file", "tree", "dir")
"""What a record may name; `gone` records a removal."""
_LEFT_ALONE = {errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EEXIST}
"""Not what was recorded any more (a user's file in a folder, a link where a folder was): kept."""


def run_dir_of(path: str | Path) -> Path | None:
    """The gradmesh run directory `path` lies in (lexically, links not resolved), if any."""
    for folder in list(Path(path).parents)[:DEPTH]:
        if (folder / MARKER).is_file():
            return folder
    return None


def record_new(path: str | Path, kind: str = "file") -> None:
    """Record `path`, about to be created, in the manifest of the run directory it lies in; a
    path that exists already is not gradmesh's to claim (or was recorded when it was made)."""
    path = Path(path)
    if not os.path.lexists(path) and (run_dir := run_dir_of(path)) is not None:
        record(run_dir, path, kind=kind)


def record(run_dir: str | Path, *paths: str | Path, kind: str = "file") -> None:
    """Append `paths` (inside `run_dir`) to its manifest, in one write."""
    run_dir = Path(run_dir)
    lines = "".join(json.dumps({kind: Path(p).relative_to(run_dir).as_posix()}) + "\n" for p in paths)
    fd = os.open(run_dir / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, lines.encode())
    finally:
        os.close(fd)


def entries(run_dir: str | Path) -> set[tuple[str, str]]:
    """(kind, relative path) of every path recorded, confined to the run directory and not gone since."""
    from gradmesh.files import read_jsonl  # files records through this module

    found: dict[str, str] = {}
    for row in read_jsonl(Path(run_dir) / MANIFEST):
        for kind, rel in row.items():
            if kind == "gone":
                found.pop(rel, None)
            elif kind in KINDS and isinstance(rel, str) and _confined(rel):
                found[rel] = kind
    return {(kind, rel) for rel, kind in found.items()}


def _confined(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and "\0" not in rel and not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def remove(run_dir: str | Path, under: str = "", keep: tuple[str, ...] = ()) -> list[Path]:
    """Delete what the manifest lists at or below `under` (relative; '' for everything) but
    `keep`: files and trees first, then folders left empty, deepest first. Returns what went."""
    run_dir = Path(run_dir)
    listed = [
        (kind, rel)
        for kind, rel in entries(run_dir)
        if rel not in keep and (not under or rel == under or rel.startswith(under + "/"))
    ]
    listed.sort(key=lambda entry: (entry[0] == "dir", -entry[1].count("/"), entry[1]))
    gone = [run_dir / rel for kind, rel in listed if _remove_one(run_dir, kind, rel)]
    if gone:
        record(run_dir, *gone, kind="gone")
    return gone


def _remove_one(run_dir: Path, kind: str, rel: str) -> bool:
    *folders, name = rel.split("/")
    try:
        fd = _open_folder(run_dir, folders)
    except OSError as exc:
        if exc.errno in _LEFT_ALONE | {errno.ENOENT}:
            return False  # gone already, or reached only through a link
        raise
    try:
        if kind == "dir":
            os.rmdir(name, dir_fd=fd)
        elif kind == "tree":
            if _is_link(name, fd):
                return False
            shutil.rmtree(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)  # a link is unlinked itself, never followed
    except FileNotFoundError:
        return False  # a peer launcher of a multi-node job removed it a moment ago
    except OSError as exc:
        if exc.errno in _LEFT_ALONE:
            return False
        raise
    finally:
        os.close(fd)
    return True


def _open_folder(run_dir: Path, folders: list[str]) -> int:
    """A descriptor of RUN_DIR/folders..., each step refused if it is a link (ELOOP/ENOTDIR)."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)  # the run dir itself may be a link (runs/latest)
    for folder in folders:
        try:
            child = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd


def _is_link(name: str, fd: int) -> bool:
    return stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode)
