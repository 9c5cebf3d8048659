"""The one explicit object describing ranks, devices and the named device mesh.

Built once per worker (`Topology.from_env`), validated, and passed to everything that needs to
know where it runs. There is no module-level process group: `Topology.start` creates the
process group and the mesh and returns them inside the object, and every collective names the
group it runs on (`Topology.group`): "world", a mesh axis, or a side group of its own.
"""

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gradmesh import env, stores
from gradmesh.errors import UsageError
from gradmesh.mesh import DATA_AXES, MESH_AXES


def resolve_device(requested: str) -> str:
    """'auto' becomes cuda where a GPU is present, else cpu."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("launch.device='cuda' but no CUDA device is present; use auto or cpu")
    return requested


def local_device(requested: str) -> torch.device:
    """This worker's device before its process group exists (from LOCAL_RANK)."""
    if resolve_device(requested) == "cuda":
        return torch.device("cuda", env.placement().local_rank)
    return torch.device("cpu")


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def auto_nproc(device_type: str) -> int:
    """Workers per machine when --nproc is not given: one per GPU; on CPU two (one on one core)."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def memory_bytes(device_type: str) -> int | None:
    """Memory one rank's model state can use: the smallest GPU's (each rank has one) or this
    machine's RAM (shared by its ranks); None where the system does not say."""
    if device_type == "cuda":
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # /proc/meminfo's MemTotal
    except (ValueError, OSError):
        return None


def available_bytes(device: torch.device, local_ranks: int) -> int | None:
    """Memory this rank can still take for activations: its GPU's free memory, or this machine's
    available memory (MemAvailable) split among its local ranks; None where the system does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024 // max(local_ranks, 1)
    except (OSError, KeyError, ValueError):
        return None


def threads_per_worker(local_world_size: int) -> int:
    """Share the cores so N local workers do not oversubscribe them; OMP_NUM_THREADS overrides."""
    return env.omp_threads() or max(1, (os.cpu_count() or 1) // local_world_size)


def job_store(timeout: timedelta = timedelta(minutes=30)) -> "dist.TCPStore | None":
    """A new client of the job's c10d store (MASTER_ADDR:MASTER_PORT); None outside a launched job.

    Each user (process group set-up, watchdog thread, membership thread) gets its own client:
    one client is not shared between threads."""
    where = env.master()
    if where is None:
        return None
    return stores.client(where[0], where[1], timeout)


def _attempt_store(generation: int = 0) -> "dist.Store | None":
    """Under torch elastic's agent store, the job's store namespaced by restart attempt.

    The agent keeps one store across restarts, and the workers' process groups publish their
    addresses under the same keys each attempt: a restarted group read its dead predecessors'
    addresses and failed to connect ("Connection refused"). A prefix per attempt keeps them apart.
    None (torch's default env:// rendezvous) outside torch elastic.
    """
    if not env.uses_agent_store():
        return None
    attempt = env.restart_count()
    store = job_store()
    assert store is not None  # the elastic agent that shares its store sets MASTER_ADDR/MASTER_PORT too
    return dist.PrefixStore(f"gradmesh/attempt-{attempt}/generation-{generation}", store)


def _loopback_job_store() -> "dist.TCPStore":
    """A job without torch elastic's agent, on one machine (`gradmesh ray` on one host): rank 0
    serves the job's store on 127.0.0.1 only (torch's env:// rendezvous would listen on every
    interface) and the others join it; every rank hands its store to the process group, so that
    all of them use the same keys."""
    where = env.master()
    assert where is not None  # the actor that sets the switch sets MASTER_ADDR/MASTER_PORT with it
    if env.placement().rank == 0:
        return stores.LoopbackTCPStore(where[0], where[1], is_master=True, wait_for_workers=False)
    joined = job_store()  # the other ranks join it as every worker joins the job's store
    assert joined is not None
    return joined


def _collective_timeout() -> "timedelta | None":
    """In-place recovery bounds how long a collective waits: a gloo collective whose ring
    partner left the broken group (rather than died) blocks until this timeout; then it raises
    and the rank regroups. None: torch's default (30 minutes)."""
    seconds = env.collective_timeout()
    return timedelta(seconds=seconds) if seconds else None


