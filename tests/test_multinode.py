"""torchrun's multi-node options pass through: two 'nodes' (two gradmesh agents) on loopback."""

import os
import socket
import subprocess
import sys
import time

import pytest

from helpers import TINY, rel_l2, weights
from runs import STEPS, ddp_run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def finish(nodes: list[subprocess.Popen], timeout: float) -> str:
    """Wait for every node; a node still running at the timeout is killed. Returns every node's
    stderr, so that a failure shows what each launcher said (one that hangs waits for another)."""
    deadline = time.monotonic() + timeout
    errors = []
    for node, proc in enumerate(nodes):
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err += f"\n[killed after {timeout:.0f} s]"
        errors.append(f"--- node {node} (exit {proc.returncode}):\n{err[-4000:]}")
    return "\n".join(errors)


@pytest.mark.slow  # two launchers and a rendezvous per case; 2-rank parity on one node stays in the fast tier
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_two_nodes_train_like_one_process(catalogue, tmp_path, backend):
    args = [*STEPS, "--optimizer", "sgd"]
    one = ddp_run(catalogue, 1, "sgd")  # the parity reference; its replica checks and records change nothing trained
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node in range(2):
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nnodes", "2", "--nproc", "1",
               "--rdzv-endpoint", endpoint, "--rdzv-id", f"test-{backend}", "--rdzv-backend", backend,
               "--run-dir", str(tmp_path / "two"), "--quiet", *TINY, *args]
        if backend == "static":
            cmd += ["--node-rank", str(node)]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1")))
    errors = finish(nodes, timeout=180)
    assert [proc.returncode for proc in nodes] == [0, 0], errors
    assert rel_l2(weights(tmp_path / "two"), weights(one)) <= 1e-5
