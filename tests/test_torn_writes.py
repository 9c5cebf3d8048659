"""Torn and partial writes (issue 13, item 3): a crash mid-append leaves a torn JSONL line that
every reader skips; a crash mid-write or mid-rewrite leaves the old file whole. In-process; the
resume past a torn metrics line is in test_resume (it reuses a catalogued run)."""

import json
import os

import pytest

from gradmesh import files, rundir
from gradmesh.fault.inject import Injector
from gradmesh.monitor.runfiles import MetricsTail
from gradmesh.specs import parse_faults

ROWS = [{"step": step, "loss": 4.0 / step} for step in (1, 2, 3, 4)]
TORN = b'{"step": 5, "lo'  # a record cut short by a kill: no closing brace, no newline


def lines(rows) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def leftovers(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(files.TMP_PREFIX)]


def test_metrics_readers_skip_torn_lines_at_the_end_and_in_the_middle(tmp_path):
    # A torn line that later appends were glued onto sits in the middle, unparsable.
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(lines(ROWS[:2]) + TORN + lines(ROWS[2:]) + TORN)
    assert files.read_jsonl(path) == [ROWS[0], ROWS[1], ROWS[3]]
    assert MetricsTail(path).read()[1] == [ROWS[0], ROWS[1], ROWS[3]]


def test_the_fault_log_skips_a_torn_last_line(tmp_path):
    fired = {"fault": "kill:rank=0,step=3", "rank": 0, "step": 3, "time": 0.0}
    (tmp_path / "faults.jsonl").write_bytes(lines([fired]) + TORN)
    injector = Injector(parse_faults("kill:rank=0,step=3;kill:rank=0,step=6"), 0, tmp_path)
    assert [fault.step for fault in injector.faults] == [6]  # the one that fired is not fired again


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples-rank0.jsonl", "steps-rank1.jsonl"])
def test_truncation_on_resume_drops_later_steps_and_torn_lines(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(lines(ROWS) + TORN)
    rundir.truncate_steps(path, 2)
    assert path.read_bytes() == lines(ROWS[:2])  # ends on a newline: the resumed run appends whole lines
    assert not leftovers(tmp_path)


def test_a_crash_mid_truncation_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(lines(ROWS) + TORN)

    def crash(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        rundir.truncate_steps(path, 2)
    assert path.read_bytes() == lines(ROWS) + TORN and not leftovers(tmp_path)


def test_a_file_with_nothing_to_drop_is_not_rewritten(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(lines(ROWS))
    monkeypatch.setattr(os, "replace", lambda *args: pytest.fail("rewrote an intact file"))
    rundir.truncate_steps(path, 4)
    rundir.truncate_steps(tmp_path / "alerts.jsonl", 2)  # a file this run never wrote
    assert path.read_bytes() == lines(ROWS) and not (tmp_path / "alerts.jsonl").exists()


@pytest.mark.parametrize("data", ["new text, é", b"\x00new bytes"])
def test_atomic_write_replaces_the_whole_file(tmp_path, data):
    path = tmp_path / "summary.json"
    path.write_text("old")
    files.atomic_write(path, data)
    assert path.read_bytes() == (data.encode() if isinstance(data, str) else data)
    assert not leftovers(tmp_path)


def test_a_write_that_fails_midway_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old weights")
    with pytest.raises(RuntimeError, match="disk full"):
        with files.replacing(path) as tmp:  # as safetensors' save_file writes it
            tmp.write_bytes(b"half of the new")
            raise RuntimeError("disk full")

    def sync_fails(fd):
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", sync_fails)
    with pytest.raises(OSError, match="I/O error"):
        files.atomic_write(path, b"new weights, written but never synced")
    assert path.read_bytes() == b"old weights" and not leftovers(tmp_path)


def test_a_fresh_start_clears_a_crashed_write_and_counts_it_as_gradmeshs(tmp_path):
    import os
    import subprocess
    import sys

    assert files.TMP_PREFIX.startswith(rundir.OWN_PREFIX)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f"{files.TMP_PREFIX}summary.json-{int(dead.stdout)}-abcd"
    leftover.write_text("half")
    # a live writer's temporary (another node's launcher writing config.toml into a shared run dir)
    in_flight = tmp_path / f"{files.TMP_PREFIX}config.toml-{os.getpid()}-beef"
    in_flight.write_text("being written")
    rundir.check_fresh(tmp_path, overwrite=False)  # nothing but gradmesh's own files: counts as empty
    rundir.start_fresh(tmp_path)  # claims the folder
    assert rundir.start_fresh(tmp_path) == [leftover] and not leftover.exists() and in_flight.exists()


def test_a_record_appended_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    from gradmesh.files import open_append, read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # killed mid-append
    with open_append(path) as handle:
        handle.write('{"step": 2}\n')
    assert [row["step"] for row in read_jsonl(path)] == [1, 2]
    with open_append(tmp_path / "new.jsonl") as handle:  # a new file gets no blank first line
        handle.write('{"step": 1}\n')
    assert (tmp_path / "new.jsonl").read_text() == '{"step": 1}\n'