@dataclass
class Topology:
    """Where this worker sits: global and local rank, device, backend and named mesh axes."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device_type: str
    mesh_shape: dict[str, int] = field(default_factory=dict)
    mesh: DeviceMesh | None = None
    retired: list = field(default_factory=list, repr=False)
    side_groups: dict = field(default_factory=dict, repr=False)
    store: "dist.Store | None" = field(default=None, repr=False)
    """A plain script's own store (on loopback); launched workers use their launcher's."""
    role: str = "worker"
    """What this rank does in the job; every rank of a collective strategy is a worker."""

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if not self.mesh_shape:
            self.mesh_shape = {"dp": self.world_size}
        unknown = set(self.mesh_shape) - set(MESH_AXES)
        if unknown:
            raise UsageError(f"unknown mesh axes {sorted(unknown)}; accepted: {', '.join(MESH_AXES)}")
        product = math.prod(self.mesh_shape.values())
        if product != self.world_size:
            raise UsageError(f"mesh {self.mesh_shape} has {product} ranks but the world size is {self.world_size}")

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        return backend_for(self.device_type)

    @property
    def dp_size(self) -> int:
        """Ranks that split each global batch (the data-parallel and sharded axes)."""
        return math.prod(self.mesh_shape.get(axis, 1) for axis in DATA_AXES)

    @property
    def dp_rank(self) -> int:
        """This rank's place along the data axes, from its row-major mesh coordinate."""
        coords, rest = {}, self.rank
        for axis in reversed(self.mesh_shape):
            rest, coords[axis] = divmod(rest, self.mesh_shape[axis])
        index = 0
        for axis in self.mesh_shape:
            if axis in DATA_AXES:
                index = index * self.mesh_shape[axis] + coords[axis]
        return index

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str = "auto", mesh_shape: dict[str, int] | None = None) -> "Topology":
        """Read the torchrun/gradmesh-run environment; a plain `python script.py` is rank 0 of 1."""
        store = None
        if not env.launched():
            store = stores.loopback_store()
            env.default_master(store.port)
        elif env.store_on_loopback():
            store = _loopback_job_store()
        where = env.placement()
        return cls(
            rank=where.rank,
            world_size=where.world_size,
            local_rank=where.local_rank,
            local_world_size=where.local_world_size,
            device_type=resolve_device(device),
            mesh_shape=dict(mesh_shape or {}),
            store=store,
        )

    def start(self, generation: int = 0) -> "Topology":
        """Create the process group and the named device mesh (world size 1 included).

        `generation`: in-place recovery's membership generation a replacement worker joins."""
        torch.set_num_threads(threads_per_worker(self.local_world_size))
        if self.device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
        if not dist.is_initialized():
            dist.init_process_group(
                backend=self.backend,
                rank=self.rank,
                world_size=self.world_size,
                device_id=self.device if self.device_type == "cuda" else None,
                store=self.store or _attempt_store(generation),
                timeout=_collective_timeout(),
            )
        names = tuple(self.mesh_shape)
        self.mesh = init_device_mesh(self.device_type, tuple(self.mesh_shape[n] for n in names), mesh_dim_names=names)
        self.side_groups = {}
        return self

    def group(self, name: str) -> dist.ProcessGroup:
        """A process group by name: "world" (every rank), a mesh axis, or a side group."""
        if name == "world":
            assert dist.group.WORLD is not None  # groups are asked for after `start` made it
            return dist.group.WORLD
        if name in self.mesh_shape:
            assert self.mesh is not None  # made by `start` with the process group
            return self.mesh[name].get_group()
        if name in self.side_groups:
            return self.side_groups[name]
        raise KeyError(
            f"no process group named {name!r}; this topology has world, "
            f"{', '.join(self.mesh_shape)} and {', '.join(self.side_groups) or 'no side groups'}"
        )

    def side_group(self, name: str, waits_on_peers: bool = False) -> dist.ProcessGroup:
        """A gloo group over every rank, kept apart from training's traffic (metrics, checkpoint
        coordination). Collective the first time a name is asked for: every rank asks in the
        same order. gloo takes CPU tensors even where training runs on NCCL.

        `waits_on_peers`: its receives wait for other ranks' work by design (a parameter server's
        wire: a sync worker waits for the slowest share); they keep torch's default timeout and
        the group's own watchdog (the dispatcher) names a hung peer."""
        if name not in self.side_groups:
            # Otherwise the world group's timeout, not torch's 30-minute default for new groups: under
            # in-place recovery a side group's collective (a checkpoint's, the replica check's) whose
            # peer died mid-way must fail within the same bound, or the survivors wait there instead
            # of regrouping.
            timeout = None if waits_on_peers else _collective_timeout()
            self.side_groups[name] = dist.new_group(backend="gloo", timeout=timeout)
        return self.side_groups[name]

    def rejoin(self, rank: int, world_size: int, generation: int) -> "Topology":
        """In-place recovery: leave the current process groups and form one over the new members.

        The old groups are deregistered but kept alive in `retired`: a collective of a group
        that lost a peer may still be blocked in gloo until its timeout, and destroying the
        group's C++ object under it was seen to crash the process."""
        self.retired.append([group for group in dist.distributed_c10d._world.pg_map])
        dist.destroy_process_group()
        axis = next(iter(self.mesh_shape)) if len(self.mesh_shape) == 1 else "dp"  # ddp's dp, ps's ps
        self.rank, self.world_size, self.mesh_shape = rank, world_size, {axis: world_size}
        self.start(generation)
        return self

    def stop(self) -> None:
        if dist.is_initialized():
            # Leave together: a rank that tears down its group while a peer still has work
            # in flight aborts the peer's connection.
            dist.barrier(group=self.group("world"))
            dist.destroy_process_group()
        self.mesh = None
