"""Multi-node jobs: two hosts (network namespaces joined through a bridge, `netns.Hosts`), one
gradmesh agent each, train like one process with either rendezvous backend and no interface
flag; where namespaces cannot be made, two agents on loopback stand in."""

import os
import socket
import subprocess
import sys
import time

import pytest

from helpers import TINY, rel_l2, weights
from gradmesh.netns import Hosts
from runs import STEPS, ddp_run

NO_HOSTS = Hosts.unavailable()


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


def node_command(tmp_path, backend: str, endpoint: str, node: int) -> list[str]:
    cmd = [sys.executable, "-m", "gradmesh", "train", "--nnodes", "2", "--nproc", "1",
           "--rdzv-endpoint", endpoint, "--rdzv-id", f"test-{backend}", "--rdzv-backend", backend,
           "--run-dir", str(tmp_path / "two"), "--quiet", *TINY, *STEPS, "--optimizer", "sgd"]
    return cmd + (["--node-rank", str(node)] if backend == "static" else [])


@pytest.mark.slow
@pytest.mark.skipif(not NO_HOSTS, reason="namespace hosts are made here: the lost-host test trains across them")
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_two_nodes_on_loopback_train_like_one_process(catalogue, tmp_path, backend):
    one = ddp_run(catalogue, 1, "sgd")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(node_command(tmp_path, backend, endpoint, node), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
             for node in range(2)]
    errors = finish(nodes, timeout=180)
    assert [proc.returncode for proc in nodes] == [0, 0], errors
    assert rel_l2(weights(tmp_path / "two"), weights(one)) <= 1e-5


@pytest.mark.slow
@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no namespace hosts here ({NO_HOSTS})")
def test_two_namespace_hosts_train_like_one_process_with_the_static_backend(catalogue, tmp_path):
    """Static rendezvous across the hosts, no interface flag: gloo must leave by the interface
    that routes to the endpoint, not by the address the host name resolves to (127.0.0.1).
    (c10d across the hosts is the lost-host test's.)"""
    one = ddp_run(catalogue, 1, "sgd")
    with Hosts(2) as hosts:
        endpoint = f"{hosts.addresses[0]}:29400"
        nodes = [hosts.start(node, node_command(tmp_path, "static", endpoint, node),
                             env=dict(os.environ, PYTHONUNBUFFERED="1")) for node in range(2)]
        errors = finish(nodes, timeout=180)
    assert [proc.returncode for proc in nodes] == [0, 0], errors
    assert rel_l2(weights(tmp_path / "two"), weights(one)) <= 1e-5


@pytest.mark.slow  # two launchers, a lost host, a replacement and a rendezvous round
@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no namespace hosts here ({NO_HOSTS})")
def test_a_host_lost_whole_is_replaced_and_the_job_resumes_exactly(catalogue, tmp_path):
    """Once the step-10 checkpoint is written, every process of host 1 (its launcher, and with it
    its worker) is killed. Host 0's launcher restarts its worker; a new launcher on host 1 (as a
    scheduler would start one, with --resume; at attempt 0 where its peer is at attempt 1) joins
    the rendezvous; both resume from the newest checkpoint and the model equals one process's.
    (Host 0 owns the endpoint and hosts c10d's store: losing that host loses the rendezvous,
    as with torchrun.)"""
    one = ddp_run(catalogue, 1, "sgd")
    extra = ["--recovery", "restart", "--max-restarts", "2", "--checkpoint-every", "5",
             # torch's defaults wait up to 30 s for late nodes and 15 s to call a silent one dead
             "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,close_timeout=5",
             "--inject", "slow:rank=0,factor=10"]  # ~0.1 s steps: time to see the checkpoint and strike
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with Hosts(2) as hosts:
        endpoint = f"{hosts.addresses[0]}:29400"
        command = lambda node: node_command(tmp_path, "c10d", endpoint, node) + extra  # noqa: E731
        nodes = [hosts.start(node, command(node), env=env) for node in range(2)]
        written = tmp_path / "two" / "checkpoints" / "step-10"
        deadline = time.monotonic() + 120
        while not written.exists() and time.monotonic() < deadline and nodes[1].poll() is None:
            time.sleep(0.05)
        assert written.exists() and nodes[1].poll() is None, finish(nodes, timeout=1)
        nodes[1].kill()  # SIGKILL: its worker dies with it (PDEATHSIG)
        nodes[1].communicate()
        nodes[1] = hosts.start(1, command(1) + ["--resume"], env=env)  # the run dir has checkpoints now
        errors = finish(nodes, timeout=180)
    assert [proc.returncode for proc in nodes] == [0, 0], errors
    assert rel_l2(weights(tmp_path / "two"), weights(one)) <= 1e-5
