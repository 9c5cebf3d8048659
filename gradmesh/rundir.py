"""The run directory (DESIGN.md contract 6): what a run writes, and starting one afresh."""

import os
import shutil
from pathlib import Path

from gradmesh.errors import UsageError

RUN_FILES = ("metrics.jsonl", "summary.json", "model.safetensors", "vocab.json", "pipeline.json", "faults.jsonl",
             "alerts.jsonl", "trace.json", "report.html")
RANK_FILE_PATTERNS = ("samples-rank*.jsonl", "stacks-rank*.txt", "steps-rank*.jsonl")
RUN_DIRS = ("checkpoints", "tensorboard", "report")


def ensure_writable(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".gradmesh-write-test-{os.getpid()}"  # launchers of several nodes may probe at once
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"run dir {str(run_dir)!r} is not writable ({exc.strerror}); give --run-dir DIR") from None
    return run_dir


def clear_previous_run(run_dir: str | Path) -> list[Path]:
    """Remove an earlier run's results and checkpoints (a fresh start); returns what was removed."""
    run_dir = Path(run_dir)
    old = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    old += [p for pattern in RANK_FILE_PATTERNS for p in run_dir.glob(pattern)]
    old += [run_dir / name for name in RUN_DIRS if (run_dir / name).exists()]
    for path in old:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return old


def truncate_steps(path: Path, last_step: int) -> None:
    """Drop the records of steps after `last_step` from a JSONL file (steps a restart redoes)."""
    if not path.exists():
        return
    import json

    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))
