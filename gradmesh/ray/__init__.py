"""gradmesh on Ray (issue 30, item 3): `gradmesh.ray.train(config, num_workers=N)` and `gradmesh ray`.

    import gradmesh.ray
    summary = gradmesh.ray.train({"model": {"name": "mlp-digits"}, "train": {"max_steps": 200},
                                  "run": {"dir": "/shared/runs/digits"}}, num_workers=4)

Design. Ray places and watches; torch.distributed trains. The driver (this process) runs the
checks `gradmesh train` runs (bad input: one line, exit 2, before anything starts), takes the run
directory's lock and writes its config.toml, as `gradmesh train`'s launcher does; then it asks
Ray for a placement group of one bundle per worker (SPREAD: a node each where the cluster has
them) and starts one actor per bundle (`gradmesh.ray.actor`), which runs that rank's gradmesh
worker as its child, `python -m gradmesh.worker RUN_DIR/config.toml`, with torchrun's variables:
rank 0's node address and a free port there as MASTER_ADDR:MASTER_PORT. So Ray stands where
torch elastic's agent stands under `gradmesh train` (start, watch, restart the worker group), and
the workers, engines and the parity contract are the same; nesting an agent in each actor would
add a second rendezvous and a second restart policy for Ray's placement to fight.

Failures (`gradmesh.ray.driver`): any failure ends the whole group (its actors are killed, and
their workers with them). A lost worker (its actor died: ray.kill, a lost node; its process was
killed; it hung) starts a new group, which resumes from the latest complete checkpoint in the
shared run directory (the restarted workers see the attempt as torch elastic's restart count, the
same resume path as `--recovery restart`), at most `max_failures` times; checkpoints are written
every 10 steps unless `checkpoint.every` says otherwise. A worker's own error (an exception) ends
the job with the end of its stderr (its traceback): running it again would fail again.

Ray's own calls (placing actors, their arguments and results: paths, numbers, exit codes, text)
use Ray's serialisation inside the Ray cluster; gradmesh's traffic stays on torch.distributed.
Without `address`, gradmesh starts a Ray of its own on this machine with every address on
127.0.0.1; a job whose store address is a loopback one serves its store on 127.0.0.1 only.
Ray is an optional extra, imported only here: `pip install 'gradmesh[ray]'`.
"""

import json
import logging
import socket
from pathlib import Path
from typing import Any

from gradmesh import config as configuration
from gradmesh import env
from gradmesh.errors import UsageError
from gradmesh.ray.driver import Shape

LOCAL = "127.0.0.1"
MISSING = "gradmesh ray needs Ray, an optional extra: pip install 'gradmesh[ray]'"

__all__ = ["JobFailed", "train"]


class JobFailed(RuntimeError):
    """A Ray job that did not finish: `code` is the exit code `gradmesh ray` would return."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _on_loopback(address: str | None) -> bool:
    """gradmesh's own Ray, or a cluster whose address is a loopback one: Ray kept on this machine."""
    if not address:
        return True
    host = address.removeprefix("ray://").rpartition(":")[0]
    return host == "localhost" or host.startswith("127.")


def need_ray(address: str | None) -> Any:
    """Ray, imported now (never at gradmesh's import). For a Ray kept on this machine, Ray's own
    switch for that is set first (read at its import): without it Ray swaps 127.0.0.1 for the
    machine's outward address and connects there."""
    env.ray_defaults(loopback=_on_loopback(address))
    try:
        import ray
    except ImportError:
        raise UsageError(MISSING) from None
    return ray


def check_reachable(address: str) -> None:
    """A HOST:PORT with nothing listening is refused now: Ray's own connection retries for minutes."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as err:
        raise UsageError(
            f"--address {address}: nothing answers at {host}:{port} ({err.strerror or err}); start the cluster "
            "with `ray start --head`, or leave --address out for a Ray on this machine"
        ) from None


def connect(ray: Any, address: str | None) -> bool:
    """Join the Ray cluster at `address` ('auto': the one started on this machine with `ray start`),
    or start a Ray of its own on this machine (on 127.0.0.1); whether this call started a session."""
    if ray.is_initialized():  # a caller already connected (a notebook, a test)
        return False
    if address:
        where: dict[str, Any] = {"address": address}
    else:
        # gradmesh passes paths, numbers and text through Ray, no tensors: a small object store will do.
        where = {
            "address": "local",
            "_node_ip_address": LOCAL,
            "include_dashboard": False,
            "object_store_memory": 2**27,
        }
    try:
        ray.init(**where, logging_level=logging.WARNING, log_to_driver=True)
    except (ConnectionError, ValueError, RuntimeError) as err:
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(
            f"--address {address}: no Ray cluster joined there ({said}); start one with `ray start --head`, "
            "give its address (or auto), or leave --address out for a Ray on this machine"
        ) from None
    return True


def train(
    config: "configuration.Config | dict | str | Path",
    *,
    num_workers: int,
    use_gpu: bool = False,
    cpus_per_worker: int = 1,
    max_failures: int = 3,
    address: str | None = None,
) -> dict:
    """Train on `num_workers` Ray actors; the run's summary (summary.json) when it finishes.

    `config`: a `gradmesh.Config`, a dict of its sections (as config.toml holds them) or a TOML
    file's path; its run.dir must be on storage every node shares. Raises UsageError for bad
    input and JobFailed when the job fails."""
    from gradmesh.ray.job import launch

    if isinstance(config, configuration.Config):
        cfg = config
    elif isinstance(config, dict):
        cfg = configuration.build([config])
    else:
        cfg = configuration.build([configuration.load_toml(str(config))])
    shape = Shape(workers=num_workers, cpus=cpus_per_worker, gpu=use_gpu)
    code, message, run_dir = launch(cfg, shape, address, max_failures)
    if code:
        raise JobFailed(message, code)
    return json.loads((run_dir / "summary.json").read_text())
