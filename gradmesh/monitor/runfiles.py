"""Reading a run directory while it is being written: the dashboard and the report share this.

Rank 0 appends `metrics.jsonl` in groups while training runs, so a reader can see a half-written
last line; it is left for the next read, never parsed (`gradmesh.files`). A restart drops the
steps it redoes (`rundir.truncate_steps` replaces the file), so the tail reader notices when the
lines it already read have changed and starts over. `summary.json` appears only when a run finishes.
"""

import json
import math
import os
import stat
import threading
import tomllib
from pathlib import Path

from gradmesh.errors import UsageError
from gradmesh.files import READ_LIMIT, open_regular, parse_jsonl, read_regular

PHASES = ("data", "forward", "backward", "comm", "optimizer", "idle")
INPUTS = ("metrics.jsonl", "alerts.jsonl", "summary.json", "config.toml")
"""What the dashboard and the report read from a run dir."""


def check_inputs(run_dir: Path) -> None:
    """A UsageError (one line) when a file they read is no regular file or too big: read, it would
    block, never end or fill the memory. While serving, such a file is skipped instead."""
    for name in INPUTS:
        try:
            os.close(open_regular(run_dir / name))
        except FileNotFoundError:
            pass


def _text(path: Path) -> str | None:
    """A run file's text; None when absent, not a regular file, too big or not UTF-8."""
    try:
        return read_regular(path).decode()
    except (FileNotFoundError, UsageError, UnicodeDecodeError):
        return None


def read_summary(run_dir: Path) -> dict | None:
    try:
        summary = json.loads(_text(run_dir / "summary.json") or "null")
    except ValueError:
        return None  # not finished, or caught while being written
    return summary if isinstance(summary, dict) else None


def read_config(run_dir: Path) -> dict:
    """The few resolved settings worth showing before summary.json exists."""
    try:
        cfg = tomllib.loads(_text(run_dir / "config.toml") or "")
    except tomllib.TOMLDecodeError:
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
                with open(self.path, "rb", opener=_no_wait) as handle:
                    if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                        raise FileNotFoundError  # a FIFO or /dev/zero (checked at start, swapped in since)
                    if not self._still_same(handle):
                        self._reset()
                    handle.seek(self._offset)
                    chunk = handle.read(READ_LIMIT - self._offset)
            except (FileNotFoundError, IsADirectoryError):
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


def _no_wait(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK)  # opening a FIFO to read would wait for a writer


def finite(values) -> list[float]:
    return [v for v in values if _number(v)]


NUMBERS = (
    "step",
    "loss",
    "time",
    "samples_per_s",
    "imbalance",
    "staleness_max",
    "staleness_mean",
    "episode_return",
    "env_steps",
    "env_steps_per_s",
    "wall_s",
    "final_loss",
    "world_size",
    "steps",
)
NUMBER_LISTS = ("peak_memory_bytes", "model_state_bytes", "actor_env_steps_per_s")


def _number(value) -> bool:
    """A finite JSON number (not a bool; an integer a float can hold)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) < 2**63 if isinstance(value, int) else math.isfinite(value)


def _numbers(value) -> bool:
    return isinstance(value, list) and all(_number(v) for v in value)


def well_typed(record: dict) -> dict:
    """A metrics row or summary without the values of a type no gradmesh run writes there (a string,
    null or list where a number belongs; a breakdown that is no table of number lists): hand-edited
    or foreign files plot what they can, as if those values were absent, instead of failing."""

    def fits(key, value) -> bool:
        if key in NUMBERS:
            return _number(value) and (key != "step" or isinstance(value, int))
        if key in NUMBER_LISTS:
            return _numbers(value)
        return key != "breakdown" or (isinstance(value, dict) and all(map(_numbers, value.values())))

    return {key: value for key, value in record.items() if fits(key, value)}


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
