"""The plans worth predicting for a job: every strategy and mesh the registry allows at this world
size, with the compressions, gradient accumulation, pipeline schedules and parameter-server
settings that change its step time; each checked exactly as `gradmesh train` would check it."""

import dataclasses
import functools
import math
from dataclasses import dataclass

from gradmesh import config as configuration
from gradmesh.errors import UsageError
from gradmesh.mesh import DATA_AXES
from gradmesh.parallel import registry
from gradmesh.parallel.jobs import has_batch_norm, job_plan

MESHES = ("dp={d},tp={t}", "fsdp={d},tp={t}", "dp={d},pp={t}")
"""Two-axis meshes, model-parallel degree t, data-parallel degree d (d x t = world)."""
COMPRESSIONS = ("fp16", "powersgd:rank=4")
"""Besides none: the half-width cast and the low-rank method (bf16 and top-k move the same bytes
or more per step as these)."""
ACCUMULATION = (1, 2)
MICROBATCHES = (4, 8)


@dataclass(frozen=True)
class Candidate:
    strategy: str
    mesh: str = ""
    compression: str = "none"
    grad_accum: int = 1
    microbatches: int = 4
    pp_schedule: str = "1f1b"

    @property
    def label(self) -> str:
        """How a user would ask for it, in flags."""
        parts = [f"--mesh {self.mesh}" if self.mesh else f"--strategy {self.strategy}"]
        if self.compression != "none":
            parts.append(f"--compression {self.compression}")
        if self.grad_accum > 1:
            parts.append(f"--grad-accum {self.grad_accum}")
        if self.microbatches != MICROBATCHES[0]:
            parts.append(f"--microbatches {self.microbatches}")
        return " ".join(parts)

    @classmethod
    def of(cls, cfg: configuration.Config) -> "Candidate":
        """The candidate a configuration runs as."""
        t = cfg.train
        return cls(t.strategy, t.mesh, t.compression, t.grad_accum, t.microbatches, t.pp_schedule)

    def configured(self, cfg: configuration.Config) -> configuration.Config:
        """`cfg` with this candidate's settings."""
        train = dataclasses.replace(
            cfg.train,
            strategy=self.strategy,
            mesh=self.mesh,
            compression=self.compression,
            grad_accum=self.grad_accum,
            microbatches=self.microbatches,
            pp_schedule=self.pp_schedule,
            balance="off",
        )
        # --ps-* options a user gave for a ps plan would refuse every other candidate
        ps = cfg.ps if registry.get(self.strategy).has_servers else type(cfg.ps)()
        return dataclasses.replace(cfg, train=train, ps=ps)


def _shapes(world: int) -> list[Candidate]:
    """Each strategy alone over every rank, then the two-axis meshes at every split."""
    found = [Candidate(row.name) for row in registry.ROWS]
    for t in range(2, world):
        if world % t == 0:
            found += [Candidate("ddp", mesh=m.format(d=world // t, t=t)) for m in MESHES]
    return found


def _variants(base: Candidate, plan: registry.Plan, batch_norm: bool = False) -> list[Candidate]:
    """The settings that change this plan's step time (and not what the model learns: with
    batch normalisation, accumulation would normalise each micro-batch on its own)."""
    found = [base]
    if data_ranks(plan) > 1:  # compression applies to gradients that travel between replicas
        found += [
            dataclasses.replace(base, compression=c) for c in COMPRESSIONS if c.split(":")[0] in plan.compressions
        ]
    if plan.pipelined:  # a pipeline accumulates over its micro-batches instead
        found += [dataclasses.replace(base, microbatches=m) for m in MICROBATCHES if m != base.microbatches]
    elif not batch_norm:
        found += [dataclasses.replace(base, grad_accum=k) for k in ACCUMULATION if k > 1]
    return found


def data_ranks(plan: registry.Plan, servers: int = 1) -> int:
    """Ranks that each take a share of every global batch (a server takes none)."""
    if plan.has_servers:
        return sum(plan.mesh.values()) - servers
    return math.prod(plan.mesh.get(axis, 1) for axis in DATA_AXES)


def candidates(cfg: configuration.Config, nproc: int, world: int) -> tuple[list, list]:
    """([(candidate, plan)] that pass the registry's checks, [(candidate, why not)])."""
    from gradmesh import workloads

    meta_model = functools.cache(lambda: workloads.meta_model(cfg))
    allowed, refused = [], []
    for shape in _shapes(world):
        for candidate in _expand(shape, cfg, nproc, world, meta_model):
            try:
                allowed.append((candidate, job_plan(candidate.configured(cfg), nproc, world, meta_model)))
            except UsageError as err:
                refused.append((candidate, str(err)))
    return allowed, refused


def _expand(shape: Candidate, cfg, nproc: int, world: int, meta_model) -> list[Candidate]:
    try:
        plan = job_plan(shape.configured(cfg), nproc, world, meta_model)
    except UsageError:
        return [shape]  # refused as it stands: reported once, with its reason
    return _variants(shape, plan, has_batch_norm(meta_model()))
