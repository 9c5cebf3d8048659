"""Ray (issue 30, item 3): `gradmesh ray` and `gradmesh.ray.train` on a real local Ray cluster
(`ray.cluster_utils.Cluster`: a head and a worker node of one CPU each, both on 127.0.0.1, each
with its own raylet): 2 workers, one per node, train the single-process model; an actor killed
from outside after the first checkpoint (rank 0's: it hosts the workers' store) restarts the whole
group, which resumes and ends with the uninterrupted model; bad input is one line and exit 2."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradmesh.errors import UsageError
from gradmesh.fault.checkpoint import complete_checkpoints
from gradmesh.ray import MISSING
from helpers import TINY, free_port, gradmesh, listening_sockets, metrics, rel_l2, weights
from runs import DIGITS, STEPS, ddp_run, digits_run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="the Ray tests need the ray extra: pip install -e '.[ray]'")

LONG = ("--max-steps", "60", "--global-batch-size", "16", "--optimizer", "sgd")
"""The Slurm requeue test's run: its single-process reference is trained once for both."""


@pytest.fixture(scope="module")
def cluster():
    """The address of a 2-node local Ray cluster (tests/ray_cluster.py, in a process of its own)."""
    nodes = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ray_cluster.py")), "2"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = nodes.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), f"the Ray cluster did not start ({nodes.poll()})"
        yield address
    finally:
        nodes.stdin.close()
        try:
            nodes.wait(timeout=60)
        except subprocess.TimeoutExpired:
            nodes.kill()


def _workers(config: Path) -> dict[int, int]:
    """rank -> pid of the gradmesh workers running `config` (their command line names it)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"gradmesh.worker" not in argv or str(config).encode() not in argv:
                continue
            environ = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:  # gone meanwhile
            continue
        found[int(environ[b"RANK"])] = int(proc.name)
    return found


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


API_RUN = """
import json, sys
import gradmesh.ray
summary = gradmesh.ray.train(json.loads(sys.argv[1]), num_workers=2, address=sys.argv[2])
import ray
assert not ray.is_initialized()  # the session it opened, it closed
print(json.dumps(summary))
"""


@pytest.mark.slow
def test_two_workers_on_two_nodes_train_the_single_process_model(cluster, catalogue, tmp_path):
    """Through the Python API (in a process of its own, as Ray's driver)."""
    one = ddp_run(catalogue, 1, "sgd")
    config: dict = {"train": {"max_steps": int(STEPS[1]), "global_batch_size": int(STEPS[3]), "optimizer": "sgd"},
                    "run": {"dir": str(tmp_path / "run"), "quiet": True}}
    for setting in TINY[1::2]:  # TINY's --set KEY=VALUE, as config sections
        key, value = setting.split("=")
        section, name = key.split(".")
        config.setdefault(section, {})[name] = int(value)
    done = subprocess.run([sys.executable, "-c", API_RUN, json.dumps(config), cluster],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["world_size"], summary["steps"]) == (2, int(STEPS[1]))
    assert rel_l2(weights(tmp_path / "run"), weights(one)) <= 1e-5


@pytest.mark.slow
def test_a_killed_actor_restarts_the_group_which_resumes_and_ends_with_the_uninterrupted_model(
        cluster, catalogue, tmp_path):
    one = catalogue.run(1, *LONG)
    run_dir = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, "-m", "gradmesh", "ray", "--address", cluster, "--num-workers", "2",
         "--run-dir", str(run_dir), *TINY, *LONG, "--checkpoint-every", "10", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 120
        while not complete_checkpoints(run_dir) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        actor = _parent(_workers(run_dir / "config.toml")[0])
        os.kill(actor, signal.SIGKILL)  # rank 0's actor, with the store its worker serves
        _, err = driver.communicate(timeout=180)
    finally:
        driver.kill()
    assert driver.returncode == 0, err
    assert "worker rank 0: its Ray actor died" in err, err
    assert "restarting all 2 workers from the latest checkpoint (restart 1 of 3)" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["steps_this_run"] < 60 and summary["world_size"] == 2  # resumed, not started again
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 61))  # every step once
    assert rel_l2(weights(run_dir), weights(one)) <= 1e-5
    assert not _workers(run_dir / "config.toml")  # no worker outlives its actor


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_driver_stops_every_worker_in_one_line(cluster, tmp_path, sig):
    """Ray's driver puts its own SIGTERM handler in place (a stack dump and exit 1) and holds the
    main thread in its C++ wait: gradmesh takes the signals back and waits in short turns."""
    run_dir = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, "-m", "gradmesh", "ray", "--address", cluster, "--num-workers", "2", "--model",
         "mlp-digits", "--max-steps", "100000", "--run-dir", str(run_dir), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_workers(run_dir / "config.toml")) < 2 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert driver.poll() is None and len(_workers(run_dir / "config.toml")) == 2
        driver.send_signal(sig)
        _, err = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 128 + sig, err
    assert f"gradmesh: stopped by {sig.name}; 2 workers stopped, none left running" in err.splitlines(), err
    assert "Traceback" not in err and "SIGTERM received" not in err, err
    assert not _workers(run_dir / "config.toml")  # the actors were killed, their workers with them


