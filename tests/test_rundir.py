"""Contract 9: gradmesh never deletes what it did not write (issue 13, item 1).

A run directory gradmesh made carries `.gradmesh-run`; a fresh run refuses a non-empty folder
without it and touches nothing there; an earlier gradmesh run with checkpoints needs --resume
or --overwrite; without --run-dir every run gets a folder of its own under runs/."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from catalogue import copy_run
from gradmesh.cli import build_parser
from gradmesh.cli.options import resolve_config
from gradmesh.errors import UsageError
from gradmesh.rundir import RUN_DIRS
from gradmesh.runlock import LOCK, RunLock
from helpers import TINY, gradmesh, metrics, summary
from runs import half_run
from test_cli_errors import assert_usage_error, snapshot

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


USERS = ("notes.txt", "checkpoints/notes.txt", "checkpoints/step-5/mine.txt", "report/figure.png",
         "tensorboard/mine/events.out.tfevents.1.host.1.0")


def test_overwrite_replaces_the_runs_files_and_keeps_the_users(catalogue, tmp_path):
    """Issue 25, item 6: the user's files inside checkpoints/, report/ and tensorboard/ too."""
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    for name in USERS:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("keep me")
    marker = (run / ".gradmesh-run").read_text()
    result = gradmesh("train", "--run-dir", str(run), "--overwrite", *SHORT)
    assert result.returncode == 0, result.stderr
    assert [row["step"] for row in metrics(run)] == [1, 2] and summary(run)["steps"] == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["notes.txt", "step-2", "step-5"]
    assert [p.name for p in (run / "checkpoints" / "step-5").iterdir()] == ["mine.txt"]  # its own files went
    assert all((run / name).read_text() == "keep me" for name in USERS)
    assert (run / ".gradmesh-run").read_text() == marker
    assert not (run / LOCK).exists()  # released when the run ended


def test_a_finished_run_without_its_checkpoints_still_needs_overwrite(catalogue, tmp_path, cli):
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    assert_usage_error(cli("train", "--run-dir", str(run), *SHORT), str(run), "--overwrite")
    assert snapshot(run) == before


@pytest.mark.parametrize("link", RUN_DIRS)
@pytest.mark.parametrize("args", [[*SHORT, "--overwrite"], ["--resume", "--max-steps", "12"]], ids=["overwrite", "resume"])
def test_a_linked_folder_is_refused_and_nothing_is_deleted(catalogue, tmp_path, cli, link, args):
    """Before: --overwrite removed the run's files, then crashed on the link (rmtree refuses one)."""
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    if (run / link).exists():
        (run / link).rename(elsewhere)
    else:
        elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("not gradmesh's")
    (run / link).symlink_to(elsewhere)
    before, outside = snapshot(run), snapshot(elsewhere)
    assert_usage_error(cli("train", "--run-dir", str(run), *args), f"{link}'", "symbolic link")
    assert snapshot(run) == before and snapshot(elsewhere) == outside


def test_report_refuses_a_linked_report_folder(catalogue, tmp_path, cli):
    """Before: it wrote its plots at the link's target, and removed a breakdown.png there."""
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "breakdown.png").write_text("someone else's")
    (run / "report").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    assert_usage_error(cli("report", str(run)), "report'", "symbolic link")
    assert snapshot(elsewhere) == before and not (run / "report.html").exists()


def test_report_removes_only_a_plot_it_wrote(catalogue, tmp_path):
    """A run with no breakdown loses gradmesh's stale breakdown plot, never a user's file of that name."""
    from gradmesh.monitor.report import write_report

    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    write_report(run)
    assert (run / "report" / "breakdown.png").is_file()
    rows = [{k: v for k, v in row.items() if k != "breakdown"} for row in metrics(run)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    write_report(run)
    assert not (run / "report" / "breakdown.png").exists()  # gradmesh's own, stale: gone
    (run / "report" / "breakdown.png").write_text("the user's, made at the path gradmesh once used")
    write_report(run)
    assert (run / "report" / "breakdown.png").read_text().startswith("the user's")


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
