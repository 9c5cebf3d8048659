"""Every environment variable gradmesh reads, in one place.

The launchers (torch elastic, gradmesh's in-place launcher, a plain `python script.py`) talk to
the workers through the environment: rank and world, the job's store, the restart attempt,
in-place recovery's switches. Reading them here, and nowhere else, keeps that contract visible
and lets a test see the whole of it.
"""

import os
import re
from dataclasses import dataclass

from gradmesh.errors import UsageError

OMP_THREADS = re.compile(r"([0-9]{1,6})(?:,[0-9]{1,6})*")


@dataclass(frozen=True)
class Placement:
    """Where the launcher put this worker (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launched() -> bool:
    """Started by a launcher (torchrun, gradmesh train/run), not as a plain script."""
    return "RANK" in os.environ


def placement() -> Placement:
    env = os.environ
    return Placement(
        int(env.get("RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("LOCAL_WORLD_SIZE", 1)),
    )


def default_master(port: int) -> None:
    """A plain `python script.py` is rank 0 of 1 and hosts its own store on loopback."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)


def master() -> tuple[str, int] | None:
    """The job's c10d store (MASTER_ADDR:MASTER_PORT); None outside a launched job."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (host, int(port)) if host and port else None


def restart_count() -> int:
    """torch elastic's attempt number: > 0 when the worker group was restarted after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def uses_agent_store() -> bool:
    """The workers share the elastic agent's store (it outlives restarts)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def collective_timeout() -> float | None:
    """Seconds a collective may wait (set by the in-place launcher); None: torch's default."""
    seconds = os.environ.get("GRADMESH_COLLECTIVE_TIMEOUT")
    return float(seconds) if seconds else None


def set_collective_timeout(seconds: float) -> None:
    """For the workers a launcher starts: collectives wait this long before they fail."""
    os.environ["GRADMESH_COLLECTIVE_TIMEOUT"] = str(seconds)


def omp_threads() -> int | None:
    """The user's OMP_NUM_THREADS (its first level: OpenMP also takes a list, e.g. 4,2); None when
    unset. Anything else ("²", "four", "0") is a UsageError, which the CLI meets before launch."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not text:
        return None
    found = OMP_THREADS.fullmatch(text)  # not str.isdigit(): it takes "²", which int() refuses
    if not found or int(found[1]) < 1:
        raise UsageError(
            f"OMP_NUM_THREADS={text[:40]!r} in the environment: expected a whole number of threads "
            "per worker from 1 to 999999 (e.g. 4), or leave it unset (gradmesh then shares out the cores)"
        )
    return int(found[1])


def set_omp_threads(threads: int) -> None:
    """For the workers a launcher starts (they inherit the environment)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)


def inplace_enabled() -> bool:
    """Started by the in-place recovery launcher."""
    return os.environ.get("GRADMESH_INPLACE") == "1"


def inplace_joining() -> bool:
    """A replacement worker, started after a failure to join the running job."""
    return inplace_enabled() and os.environ.get("GRADMESH_JOIN") == "1"


def environment() -> dict[str, str]:
    """A copy of the whole environment, for a launcher to extend for its workers."""
    return dict(os.environ)


def mark_launcher() -> None:
    """Tell the workers this process is their launcher, whose death they must not outlive."""
    os.environ["GRADMESH_LAUNCHER_PID"] = str(os.getpid())


def launcher_pid() -> int | None:
    text = os.environ.get("GRADMESH_LAUNCHER_PID", "")
    return int(text) if re.fullmatch(r"[0-9]{1,18}", text) else None


def keep_on_interface(interface: str, override: bool = False) -> None:
    """gloo's and NCCL's sockets on `interface` (a one-machine job: loopback; several: the one
    that reaches the others), not on whatever address the host name resolves to; a user's
    choice of interface in the environment wins unless `override`."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if override:
            os.environ[name] = interface
        else:
            os.environ.setdefault(name, interface)


def fresh_store_each_round() -> None:
    """Multi-node: every rendezvous round publishes the workers' store address, so a node that
    joins late finds it (torch's shared rendezvous store skips that after the first round of a
    restarting launcher); a user's own setting wins."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def cache_home() -> str:
    """The user's cache folder (XDG_CACHE_HOME, else ~/.cache): where calibrations are kept."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def hub_offline() -> None:
    """Hugging Face's libraries never reach for the hub: gradmesh builds transformers models from
    their config classes alone (no weights, no tokenizer), on machines that may have no network.
    Set before transformers is first imported (huggingface_hub reads it then); the workers a
    launcher starts inherit it."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


SCHEDULER_LAUNCH = ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT", "RDZV_ID")
"""torchrun reads each of its flags from PET_<FLAG>; Kubeflow Trainer's torch runtime (and the v1
PyTorchJob) hand a pod its place in the job as PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT."""


def scheduler_launch() -> dict[str, str]:
    """The PET_* launch settings a cluster scheduler put in this process's environment."""
    return {name: os.environ[f"PET_{name}"] for name in SCHEDULER_LAUNCH if os.environ.get(f"PET_{name}", "").strip()}


def place_worker(rank: int, world_size: int, master: tuple[str, int], attempt: int) -> None:
    """For the worker a `gradmesh ray` actor starts: torchrun's variables, as torch elastic sets them
    for one worker per node (it is the only one of its actor), and the attempt, which a restarted
    group's workers read as torch elastic's restart count (resume from the latest checkpoint)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        TORCHELASTIC_RESTART_COUNT=str(attempt),
    )
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # no agent: rank 0 serves the job's store


def serve_store_on_loopback(on: bool) -> None:
    """Rank 0 serves the job's store on 127.0.0.1 only (a job on one machine without an agent)."""
    os.environ["GRADMESH_STORE_ON_LOOPBACK"] = "1" if on else "0"


def store_on_loopback() -> bool:
    return os.environ.get("GRADMESH_STORE_ON_LOOPBACK") == "1"


def ray_defaults(loopback: bool) -> None:
    """Before gradmesh imports Ray: no usage statistics sent anywhere (Ray's opt-out); with
    `loopback` (a Ray kept on this machine) every node's address is 127.0.0.1 (the switch Ray sets
    on macOS and Windows, read at its import). A user's own settings win."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if loopback:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
