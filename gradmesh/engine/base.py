"""The step engine: one optimizer step of one family of strategies, and the state it owns.

An engine is built from a plain model and a plan (`gradmesh.parallel.registry.Plan`): it
applies the plan, builds the optimizer the plan's data axis asks for, and then runs optimizer
steps — forward, backward, gradient communication, optimizer — on the share of each global
batch that falls to its rank. The training loop hands it global batches and hands what it
returns to the services; nothing above the engine knows which strategy runs.

`lockstep` says whether every rank runs the same step at the same moment (collective SPMD
and pipelines do; a parameter-server engine, whose ranks play roles, does not). Services that
need every rank at the same step check it.

Exact weighting: every sample is weighted 1 / (samples in its global batch) times the
data-parallel degree, which the strategy's gradient average divides out again, so the
gradient is exactly the mean over the global batch whatever the world size, the number of
micro-batches, or a short last batch of an epoch.
"""

import dataclasses
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from gradmesh.comm import hooks
from gradmesh.comm.reducer import Reducer
from gradmesh.data import GlobalBatch
from gradmesh.engine import nonfinite
from gradmesh.engine.nonfinite import Finding
from gradmesh.engine.records import (  # noqa: F401
    Job,
    StepOutcome,
    StepProbe,
    clipped_step,
    lr_factor,
    peak_memory_bytes,
    scheduled_lr,
    to_device,
)
from gradmesh.parallel import batchnorm
from gradmesh.parallel.compose import apply_plan, gradient_sync
from gradmesh.parallel.options import DEFAULT_BUCKET_MB, ApplyOptions
from gradmesh.parallel.registry import Plan, load
from gradmesh.parallel.state import model_state_bytes
from gradmesh.topology import Topology


def grouped(model: nn.Module, groups: list[tuple[list[str], dict]] | None) -> list:
    """The applied model's parameters, in the parameter groups `groups` names (by name in the
    plain model, with each group's own settings), or all of them in one group."""
    if not groups:
        return list(model.parameters())
    named = {name.removeprefix("module."): param for name, param in model.named_parameters()}
    found = [{**options, "params": [named[n] for n in names if n in named]} for names, options in groups]
    return [group for group in found if group["params"]]


class StepEngine(Protocol):
    """What the training loop and the services call on an engine, whatever its family. One in
    lockstep is also a `LockstepEngine`, one whose ranks do not step together (`lockstep` False)
    a `SegmentEngine`: the loop and the services call the rest only after checking `lockstep`."""

    lockstep: bool
    plan: Plan
    model: nn.Module
    job: Job

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...
    def rebuild(self, topology: Topology) -> None: ...
    def start(self, run_dir: Path | None, show: bool) -> None: ...
    def checkpoint_state(self, for_load: bool = False) -> dict: ...
    def install_checkpoint(self, payload: dict) -> None: ...
    def eval_model(self) -> nn.Module | None: ...
    def eval_done(self) -> None: ...
    def full_state(self) -> dict[str, torch.Tensor]: ...
    def replica(self) -> nn.Module | None: ...


class LockstepEngine(StepEngine, Protocol):
    """Every rank runs the same step at the same moment (collective and pipeline engines)."""

    def step(self, batch: GlobalBatch, probe: StepProbe) -> StepOutcome: ...
    def abandon_step(self) -> None: ...
    def rebucket(self, bucket_mb: float) -> bool: ...


class SegmentEngine(StepEngine, Protocol):
    """An engine whose ranks do not step together: the loop hands it a segment of global batches
    and the services then see each of its steps (`gradmesh.loop.trainer`, in-place recovery)."""

    def run_segment(self, batches: list[GlobalBatch], probe: StepProbe) -> list[tuple[StepOutcome, float]]: ...
    def work_segment(self, batches: list[GlobalBatch], probe: StepProbe) -> Any: ...
    def report_segment(self, done: Any) -> list[tuple[StepOutcome, float]]: ...