@pytest.mark.slow
def test_a_job_waiting_for_room_on_a_busy_cluster_stops_on_sigterm_too(cluster, tmp_path):
    """A second job while the first holds both CPUs: Ray cannot place its group yet, and a
    signal to it meanwhile stops it in one line (it waits for placement in short turns too)."""
    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "gradmesh", "ray", "--address", cluster, "--num-workers", "2", "--model",
             "mlp-digits", "--max-steps", "100000", "--run-dir", str(tmp_path / name), "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start("first")
    try:
        deadline = time.monotonic() + 120
        while len(_workers(tmp_path / "first" / "config.toml")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        second = start("second")
        try:
            time.sleep(10)  # joined the cluster (~2 s) and waiting for its bundles
            assert second.poll() is None and not _workers(tmp_path / "second" / "config.toml")
            second.send_signal(signal.SIGTERM)
            _, err = second.communicate(timeout=30)
        finally:
            second.kill()
        assert second.returncode == 128 + signal.SIGTERM, err
        assert "Traceback" not in err and "gradmesh: stopped by SIGTERM" in err, err
        assert first.poll() is None  # the first job goes on
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM


@pytest.mark.slow
def test_a_worker_stopping_on_its_own_is_not_restarted(cluster, tmp_path):
    """A worker's own end (here: NaN losses under --on-nonfinite stop) is no lost worker: the job
    ends with it, its exit code and rank 0's line, without a restart."""
    done = subprocess.run([sys.executable, "-m", "gradmesh", "ray", "--address", cluster, "--num-workers", "2",
                           "--model", "mlp-digits", "--max-steps", "20", "--inject", "nan:rank=1,step=3",
                           "--run-dir", str(tmp_path / "run"), "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr
    assert "restarting" not in done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("gradmesh: alert at step 3: NaN or infinite loss"), done.stderr


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            children.setdefault(_parent(int(proc.name)), []).append(int(proc.name))
        except (OSError, ValueError):
            continue
    found, todo = [], [root]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


@pytest.mark.slow
def test_a_ray_of_its_own_keeps_every_listener_on_loopback_and_trains_the_single_process_model(catalogue, tmp_path):
    """Without --address: gradmesh's own Ray on this machine (its GCS, raylet, agents, actors) and
    the workers' store and gloo listen on 127.0.0.1 only, sampled while the job runs."""
    one = digits_run(catalogue, 1)
    driver = subprocess.Popen([sys.executable, "-m", "gradmesh", "ray", "--num-workers", "2", *DIGITS,
                               "--run-dir", str(tmp_path / "run"), "--quiet"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, int]] = set()
    while driver.poll() is None:
        seen |= set(listening_sockets(_descendants(driver.pid)))
        time.sleep(0.1)
    assert driver.returncode == 0, driver.stderr.read()
    assert len(seen) >= 3 and {address for address, _ in seen} <= {"127.0.0.1", "::ffff:7f00:1"}, seen
    assert rel_l2(weights(tmp_path / "run"), weights(one)) <= 1e-5


@pytest.mark.slow
def test_a_job_larger_than_the_cluster_is_refused_in_one_line(cluster, tmp_path):
    done = subprocess.run([sys.executable, "-m", "gradmesh", "ray", "--address", cluster,
                           "--num-workers", "4", "--model", "mlp-digits", "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "the workers need 4 CPU but the Ray cluster has 2 CPU" in done.stderr
    assert not any((tmp_path / "r").iterdir())  # nothing written there: the check comes before the run starts


@pytest.mark.parametrize(("args", "message"), [
    (["--num-workers", "0"], "workers and CPUs per worker must be >= 1"),
    (["--num-workers", "2", "--max-failures", "-1"], "failures >= 0"),
    (["--num-workers", "2", "--recovery", "restart"], "use --max-failures K instead of --recovery"),
    (["--num-workers", "2", "--strategy", "auto"], "--strategy auto plans for this machine's hardware"),
    (["--num-workers", "2", "--data", "corpus.txt"], "give an absolute path on storage every node shares"),
    (["--num-workers", "2", "--strategy", "nope"], "--strategy: invalid choice: 'nope'"),
    (["--num-workers", "2", "--nproc", "2"], "unrecognized arguments: --nproc"),
    ([], "the following arguments are required: --num-workers"),
    (["--num-workers", "2", "--address", f"127.0.0.1:{free_port()}"], "nothing answers at 127.0.0.1:"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = gradmesh("ray", "--run-dir", str(tmp_path / "r"), "--model", "mlp-digits", *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "r").exists()


def test_without_the_extra_it_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\nfrom gradmesh.cli import main\n"
            f"sys.exit(main(['ray', '--num-workers', '2', '--run-dir', {str(tmp_path / 'r')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"gradmesh: error: {MISSING}"


def test_the_api_checks_its_arguments_before_ray_starts(tmp_path):
    import gradmesh.ray

    with pytest.raises(UsageError, match="workers and CPUs per worker must be >= 1"):
        gradmesh.ray.train({"run": {"dir": str(tmp_path / "r")}}, num_workers=2, cpus_per_worker=0)
    with pytest.raises(UsageError, match=r"train\.max_steps"):
        gradmesh.ray.train({"train": {"max_steps": 0}}, num_workers=2)
    assert not (tmp_path / "r").exists()
