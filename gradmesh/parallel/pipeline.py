"""Pipeline parallelism on `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B).

The model is cut into contiguous stages of *units* (a table per model: GPT's embedding, each
block, the head). Each stage is a shallow view of the plain model holding only its units, so
parameter names stay those of the plain model and checkpoints reshard to and from every other
strategy. Cuts are chosen from measured costs (`plan/partition.py`): rank 0 times each unit's
forward and backward on one real micro-batch and counts its parameter, gradient, optimizer and
activation bytes; the cut minimising the largest stage share is used by every rank.

The schedules, stages and point-to-point transfers are torch's. gradmesh adds the unit table,
the views, the cost-balanced cut, exact per-sample loss weights (the rank's share is padded to
a fixed multiple of the micro-batch count with weight-0 samples: the library infers shapes once),
and a gradient-norm clip that sums squared norms over the stages.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from gradmesh.errors import UsageError
from gradmesh.mesh import PP_AXIS
from gradmesh.parallel.pipeline_profile import profile_units
from gradmesh.parallel.pipeline_units import CONTAINERS, PIPELINE_UNITS, keep_only, pipeline_units  # noqa: F401
from gradmesh.plan.partition import UnitCost, balanced_cut, cut_at, stage_load
from gradmesh.topology import Topology

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


@dataclass
class PipelineOptions:
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(last stage's output, targets) -> one loss per sample."""
    schedule: str = "1f1b"
    microbatches: int = 4
    split: tuple[str, ...] = ()
    """Manual cut: the units that begin stages 1, 2, ... (empty: balanced from measured costs)."""
    example: tuple | None = None
    """One micro-batch (inputs, targets) on the device, for profiling."""
    optimizer_slots: int = 2
    """Optimizer state tensors per parameter (AdamW 2, SGD with momentum 1)."""


def _clip_over_stages(parameters: list[nn.Parameter], max_norm: float, group) -> None:
    grads = [p.grad for p in parameters if p.grad is not None]
    squared = torch.nn.utils.get_total_norm(grads).pow(2) if grads else torch.zeros(())
    dist.all_reduce(squared, group=group)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, squared.sqrt())


