import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from catalogue import Catalogue  # noqa: E402
from helpers import TINY, free_port  # noqa: E402

# matplotlib builds its font cache on first use, running `fc-list`: built here, before the `cli`
# fixture forbids subprocesses, so a clean machine's first in-process `gradmesh report` does
# not trip it (the home folder's cache hid this wherever an earlier run had made one).
import matplotlib.font_manager  # noqa: E402, F401

# The planner's calibrations (`gradmesh plan`, and the prediction every launch makes from a cached
# one) live in the user's cache folder: the suite keeps its own, so a developer's calibrations
# neither change what a run prints nor gain files from the tests.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="gradmesh-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

CHROMIUM = "/usr/bin/chromium"


def _install_chromium(log: list[str]) -> None:
    """Debian's chromium for the dashboard's browser test, installed by the test setup itself."""
    import slurm_cluster

    with slurm_cluster.APT:  # the Slurm tests' install may run beside this one
        _apt_chromium(log)


def _apt_chromium(log: list[str]) -> None:
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        log.append(f"$ {' '.join(cmd)} -> {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
        if result.returncode:
            return


_chromium_log: list[str] = []
_chromium_install = None


def pytest_collection_modifyitems(items):
    """The browser test runs last, so chromium's install overlaps the rest of the suite."""
    items.sort(key=lambda item: "chromium" in getattr(item, "fixturenames", ()))


def pytest_collection_finish(session):
    """Start chromium's install (in the background, overlapping the tests before it) only when
    a selected test needs it: `-m "not browser"` or one test file installs nothing."""
    global _chromium_install
    wanted = any("chromium" in getattr(item, "fixturenames", ()) for item in session.items)
    if wanted and not Path(CHROMIUM).exists() and shutil.which("apt-get"):
        _chromium_install = threading.Thread(target=_install_chromium, args=(_chromium_log,), daemon=True)
        _chromium_install.start()
    import slurm_cluster  # the Slurm tests' daemons, installed the same way, overlapping the tests before them

    if any("slurm" in getattr(item, "fixturenames", ()) for item in session.items):
        slurm_cluster.start_install()


@pytest.fixture(scope="session")
def chromium() -> str:
    if _chromium_install is not None:
        _chromium_install.join(timeout=900)
    if not Path(CHROMIUM).exists():
        pytest.fail(f"the dashboard test needs {CHROMIUM}; installing it failed:\n" + "\n".join(_chromium_log))
    return CHROMIUM


@pytest.fixture(scope="session")
def catalogue(tmp_path_factory) -> Catalogue:
    """Finished training runs shared by every test that only reads them (see catalogue.py)."""
    return Catalogue(tmp_path_factory.mktemp("catalogue"))


@pytest.fixture(autouse=True)
def _catalogued_runs_stay_read_only(request):
    """A test that wrote into a shared run would change what later tests read: fail it here."""
    yield
    if "catalogue" in request.fixturenames:
        changed = request.getfixturevalue("catalogue").changed()
        assert not changed, f"{request.node.nodeid} modified catalogued runs {changed}; copy_run() them first"


class _NoWorkers:
    """Stands in for subprocess.Popen while the CLI runs in-process: bad input must be refused
    before any worker (or agent subprocess) starts, so starting one fails the test."""

    def __init__(self, args, *rest, **kwargs):
        raise AssertionError(f"a process was started before the input was refused: {args}")


@pytest.fixture
def cli(capsys, monkeypatch):
    """`gradmesh.cli.main(argv)` in this process; returns (returncode, stdout, stderr) like
    subprocess.run, without a Python start-up and torch import per call."""
    import gradmesh.cli

    def call(*argv: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        with monkeypatch.context() as patch:
            patch.setattr(subprocess, "Popen", _NoWorkers)
            code = gradmesh.cli.main(list(argv))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out, err)

    return call


STRAGGLER = ["--max-steps", "30", "--global-batch-size", "16", "--set", "train.log_every=2",
             "--inject", "slow:rank=1,factor=2,delay=0.02", "--trace-steps", "3:4", "--check-every", "5", "--tensorboard"]


@pytest.fixture(scope="session")
def straggler_run(tmp_path_factory):
    """A real 2-worker run with rank 1 slowed to half speed; Prometheus scraped while it trains.
    Shared by the monitoring, dashboard and report tests."""
    run_dir = tmp_path_factory.mktemp("straggler-run")
    port = free_port()
    args = ["train", "--nproc", "2", "--run-dir", str(run_dir), "--quiet", *TINY, *STRAGGLER,
            "--prometheus-port", str(port)]
    process = subprocess.Popen([sys.executable, "-m", "gradmesh", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    scraped = ""
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    text = response.read().decode()
                if "gradmesh_step " in text and "gradmesh_step 0.0" not in text:
                    scraped = text
                    break
            except OSError:
                pass
            time.sleep(0.1)
        _, err = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 0, err
    alerts = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "stderr": err, "prometheus": scraped, "alerts": alerts}
