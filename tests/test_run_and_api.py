"""`gradmesh run`: torchrun-compatible scripts, the Python API, and worker crashes."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import gradmesh, rel_l2, weights

EXAMPLE = Path(__file__).parent.parent / "examples" / "train_custom.py"


def test_plain_torch_distributed_script_runs_unchanged(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']}"
              f" sum {value.item():.0f} threads {torch.get_num_threads()} args {' '.join(sys.argv[1:])}")
        dist.destroy_process_group()
    """))
    # The script's own options reach it whole, even one torchrun would take for its own (--nproc).
    result = gradmesh("run", "--nproc", "4", str(script), "hello", "--nproc", "3", "--", "x", timeout=120)
    assert result.returncode == 0, result.stderr
    # Workers share the terminal, so lines may interleave: find each report anywhere.
    found = sorted(re.findall(r"rank \d of \d local \d sum \d+ threads \d+ args hello --nproc 3 -- x", result.stdout))
    assert found == [f"rank {r} of 4 local {r} sum 10 threads 1 args hello --nproc 3 -- x" for r in range(4)]


def test_worker_crash_shows_its_traceback_and_fails_without_hanging(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise RuntimeError("boom on purpose")
        dist.barrier()  # rank 0 waits here for a peer that is gone
    """))
    result = gradmesh("run", "--nproc", "2", str(script), timeout=120)
    assert result.returncode != 0
    assert "RuntimeError: boom on purpose" in result.stderr
    assert "Traceback" in result.stderr and "crash.py" in result.stderr
    assert "worker rank 1" in result.stderr


def test_a_scripts_own_exit_code_is_reported_as_such(tmp_path):
    script = tmp_path / "three.py"  # 3 is also the code gradmesh's step watchdog exits with
    script.write_text("import atexit, sys\natexit.register(lambda: print('atexit ran', flush=True))\nsys.exit(3)\n")
    result = gradmesh("run", "--nproc", "1", str(script), timeout=120)
    assert result.returncode == 1 and "worker rank 0" in result.stderr and "exited with code 3" in result.stderr
    assert "hung" not in result.stderr and "atexit ran" in result.stdout


def test_python_api_example_matches_single_process_with_an_empty_share(tmp_path):
    """33 samples, 8 per step: the last step of each epoch has 1 sample, so one rank's share is
    empty there; SGD exposes any wrong weighting."""
    args = ["--samples", "33", "--global-batch-size", "8", "--grad-accum", "2", "--steps", "12",
            "--optimizer", "sgd"]
    single = subprocess.run([sys.executable, str(EXAMPLE), "--run-dir", str(tmp_path / "one"), *args],
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    double = gradmesh("run", "--nproc", "2", str(EXAMPLE), "--run-dir", str(tmp_path / "two"), *args, timeout=120)
    assert double.returncode == 0, double.stderr
    assert "final loss" in double.stdout
    assert rel_l2(weights(tmp_path / "two"), weights(tmp_path / "one")) <= 1e-5


@pytest.mark.slow  # two more runs; the API's data-parallel case above stays in the fast tier
def test_python_api_with_a_parameter_server_matches_single_process(tmp_path):
    args = ["--samples", "33", "--global-batch-size", "8", "--grad-accum", "2", "--steps", "12", "--optimizer", "sgd"]
    single = subprocess.run([sys.executable, str(EXAMPLE), "--run-dir", str(tmp_path / "one"), *args],
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    served = gradmesh("run", "--nproc", "3", str(EXAMPLE), "--run-dir", str(tmp_path / "ps"), *args,
                      "--strategy", "ps", timeout=120)  # rank 2 the server, two workers
    assert served.returncode == 0, served.stderr
    assert json.loads((tmp_path / "ps" / "summary.json").read_text())["strategy"] == "ps"
    assert rel_l2(weights(tmp_path / "ps"), weights(tmp_path / "one")) <= 1e-5


def test_a_plain_scripts_own_store_listens_on_loopback_only(monkeypatch):
    """`python script.py` with gradmesh's API hosts its store itself: on 127.0.0.1, not on `::`."""
    import os

    from gradmesh.topology import Topology
    from helpers import listening_sockets

    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    topology = Topology.from_env("cpu")
    port = topology.store.port
    assert [address for address, bound in listening_sockets([os.getpid()]) if bound == port] == ["127.0.0.1"]
    assert os.environ["MASTER_PORT"] == str(port)


def test_workers_are_forked_from_the_launcher_only_where_that_is_safe():
    """One thread per worker on CPU: forked (the launcher's imports reused). Several threads (a
    fork of a process whose OpenMP pool has run hangs in its first parallel region), CUDA, or a
    user's script under `gradmesh run`: fresh interpreters, as torchrun starts them."""
    from gradmesh.launch.forked import forkable

    worker = ["-m", "gradmesh.worker", "config.toml"]
    assert forkable("cpu", 1, worker)
    assert not forkable("cpu", 2, worker) and not forkable("cuda", 1, worker)
    assert not forkable("cpu", 1, ["-m", "gradmesh.lifeline", "--", "script.py"])
