"""Contract 9: gradmesh never deletes what it did not write (issue 13, item 1).

A run directory gradmesh made carries `.gradmesh-run`; a fresh run refuses a non-empty folder
without it and touches nothing there; an earlier gradmesh run with checkpoints needs --resume
or --overwrite; without --run-dir every run gets a folder of its own under runs/."""

import json
import os
import subprocess
import sys

from catalogue import copy_run
from gradmesh.cli import build_parser
from gradmesh.cli.options import resolve_config
from gradmesh.errors import UsageError
from gradmesh.runlock import LOCK, RunLock
from helpers import TINY, gradmesh, metrics, summary
from runs import half_run
from test_cli_errors import assert_usage_error

SHORT = ["--nproc", "1", "--quiet", "--max-steps", "2", "--global-batch-size", "8", *TINY]


def test_a_folder_gradmesh_did_not_write_is_refused_and_left_untouched(tmp_path, cli):
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "chapter1.tex").write_text("mine")
    (folder / "metrics.jsonl").write_text("not gradmesh's either\n")
    before = {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in folder.iterdir()}
    result = cli("train", "--run-dir", str(folder), *SHORT)
    assert_usage_error(result, str(folder), "not empty", "no .gradmesh-run")
    assert {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in folder.iterdir()} == before


def test_a_gradmesh_run_with_checkpoints_needs_resume_or_overwrite(catalogue, tmp_path, cli):
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    result = cli("train", "--run-dir", str(run), *SHORT)
    assert_usage_error(result, str(run), "--resume", "--overwrite")
    assert (run / "checkpoints" / "step-10").is_dir()


def test_overwrite_replaces_the_runs_files_and_keeps_the_users(catalogue, tmp_path):
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    (run / "notes.txt").write_text("keep me")
    marker = (run / ".gradmesh-run").read_text()
    result = gradmesh("train", "--run-dir", str(run), "--overwrite", *SHORT)
    assert result.returncode == 0, result.stderr
    assert [row["step"] for row in metrics(run)] == [1, 2] and summary(run)["steps"] == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    assert (run / "notes.txt").read_text() == "keep me" and (run / ".gradmesh-run").read_text() == marker
    assert not (run / LOCK).exists()  # released when the run ended


def test_default_runs_get_a_folder_each_and_resume_continues_the_latest(tmp_path, monkeypatch):
    for steps in ("2", "3"):
        result = gradmesh("train", *SHORT, "--max-steps", steps, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if p.name != "latest")
    assert len(runs) == 2 and all((p / ".gradmesh-run").is_file() for p in runs)
    latest = (tmp_path / "runs" / "latest").resolve()
    assert summary(latest)["steps"] == 3 and summary(next(p for p in runs if p != latest))["steps"] == 2
    ids = {json.loads((p / ".gradmesh-run").read_text())["run_id"] for p in runs}
    assert len(ids) == 2
    # --resume without --run-dir continues the newest run, as it was configured (no third run needed)
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config(build_parser().parse_args(["train", "--resume", "--max-steps", "5"]))
    assert (tmp_path / cfg.run.dir).resolve() == latest and cfg.train.global_batch_size == 8


HOLD = "import sys, time; from gradmesh.runlock import RunLock; RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)"


def _holder(run_dir):
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_run_dir_in_use_is_refused_naming_the_holder_and_a_dead_holder_does_not_block(catalogue, tmp_path, cli):
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    before = sorted(p.name for p in run.iterdir())
    holder = _holder(run)
    try:
        for extra in ([], ["--resume"], ["--overwrite"]):
            result = cli("train", "--run-dir", str(run), *SHORT, *extra)
            assert_usage_error(result, str(run), "in use", f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((run / LOCK).read_text())["pid"] == holder.pid  # left behind by a killed holder
    RunLock(run).check()  # ... and it blocks nobody
    with RunLock(run) as lock:
        assert json.loads((run / LOCK).read_text())["pid"] == os.getpid() == json.loads(lock.path.read_text())["pid"]
    assert not (run / LOCK).exists()
    assert sorted(p.name for p in run.iterdir()) == before


def test_launchers_of_one_multi_node_job_share_the_lock_others_do_not(tmp_path):
    with RunLock(tmp_path, job="10.0.0.1:29400/job"):
        assert RunLock(tmp_path, job="10.0.0.1:29400/job").acquire().fd is None  # a peer: holds nothing
        try:
            RunLock(tmp_path, job="10.0.0.1:29400/other").acquire()
        except UsageError as err:
            assert f"pid {os.getpid()}" in str(err)
        else:
            raise AssertionError("a launcher of another job took a held lock")


def test_a_peer_that_finds_the_lock_not_yet_named_waits_for_the_name(tmp_path):
    """The launchers of a multi-node job start together: one may find the lock taken but its file
    still empty (the holder names itself just after flock). It must read again, not refuse."""
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, json, os, sys, time
fd = os.open({str(tmp_path / LOCK)!r}, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(0.5)
os.write(fd, json.dumps({{"pid": os.getpid(), "host": "h", "job": "a:1/job"}}).encode())
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert RunLock(tmp_path, job="a:1/job").acquire().fd is None  # a peer, once the name appears
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)


def test_two_peers_claiming_a_new_folder_at_once_both_go_on(tmp_path, monkeypatch):
    from gradmesh import files, rundir

    rundir.start_fresh(tmp_path / "run")
    monkeypatch.setattr(rundir, "is_gradmesh_run", lambda run_dir: False)  # the peer looked before the marker came
    assert rundir.start_fresh(tmp_path / "run") == []
    monkeypatch.undo()
    files.atomic_write(tmp_path / "run" / "metrics.jsonl", "")
    files.atomic_write(tmp_path / "run" / "summary.json", "{}")
    (tmp_path / "run" / "summary.json").unlink()  # a peer launcher removed it a moment ago
    assert rundir.clear_previous_run(tmp_path / "run") == [tmp_path / "run" / "metrics.jsonl"]
