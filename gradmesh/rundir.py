"""The run directory (contract 6): what a run writes, and starting one afresh.

A folder is gradmesh's only when it carries the marker file `.gradmesh-run` (the run's id),
written first thing into a new or empty folder. A fresh run refuses a non-empty folder without
it, and a gradmesh run that holds results (checkpoints, metrics, weights) unless asked to
`--overwrite` it; starting afresh removes only what the run's manifest lists (gradmesh.manifest),
so a user's files stay wherever they are, and a gradmesh path that is a symlink is refused
rather than followed (contract 9).
"""

import json
import os
import time
import uuid
from pathlib import Path

from gradmesh import files, manifest
from gradmesh.errors import UsageError

RUN_FILES = (
    "metrics.jsonl",
    "summary.json",
    "model.safetensors",
    "vocab.json",
    "pipeline.json",
    "faults.jsonl",
    "alerts.jsonl",
    "trace.json",
    "report.html",
)
RANK_FILE_PATTERNS = ("samples-rank*.jsonl", "stacks-rank*.txt", "steps-rank*.jsonl")
RUN_DIRS = ("checkpoints", "tensorboard", "report")
MARKER = manifest.MARKER
RESTATED = ("config.toml", "prediction.json")
"""Rewritten whole by every launch just before its workers start (which clear again): not a
result, and not removed by a fresh start."""
OWN_PREFIX = ".gradmesh-"
"""gradmesh's own hidden files (the marker, a launcher's write probe): not a user's content."""
DEFAULT_ROOT, LATEST = Path("runs"), "latest"


def is_gradmesh_run(run_dir: str | Path) -> bool:
    return (Path(run_dir) / MARKER).is_file()


def check_fresh(run_dir: str | Path, overwrite: bool) -> None:
    """A fresh run may use this folder: new or empty, or an earlier gradmesh run (one with results
    only under --overwrite). Touches nothing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    refuse_links(run_dir)
    if not is_gradmesh_run(run_dir):
        if any(not entry.name.startswith(OWN_PREFIX) for entry in run_dir.iterdir()):
            raise UsageError(
                f"run dir {str(run_dir)!r} is not empty and holds no gradmesh run (no {MARKER}); "
                "give a new or empty --run-dir (gradmesh never deletes what it did not write)"
            )
        return
    listed = manifest.entries(run_dir)
    results = [
        rel for kind, rel in listed if kind == "file" and rel not in RESTATED
    ]  # a folder left for a user's file is none
    if not overwrite and any(os.path.lexists(run_dir / rel) for rel in results):
        raise UsageError(
            f"run dir {str(run_dir)!r} holds a gradmesh run: --resume continues it, --overwrite replaces it"
        )
    unlisted = [p for p in _run_files(run_dir) if p.relative_to(run_dir).as_posix() not in {rel for _, rel in listed}]
    if unlisted:
        raise UsageError(
            f"run dir {str(run_dir)!r} has {unlisted[0].name}, which its manifest ({manifest.MANIFEST}) "
            "does not list as gradmesh's, and a fresh run would write to it; move it away "
            "(gradmesh deletes only what it recorded writing)"
        )


def _run_files(run_dir: Path) -> list[Path]:
    """What a run writes at the top of its folder, by name (never for deleting: to find clashes)."""
    return [run_dir / name for name in RUN_FILES if os.path.lexists(run_dir / name)] + sorted(
        p for pattern in RANK_FILE_PATTERNS for p in run_dir.glob(pattern)
    )


def refuse_links(run_dir: str | Path) -> None:
    """A folder or file gradmesh writes that is a symlink is refused, never written through."""
    run_dir = Path(run_dir)
    for path in [run_dir / name for name in (*RUN_DIRS, *RESTATED, manifest.MANIFEST)] + _run_files(run_dir):
        if path.is_symlink():
            raise UsageError(
                f"{str(path)!r} in the run dir is a symbolic link (to {os.readlink(path)!r}); gradmesh "
                "never writes or deletes through a link: remove the link or give another --run-dir"
            )


def start_fresh(run_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """Claim the folder for a new run (the marker first) and remove an earlier run's files;
    returns what was removed."""
    run_dir = Path(run_dir)
    check_fresh(run_dir, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_gradmesh_run(run_dir):
        try:
            with open(run_dir / MARKER, "x") as marker:  # exclusive: two launchers never both claim it
                json.dump({"run_id": uuid.uuid4().hex, "created": time.time()}, marker)
        except FileExistsError:
            pass  # a peer launcher of the same multi-node job claimed it a moment ago
        return []
    return clear_previous_run(run_dir)


def new_default_run_dir(root: Path = DEFAULT_ROOT) -> Path:
    """A folder of its own for a run started without --run-dir; `runs/latest` points at it."""
    run_dir = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir.mkdir(parents=True)
    latest = root / LATEST
    if latest.is_symlink() or not latest.exists():  # a real folder of that name is a user's: left alone
        staged = root / f".{LATEST}-{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(run_dir.name)
        os.replace(staged, latest)
    return run_dir


def ensure_writable(run_dir: str | Path) -> Path:
    """The run dir can be written, and not through a link where gradmesh writes (refused first)."""
    run_dir = Path(run_dir)
    refuse_links(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".gradmesh-write-test-{os.getpid()}"  # launchers of several nodes may probe at once
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"run dir {str(run_dir)!r} is not writable ({exc.strerror}); give --run-dir DIR") from None
    return run_dir


def clear_previous_run(run_dir: str | Path) -> list[Path]:
    """Remove an earlier run's results and checkpoints (a fresh start): what its manifest lists,
    and atomic writes a crash cut short; returns what was removed."""
    run_dir = Path(run_dir)
    refuse_links(run_dir)
    old = manifest.remove(run_dir, keep=RESTATED)
    for path in files.abandoned_temporaries(run_dir):
        path.unlink(missing_ok=True)  # a peer launcher of a multi-node job may be removing it too
        old.append(path)
    return old


def truncate_steps(path: Path, last_step: int) -> None:
    """Drop the records of steps after `last_step` from a JSONL file (steps a restart redoes), and
    lines a crash tore. The file is replaced whole: a crash mid-rewrite leaves the old one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    kept = b"".join(line + b"\n" for line, row in files.jsonl_lines(data) if row.get("step", 0) <= last_step)
    if kept != data:
        files.atomic_write(path, kept)
