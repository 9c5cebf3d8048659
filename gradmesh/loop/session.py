"""`gradmesh.init()`: join the job a launcher started and return its `Session`."""

import torch
import torch.nn as nn

from gradmesh import env
from gradmesh.fault import inplace
from gradmesh.topology import Topology, job_store, resolve_device


class Session:
    """A started topology: what `gradmesh.init()` returns."""

    def __init__(self, topology: Topology, membership: "inplace.Membership | None" = None):
        self.topology = topology
        self.membership = membership
        """In-place recovery's view of the job (None without --recovery inplace)."""

    @property
    def identity(self) -> int:
        """The rank this worker was started as (it keeps it when in-place recovery renumbers ranks)."""
        return self.membership.identity if self.membership else self.topology.rank

    @property
    def joined(self) -> bool:
        """A replacement worker admitted into a running job (its state comes from a live peer)."""
        return bool(self.membership and self.membership.identity in self.membership.newcomers)

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        return self.topology.device

    def prepare(self, model: nn.Module, strategy: str = "ddp") -> nn.Module:
        """Apply a strategy (a registry row, composed on this session's mesh) to a plain model;
        moves it to this rank's device."""
        from gradmesh.comm import CommCounter, build_reducer
        from gradmesh.parallel.compose import apply_plan
        from gradmesh.parallel.options import ApplyOptions
        from gradmesh.parallel.registry import resolve

        plan = resolve(strategy, self.topology.mesh_shape)
        return apply_plan(model, self.topology, plan, ApplyOptions(build_reducer(CommCounter())))

    def close(self) -> None:
        self.topology.stop()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init(device: str = "auto", mesh: dict[str, int] | None = None, seed: int = 0) -> Session:
    """Join the job started by `gradmesh run` / torchrun, or become rank 0 of 1 under plain python.

    Seeds torch with `seed` so a model built next has the same initial weights on every rank
    and at every world size.
    """
    torch.manual_seed(seed)
    if not inplace.enabled():
        return Session(Topology.from_env(device=device, mesh_shape=mesh).start())
    membership = inplace.Membership(job_store(), job_store())
    if not inplace.joining():
        return Session(Topology.from_env(device=device, mesh_shape=mesh).start(), membership)
    while True:  # a replacement worker: wait to be admitted, then form the group with the members
        members = membership.wait_for_admission()
        try:
            membership.gather()
            break
        except inplace.Regroup:
            continue
    where = env.placement()
    topology = Topology(
        rank=members.index(membership.identity),
        world_size=len(members),
        local_rank=where.local_rank,
        local_world_size=where.local_world_size,
        device_type=resolve_device(device),
        mesh_shape={"dp": len(members)},
    )
    return Session(topology.start(membership.generation), membership)
