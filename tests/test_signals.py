"""Signals stop the whole job cleanly; no worker outlives its launcher (issue 13, item 6); a
one-machine job listens on loopback only (item 4).

Each case starts a real job, waits until its workers train (or, for a plain script, say they
are ready), lists the sockets its processes listen on, signals the launcher and then looks in
/proc for the workers it had started."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port, listening_sockets
from test_cli_errors import assert_usage_error

LONG = ["--nproc", "2", "--model", "mlp-digits", "--max-steps", "1000000", "--quiet"]
SCRIPT = """
import sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print("ready", flush=True)
time.sleep(120)
"""


def children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue  # exited while we looked
        if int(fields.get("PPid", "0")) == pid:
            found.append(int(status.parent.name))
    return found


def alive(pids: list[int]) -> list[int]:
    """Still running (a zombie has exited; only its parent's wait is missing)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.append(pid)
    return running


def start(args: list[str], ready, stdout=subprocess.PIPE) -> tuple[subprocess.Popen, list[int]]:
    """The launcher and its workers, once `ready()` says they are working."""
    launcher = subprocess.Popen([sys.executable, "-m", "gradmesh", *args], stdout=stdout,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 60
    while not ready() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = children(launcher.pid)
    assert launcher.poll() is None and len(workers) == 2, launcher.communicate(timeout=30)
    return launcher, workers


def assert_stopped(launcher: subprocess.Popen, workers: list[int], signum: int) -> None:
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signum, err
    # A straggler alert is the monitor's (on sub-millisecond steps a busy neighbour makes one):
    # what a stop prints is one line and nothing else (no traceback, no worker's complaint).
    lines = [line for line in err.strip().splitlines() if not line.startswith("gradmesh: alert at step")]
    assert lines == [f"gradmesh: stopped by {signal.Signals(signum).name}; 2 workers stopped, none left running"], err
    assert not alive(workers)


def assert_loopback_only(launcher: subprocess.Popen, workers: list[int], at_least: int) -> list[tuple[str, int]]:
    """Every listening socket of the job's processes is on 127.0.0.1 (torch's stores would bind `::`)."""
    listening = listening_sockets([launcher.pid, *workers])
    assert len(listening) >= at_least and {address for address, _ in listening} == {"127.0.0.1"}, listening
    return listening


def trains(run_dir: Path):
    return lambda: (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0


def test_sigterm_stops_every_worker_and_the_run_dir_stays_locked_until_then(tmp_path, cli):
    run_dir, prometheus = tmp_path / "run", free_port()
    serving = lambda: trains(run_dir)() and ("127.0.0.1", prometheus) in listening_sockets()  # noqa: E731
    launcher, workers = start(["train", "--run-dir", str(run_dir), "--prometheus-port", str(prometheus), *LONG], serving)
    try:
        # the agent's rendezvous store and the workers' store, gloo's listeners, Prometheus
        assert ("127.0.0.1", prometheus) in assert_loopback_only(launcher, workers, at_least=5)
        assert_usage_error(cli("train", "--run-dir", str(run_dir), "--overwrite", *LONG), "in use", f"pid {launcher.pid}")
        launcher.send_signal(signal.SIGTERM)
        assert_stopped(launcher, workers, signal.SIGTERM)
    finally:
        launcher.kill()
    assert not (run_dir / ".gradmesh-lock").exists()


@pytest.mark.slow  # the torchrun path's stop is covered in the fast tier above
def test_ctrl_c_stops_a_plain_script_under_gradmesh_run(tmp_path):
    script, out = tmp_path / "sleepy.py", tmp_path / "out"
    script.write_text(SCRIPT)
    with open(out, "w") as stdout:
        launcher, workers = start(["run", "--nproc", "2", str(script)], lambda: out.read_text().count("ready") == 2, stdout)
    try:
        launcher.send_signal(signal.SIGINT)
        assert_stopped(launcher, workers, signal.SIGINT)
    finally:
        launcher.kill()


@pytest.mark.slow  # a third real job; the fast tier keeps the SIGTERM case
def test_a_killed_launcher_leaves_no_worker_alive(tmp_path):
    """SIGKILL runs no handler in the launcher: the kernel ends the workers (PR_SET_PDEATHSIG).
    Under --recovery inplace, whose launcher would otherwise replace workers that die."""
    run_dir = tmp_path / "run"
    launcher, workers = start(["train", "--run-dir", str(run_dir), "--recovery", "inplace", *LONG], trains(run_dir))
    assert_loopback_only(launcher, workers, at_least=3)  # the in-place launcher's store, gloo's listeners
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(workers)
