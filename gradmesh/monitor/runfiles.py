"""Reading a run directory while it is being written: the dashboard and the report share this.

Rank 0 appends `metrics.jsonl` in groups while training runs, so a reader can see a half-written
last line; it is left for the next read, never parsed (`gradmesh.files`). A restart drops the
steps it redoes (`rundir.truncate_steps` replaces the file), so the tail reader notices when the
lines it already read have changed and starts over. `summary.json` appears only when a run finishes.
"""

import json
import math
import os
import threading
import tomllib
from pathlib import Path

from gradmesh.files import parse_jsonl

PHASES = ("data", "forward", "backward", "comm", "optimizer", "idle")


def read_summary(run_dir: Path) -> dict | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, ValueError):
        return None  # not finished, or caught while being written
    return summary if isinstance(summary, dict) else None


def read_config(run_dir: Path) -> dict:
    """The few resolved settings worth showing before summary.json exists."""
    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
    except (FileNotFoundError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}
    train = cfg.get("train", {})
    shown = {"strategy": train.get("strategy"), "mesh": train.get("mesh"), "model": cfg.get("model", {}).get("name")}
    return {key: value for key, value in shown.items() if value}


def status(run_dir: Path) -> str:
    if (run_dir / "summary.json").exists():
        return "finished"
    return "running" if (run_dir / "metrics.jsonl").exists() else "waiting"


class MetricsTail:
    """metrics.jsonl read incrementally: each call parses only the bytes appended since the last.

    `generation` goes up whenever the file was replaced or rewritten, so that a client holding
    row indices from before knows to start again from row 0.
    """

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []
        self.generation = 0
        self._offset = 0
        self._last_line = (0, b"")  # (start, bytes) of the last line read, to detect a rewrite
        self._lock = threading.Lock()

    def read(self) -> tuple[int, list[dict]]:
        with self._lock:
            try:
                with open(self.path, "rb") as handle:
                    if not self._still_same(handle):
                        self._reset()
                    handle.seek(self._offset)
                    chunk = handle.read()
            except FileNotFoundError:
                if self._offset:
                    self._reset()
                return self.generation, self.rows
            complete = chunk[: chunk.rfind(b"\n") + 1]
            if complete:
                start = complete.rfind(b"\n", 0, len(complete) - 1) + 1
                self._last_line = (self._offset + start, complete[start:])
                self._offset += len(complete)
                self.rows.extend(parse_jsonl(complete))
            return self.generation, self.rows

    def _still_same(self, handle) -> bool:
        if os.fstat(handle.fileno()).st_size < self._offset:
            return False
        start, line = self._last_line
        handle.seek(start)
        return handle.read(len(line)) == line

    def _reset(self) -> None:
        self.rows, self._offset, self._last_line = [], 0, (0, b"")
        self.generation += 1


def finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def mean_breakdown(rows: list[dict]) -> dict[str, list[float]] | None:
    """Seconds per phase per rank, averaged over the rows that carry a breakdown; None if none do."""
    rows = [r for r in rows if isinstance(r.get("breakdown"), dict)]
    if not rows:
        return None
    ranks = max(len(r["breakdown"].get(p, [])) for r in rows for p in PHASES)
    means = {}
    for phase in PHASES:
        columns = [r["breakdown"].get(phase, []) for r in rows]
        means[phase] = [sum(c[i] for c in columns if i < len(c)) / len(rows) for i in range(ranks)]
    return means