class Pipeline:
    """This rank's stages, the schedule that runs them, and the cut that made them."""

    def __init__(self, model: nn.Module, topology: Topology, options: PipelineOptions):
        assert topology.mesh is not None  # a session's topology has its mesh once started
        mesh = topology.mesh[PP_AXIS]
        self.group, self.pp_rank, pp = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        self.options, self.device = options, topology.device
        self.full = model.to(topology.device)
        self.units = pipeline_units(model)
        per_rank = STAGES_PER_RANK[options.schedule]
        self.n_stages = pp * per_rank
        in_flight = options.microbatches if options.schedule == "gpipe" else min(options.microbatches, self.n_stages)
        costs = self._measured_costs(options, in_flight, topology)
        names = [u[0] for u in self.units]
        self.starts = (
            cut_at(names, options.split, self.n_stages) if options.split else balanced_cut(costs, self.n_stages)
        )
        self.plan = self._describe(costs, pp)
        # Interleaved schedules loop: rank r holds stages r, r + pp, ...
        stage_ids = [self.pp_rank + k * pp for k in range(per_rank)]
        self.stages = [
            PipelineStage(keep_only(self.full, self._names(s)), s, self.n_stages, topology.device, group=self.group)
            for s in stage_ids
        ]
        self.local = keep_only(self.full, set().union(*(self._names(s) for s in stage_ids)))
        register_pipeline(self.local, self)
        self.is_first = any(stage.is_first for stage in self.stages)
        self.is_last = any(stage.is_last for stage in self.stages)
        held = self.stages if per_rank > 1 else self.stages[0]
        # scale_grads=False: the loss below is already weighted per sample (sum, not mean).
        self.schedule = SCHEDULES[options.schedule](held, options.microbatches, loss_fn=self._loss, scale_grads=False)

    def _measured_costs(self, options: PipelineOptions, in_flight: int, topology: Topology) -> list[UnitCost]:
        """Rank 0 profiles; every rank receives the same figures, so every rank cuts alike."""
        figures = torch.zeros(len(self.units), 2, dtype=torch.float64, device=topology.device)
        if topology.is_main:
            with torch.random.fork_rng(devices=[]):  # rank 0 alone must not move the shared RNG
                assert options.example is not None  # rank 0 profiles on the example it was given
                costs = profile_units(
                    self.full, self.units, options.example, options.criterion, options.optimizer_slots, in_flight
                )
            figures.copy_(torch.tensor([[c.seconds, c.bytes] for c in costs], dtype=torch.float64))
        dist.broadcast(figures, src=0, group=topology.group("world"))
        return [UnitCost(names[0], s, b) for names, (s, b) in zip(self.units, figures.tolist())]

    def _names(self, stage: int) -> set[str]:
        bounds = self.starts + [len(self.units)]
        return {name for unit in self.units[bounds[stage] : bounds[stage + 1]] for name in unit}

    def _describe(self, costs: list[UnitCost], pp: int) -> dict:
        bounds = self.starts + [len(self.units)]
        loads = stage_load(costs, self.starts)
        stages = [
            {
                "stage": s,
                "rank": s % pp,
                "units": [c.name for c in costs[a:b]],
                "seconds": sum(c.seconds for c in costs[a:b]),
                "bytes": sum(c.bytes for c in costs[a:b]),
                "load": loads[s],
            }
            for s, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        return {
            "schedule": self.options.schedule,
            "microbatches": self.options.microbatches,
            "cut": "manual" if self.options.split else "balanced",
            "units": [{"name": c.name, "seconds": c.seconds, "bytes": c.bytes} for c in costs],
            "stages": stages,
            "bottleneck": max(loads),
        }

    def _loss(self, output: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The target handed to the schedule is each sample's row in the padded share; the real
        # targets and weights are looked up here, so the library splits one plain tensor.
        return (self.options.criterion(output, self._targets[positions]) * self._weights[positions]).sum()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> float:
        """Forward and backward of one padded share; the real samples' loss sum (last stage)."""
        self._targets, self._weights = targets, weights
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        target = torch.arange(len(weights), device=self.device) if self.is_last else None
        self.schedule.step(*args, target=target, losses=losses if self.is_last else None, return_outputs=False)
        weight = weights.max().item()
        return (torch.stack(losses).sum().item() / weight) if self.is_last and weight else 0.0

    def clip(self, max_norm: float) -> None:
        _clip_over_stages(list(self.local.parameters()), max_norm, self.group)

    def full_model(self) -> nn.Module:
        """Collective over the stage group: the whole model, every stage's part brought up to date."""
        with torch.no_grad():
            for stage in range(self.n_stages):
                owner = dist.get_global_rank(self.group, stage % self.group.size())
                tensors = list(keep_only(self.full, self._names(stage)).state_dict().values())
                flat = _flatten_dense_tensors(tensors)
                dist.broadcast(flat, src=owner, group=self.group)
                for tensor, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    tensor.copy_(value)
        return self.full


def apply_pipeline(model: nn.Module, topology: Topology, options) -> nn.Module:
    """This rank's part of the model (parameters named as in the plain model); `options` is an
    ApplyOptions whose `pipeline` holds the PipelineOptions."""
    if options is None or options.pipeline is None:
        raise UsageError(
            "pipeline parallelism runs through gradmesh.Trainer(..., criterion=...): "
            "it needs the loss split from the model as criterion(output, target)"
        )
    return Pipeline(model, topology, options.pipeline).local


_PIPELINE_ATTRIBUTE = "gradmesh_pipeline"


def register_pipeline(stage_module: nn.Module, pipeline: Pipeline) -> None:
    """Record on `stage_module` (what `apply_pipeline` returns) the Pipeline that made it, for
    `pipeline_of`. A plain attribute, not a module-keyed registry: it lives and dies with the
    module (in-place recovery drops old stages), and nn.Module keeps non-module attributes out
    of its children and its state dict."""
    setattr(stage_module, _PIPELINE_ATTRIBUTE, pipeline)


def pipeline_of(stage_module: nn.Module) -> Pipeline:
    """The Pipeline that made this stage module (`register_pipeline`)."""
    found = getattr(stage_module, _PIPELINE_ATTRIBUTE)
    assert isinstance(found, Pipeline)
    return found


def check_pipeline(
    model: nn.Module,
    *,
    schedule: str,
    microbatches: int,
    split: tuple[str, ...],
    pp: int,
    local_batch: int,
    grad_accum: int,
) -> None:
    """Before launch (on a meta-device model): the cut and the schedule can work."""
    units = [u[0] for u in pipeline_units(model)]
    per_rank = STAGES_PER_RANK[schedule]
    stages = pp * per_rank
    if stages > len(units):
        how = f"pp={pp} x {per_rank} stages per rank ({schedule})" if per_rank > 1 else f"pp={pp}"
        raise UsageError(
            f"a pipeline of {stages} stages ({how}) needs at least {stages} layers to cut, but the "
            f"model has {len(units)} ({', '.join(units)}); use pp <= {len(units) // per_rank}"
        )
    _check_microbatches(schedule, microbatches, stages, pp, local_batch)
    if grad_accum != 1:
        raise UsageError(
            "--grad-accum must be 1 with pipeline parallelism: the pipeline cuts each batch into --microbatches instead"
        )
    if split:
        try:
            cut_at(units, split, stages)
        except ValueError as err:
            raise UsageError(f"--pp-split: {err}") from None


def _check_microbatches(schedule: str, microbatches: int, stages: int, pp: int, local_batch: int) -> None:
    if schedule in ("1f1b",) and microbatches < stages:
        raise UsageError(
            f"--microbatches {microbatches} is fewer than the {stages} pipeline stages, which "
            f"{schedule} needs; use --microbatches >= {stages} (or --pp-schedule gpipe)"
        )
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved" and microbatches % rounds:
        raise UsageError(
            f"--microbatches {microbatches} with interleaved at pp={pp} must be a multiple of "
            f"{rounds}; use a multiple of {pp}"
        )
    if microbatches > local_batch:
        raise UsageError(
            f"--microbatches {microbatches} exceeds the {local_batch} samples each pipeline gets per "
            "step (global batch / data-parallel degree); use fewer micro-batches or a larger batch"
        )


def padded_rows(local_batch: int, microbatches: int) -> int:
    """Rows of each rank's share after padding to a whole number of equal micro-batches."""
    return microbatches * -(-local_batch // microbatches)
