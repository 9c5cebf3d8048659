"""The Ray actor behind each rank of `gradmesh ray`: it runs the rank's gradmesh worker as its child
process, `python -m gradmesh.worker RUN_DIR/config.toml`, exactly what `gradmesh train`'s launcher
runs, with torchrun's variables set for it.

Why a child process and not the worker in the actor itself: a worker ends with `os._exit` (process
groups are not torn down at interpreter exit: their destructors were seen to abort), seeds and
configures torch process-wide, and must die with whatever stops its job. As a child it does: the
worker ties itself to its launcher (`gradmesh.lifeline`: the kernel SIGKILLs it when the actor's
process dies, however the actor dies: `ray.kill`, a lost node, the OOM killer), and the actor stays
a small process that reports the worker's exit code and the last lines of its stderr.
"""

import collections
import socket
import subprocess
import sys
import threading
from typing import IO

from gradmesh import env

TAIL_LINES = 30
"""Lines of a worker's stderr the driver shows when the worker fails (its traceback)."""


def _echo(stream: IO[str], tail: collections.deque) -> None:
    """Pass the worker's stderr on (Ray forwards the actor's output to the driver) and keep its end."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line)


def _node_address() -> str:
    """The address Ray knows this node by (127.0.0.1 for a cluster kept on one machine)."""
    import ray

    return ray.util.get_node_ip_address()


def _interface(master_host: str) -> str:
    """This node's interface towards rank 0's node: gloo and NCCL listen there, not on whatever the
    host name resolves to."""
    from gradmesh.launch import network

    return network.interface_for(network.route_source(master_host, 1))


class WorkerActor:
    """One gradmesh worker's place in the cluster. Its methods run one at a time (Ray's default)."""

    def endpoint(self) -> tuple[str, int]:
        """This node's address and a free port there: rank 0's actor is asked, for the job's store."""
        host = _node_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return host, probe.getsockname()[1]

    def run(self, config_path: str, rank: int, world_size: int, master: tuple[str, int], settings: dict) -> dict:
        """Run the rank's worker to its end: its exit code (negative: the signal that killed it),
        this node's address and the last lines of its stderr. `settings`: attempt (0, then each
        restart of the group), threads, collective_timeout (seconds or None)."""
        env.place_worker(rank, world_size, master, settings["attempt"])
        env.set_omp_threads(settings["threads"])
        env.mark_launcher()  # the worker dies with this process
        env.serve_store_on_loopback(master[0].startswith("127."))
        if settings.get("collective_timeout"):
            env.set_collective_timeout(settings["collective_timeout"])
        interface = _interface(master[0])
        if interface:
            env.keep_on_interface(interface)
        tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        worker = subprocess.Popen(
            [sys.executable, "-m", "gradmesh.worker", config_path],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        assert worker.stderr is not None  # a pipe was asked for
        echo = threading.Thread(target=_echo, args=(worker.stderr, tail), daemon=True)
        echo.start()
        code = worker.wait()
        echo.join(timeout=5)
        return {"code": code, "node": _node_address(), "tail": "".join(tail)}