class Engine:
    """The parts every family shares: applying the plan, the optimizer, its step, checkpoints."""

    lockstep = True

    def __init__(self, topology: Topology, plan: Plan, model: nn.Module, job: Job):
        self.topology, self.plan, self.job, self.plain = topology, plan, job, model
        self.options = ApplyOptions(
            reducer=cast(Reducer, job.reducer),  # the Trainer builds every job with its reducer
            bucket_mb=job.train.bucket_mb or DEFAULT_BUCKET_MB,
            counter=job.counter,
            compression=job.train.compression,
            table_sharding=job.train.table_sharding,
            pipeline=self.pipeline_options(model),
        )
        self.model = apply_plan(model, topology, plan, self.options)
        self.norms = batchnorm.layers(model)
        """Synchronised batch norm layers: each forward of theirs is a collective."""
        owner = plan.state_owner
        self.optimizer = load(owner.optimizer)(
            grouped(self.model, job.groups), topology, job.optimizer_class, **job.optimizer_kwargs
        )
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]

    def pipeline_options(self, model: nn.Module):
        return None

    # -- one step ------------------------------------------------------------------------------

    def step(self, batch: GlobalBatch, probe: StepProbe) -> StepOutcome:
        lr = self._set_lr(batch.step)
        loss_sum, counted, indices = self.forward_backward(batch, probe)
        return self.finish_step(batch, lr, (loss_sum, counted, indices), probe)

    def finish_step(
        self,
        batch: GlobalBatch,
        lr: float,
        done: tuple[torch.Tensor, int, list[int]],
        probe: StepProbe,
        max_norm: float | None = None,
    ) -> StepOutcome:
        """After a step's backward passes (`done`: loss sum, samples counted, indices consumed):
        the non-finite check, the clipped optimizer step at `max_norm` (the run's grad_clip by
        default), and the step's figures. The own-loop API calls this from `Loop.step`."""
        loss_sum, counted, indices = done
        with probe.clock.phase("comm"):  # where a collective decides, the ranks wait for each other here
            found = self.find_nonfinite(loss_sum, batch.step + 1)
        if found is not None:  # no rank applies any of it, whatever the policy then does
            return self._unapplied(batch, lr, loss_sum, counted, indices, found)
        with probe.clock.phase("optimizer"):
            clipped_step(self.optimizer, self.clip, self.job.train.grad_clip if max_norm is None else max_norm)
        probe.beat(3)
        # Measured here, where parameters, gradients and optimizer state all exist.
        figures = torch.tensor(
            [0.0, counted, model_state_bytes(self.model, self.optimizer), peak_memory_bytes(self.topology.device)],
            dtype=torch.float64,
        )
        figures[0] = loss_sum.detach().to("cpu", torch.float64)
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(batch, lr, indices, figures)

    def find_nonfinite(self, loss_sum: torch.Tensor, step: int) -> Finding | None:
        """Collective: whether any rank's loss or gradient of this step is NaN or infinite. Where the
        gradient all-reduce carried the verdict (`carry_verdict`), every rank reads the same answer
        from its own reduced gradients, and the collective runs only to name what was found."""
        topo = self.topology
        if hooks.take_verdict(self.model) and nonfinite.locally_finite(self.model, loss_sum):
            return None
        return nonfinite.check(self.model, loss_sum, topo.group("world"), topo.rank, topo.world_size, step)

    def carry_verdict(self, loss_sum: torch.Tensor) -> None:
        """Before the backward that reduces the gradients: hand DDP's hook this rank's loss so far
        (`gradmesh.comm.hooks`), where that all-reduce can carry it to every rank."""
        state = hooks.state_of(self.model)
        if state is not None and self._carried():
            state.poison = loss_sum.detach() * 0

    def _carried(self) -> bool:
        """The gradients are all-reduced over every rank by DDP's hook with a reducer that keeps a
        NaN (the same on every rank: it depends on the plan and options alone)."""
        state = hooks.state_of(self.model)
        return (
            state is not None and state.reducer.carries_nonfinite and self.topology.dp_size == self.topology.world_size
        )

    def _unapplied(
        self, batch: GlobalBatch, lr: float, loss_sum, counted: int, indices: list[int], found: Finding
    ) -> StepOutcome:
        self.optimizer.zero_grad(set_to_none=True)
        figures = torch.tensor(
            [
                float(loss_sum.detach().sum()),
                counted,
                model_state_bytes(self.model, self.optimizer),
                peak_memory_bytes(self.topology.device),
            ],
            dtype=torch.float64,
        )
        return StepOutcome(batch, lr, indices, figures, row={"skipped": "nonfinite"}, nonfinite=found)

    def forward_backward(self, batch: GlobalBatch, probe: StepProbe) -> tuple[torch.Tensor, int, list[int]]:
        """Gradients of this rank's share: (loss sum, samples counted, indices consumed)."""
        raise NotImplementedError

    def abandon_step(self) -> None:
        """A step failed before the optimizer ran: drop its gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def _set_lr(self, step: int) -> float:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = scheduled_lr(base, step, self.job.train)
        return self.optimizer.param_groups[0]["lr"]

    def rebucket(self, bucket_mb: float) -> bool:
        """Wrap the model in DDP again with buckets of `bucket_mb` MiB (--bucket-mb auto's trials);
        False where no DDP buckets the gradients (meshes average one flat buffer)."""
        from torch.nn.parallel import DistributedDataParallel

        from gradmesh.parallel.data import rewrap_ddp

        if not isinstance(self.model, DistributedDataParallel):
            return False
        self.options = dataclasses.replace(self.options, bucket_mb=bucket_mb)
        self.model = rewrap_ddp(self.model, self.topology, self.options)
        return True

    def clip(self, max_norm: float) -> None:
        from gradmesh.parallel.tensor import clip_gradients

        clip_gradients(self.model, max_norm)

    def show_every_share(self, data, everyone: list) -> None:
        """Every data-parallel rank's inputs of the coming micro-batch, this rank's as `data` (the
        plan's `Strategy.every_share`)."""
        everyone[self.topology.dp_rank] = data
        for row in self.plan.rows:
            if row.every_share:
                load(row.every_share)(self.model, everyone, self.topology.dp_rank)

    def sync(self, last_micro_batch: bool):
        return gradient_sync(self.model, self.topology, self.plan, self.options, last_micro_batch)

    @property
    def weight(self) -> float:
        return float(self.topology.dp_size)

    # -- state ---------------------------------------------------------------------------------

    def checkpoint_state(self, for_load: bool = False) -> dict:
        """Model and optimizer state keyed by parameter name (DCP reshards it on load), and the
        reducer's own state per rank where it keeps one (error feedback; on load the checkpoint's
        metadata says what there is: `gradmesh.fault.checkpoint.comm_targets`)."""
        owner = self.plan.state_owner
        payload = {
            "model": get_model_state_dict(self.model),
            "optim": load(owner.optimizer_state)(self.model, self.optimizer, for_load),
        }
        comm = {} if for_load or self.job.reducer is None else self.job.reducer.state_dict()
        if comm:
            payload["comm"] = {f"rank{self.topology.rank}": comm}
        return payload

    def install_checkpoint(self, payload: dict) -> None:
        set_model_state_dict(self.model, payload["model"])
        load(self.plan.state_owner.load_optimizer_state)(self.model, self.optimizer, payload["optim"])
        comm = payload.get("comm", {}).get(f"rank{self.topology.rank}")
        if comm and self.job.reducer is not None:
            self.job.reducer.load_state_dict(comm)

    def eval_model(self) -> nn.Module:
        """Collective: a module that evaluates the whole model on this rank."""
        return self.model

    def eval_done(self) -> None:
        """After `eval_model`'s evaluation (engines whose evaluation other ranks serve release them)."""

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole unsharded model state on CPU, named as in the plain model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], full)

    def replica(self) -> nn.Module | None:
        """The module whose parameters every rank holds identically, when the plan replicates."""
        return getattr(self.model, "module", self.model) if self.plan.replicated else None

    def start(self, run_dir, show: bool) -> None:
        """Before the first step: anything the engine writes to the run directory or shows."""

    def rebuild(self, topology: Topology) -> None:
        """Re-apply the plan over a new group (in-place recovery); weights come from the new rank 0."""
        self.topology.retired.append(self.model)
        self.topology = topology
        self.model = apply_plan(self.plain, topology, self.plan, self.options)
