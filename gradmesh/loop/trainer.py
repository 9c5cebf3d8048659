"""The training loop and the public API.

    session = gradmesh.init()                       # process group + topology (any world size)
    trainer = gradmesh.Trainer(session, model, per_sample_loss, dataset, train=TrainConfig(...))
    trainer.fit()                                   # global-order batches, any strategy, checkpoints, metrics

The loss function returns one loss per sample. Pipeline parallelism also needs the loss split
from the model, `criterion(output, target) -> per-sample losses`, with batches (inputs, target).

The loop draws each global batch, hands it to the step engine the strategy registry names, and
hands the outcome to the services (`gradmesh.loop.services`); the engine takes its rank's share
and weights every sample exactly (`gradmesh.engine.base`).
"""

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh import env, rundir
from gradmesh.comm import build_reducer
from gradmesh.comm.compress import reducer_for
from gradmesh.config import CheckpointConfig, FaultConfig, MonitorConfig, PSConfig, TrainConfig
from gradmesh.data import GlobalOrderSampler
from gradmesh.engine import Job, LockstepEngine, SegmentEngine, StepEngine, build_engine, scheduled_lr
from gradmesh.errors import UsageError
from gradmesh.loop import build
from gradmesh.loop.finish import finish_run
from gradmesh.loop.nonfinite import NonFiniteError, RollBack
from gradmesh.loop.services import RunContext, largest
from gradmesh.loop.session import Session, init
from gradmesh.monitor.progress import print_summary
from gradmesh.optim import OptimizerSpec, optimizer_spec
from gradmesh.parallel.registry import resolve

if TYPE_CHECKING:  # imported only under in-place recovery
    from gradmesh.fault.recovery import InplaceRecovery

LossFn = Callable[[nn.Module, object], torch.Tensor]
SEGMENT_STEPS = 50
"""Steps an engine whose ranks do not step together runs between two reports to the services."""


class Trainer:
    """Runs `train.max_steps` optimizer steps of `model` on `dataset` across the session's ranks."""

    def __init__(
        self,
        session: Session,
        model: nn.Module,
        loss_fn: LossFn,
        dataset,
        *,
        train: TrainConfig | None = None,
        checkpointing: CheckpointConfig | None = None,
        optimizer: OptimizerSpec | None = None,
        run_dir: str | Path | None = None,
        eval_fn: Callable[[nn.Module], dict] | None = None,
        quiet: bool = False,
        run_info: dict | None = None,
        criterion: Callable | None = None,
        faults: FaultConfig | None = None,
        monitor: MonitorConfig | None = None,
        ps: PSConfig | None = None,
        groups: list[tuple[list[str], dict]] | None = None,
    ):
        self.session, self.topo = session, session.topology
        self.train = train or TrainConfig()
        self.checkpointing = checkpointing or CheckpointConfig()
        self.run_dir = Path(run_dir) if run_dir else None
        self.eval_fn, self.run_info = eval_fn, run_info or {}
        self.restarted = env.restart_count() > 0
        self.plan = resolve(self.train.strategy, self.topo.mesh_shape)
        self.monitor, self.counter = build.monitor(session, monitor, self.run_dir, self.plan)
        faults = faults or FaultConfig()
        job = self._job(loss_fn, dataset, optimizer, criterion, ps, faults)
        job.groups = groups
        self.engine = build_engine(self.topo, self.plan, model, job)
        self.faults, self.quiet = faults, quiet
        if dataset is not None:
            self.attach(dataset)

    def attach(self, dataset, train: TrainConfig | None = None) -> None:
        """The data and what reads it: the sampler and the services. The Trainer attaches its
        dataset at once; an own loop (`gradmesh.Loop`) when it asks for batches, with the batch size
        and steps it gives only then."""
        if train is not None:
            self.train = self.engine.job.train = train
        self.engine.job.dataset = dataset
        self.sampler = GlobalOrderSampler(len(dataset), self.train.global_batch_size, self.train.seed)
        self.ctx = RunContext(self.topo, self.engine, self.run_dir, self.session.identity, self.quiet)
        self.parts = self._parts()
        self.services = build.services(self.parts, self.faults)
        self.probe = build.probe(self.monitor, self.services)
        # In-place recovery wraps the engine's step and run_segment alike.
        self.stepper: StepEngine | InplaceRecovery = self.services.recovery or self.engine
        if self.session.joined:  # a replacement: the state comes from a live peer
            assert self.services.recovery is not None  # a replacement joins only under in-place recovery
            self.services.recovery.after_regroup([])

    def _job(self, loss_fn: LossFn, dataset, optimizer, criterion, ps, faults: FaultConfig) -> Job:
        """What the engine is built from besides the plan and the model."""
        optimizer_class, kwargs = optimizer or optimizer_spec(self.train)
        self.auto_compression = reducer_for(self.train.compression)
        reducer = build_reducer(self.counter, self.monitor.clock, self.session.membership, self.auto_compression)
        return Job(
            loss_fn=loss_fn,
            dataset=dataset,
            train=self.train,
            optimizer_class=optimizer_class,
            optimizer_kwargs=kwargs,
            criterion=criterion,
            reducer=reducer,
            counter=self.counter,
            ps=ps or PSConfig(),
            membership=self.session.membership,
            step_timeout=faults.step_timeout,
            on_nonfinite=faults.on_nonfinite,
        )

    def _parts(self) -> build.RunParts:
        """What the services and the end of the run read of this trainer."""
        return build.RunParts(
            ctx=self.ctx,
            train=self.train,
            checkpointing=self.checkpointing,
            sampler=self.sampler,
            monitor=self.monitor,
            plan=self.plan,
            membership=self.session.membership,
            run_info=self.run_info,
            eval_fn=self.eval_fn,
            auto_compression=self.auto_compression,
        )

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """None on a parameter server's worker that holds no dense replica."""
        return self.engine.optimizer

    @property
    def history(self) -> list[dict]:
        """The most recent per-step records (as in metrics.jsonl) of this run, up to the last reported
        step: at most `gradmesh.monitor.reporter.RECENT_ROWS`, so that a long run's memory stays flat."""
        return list(self.services.reporting.totals.recent)

    def fit(self) -> dict:
        start_step = self.begin()
        wall_start = time.perf_counter()
        (self._run_in_lockstep if self.engine.lockstep else self._run_in_segments)(start_step)
        return self.end(start_step, time.perf_counter() - wall_start)

    def end(self, start_step: int, wall: float) -> dict:
        """Collective: the services' end, the final evaluation, checkpoint, weights and summary."""
        for service in self.services.all:
            service.finish()
        self.summary, self.final_weights = finish_run(
            self.parts, self.services, start_step, self.samples_before(start_step), wall
        )
        return self.summary

    def _run_in_lockstep(self, start_step: int) -> None:
        step, policy = start_step, self.services.nonfinite
        while step < self.train.max_steps:
            step += 1
            for service in self.services.all:
                service.before_step(step)
            batch = self.sampler.next_global()
            tic = time.perf_counter()
            if step in policy.batches_to_skip:
                lr = scheduled_lr(self.train.lr, batch.step, self.train)
                outcome = policy.skipped_outcome(batch, lr, torch.zeros(4, dtype=torch.float64))
            else:
                outcome = cast(LockstepEngine, self.stepper).step(batch, self.probe)
            elapsed = time.perf_counter() - tic
            try:
                for service in self.services.all:
                    service.after_step(outcome, elapsed)
            except RollBack:
                step = self.roll_back()

    def roll_back(self) -> int:
        """After the non-finite policy's RollBack: the step the last good checkpoint holds."""
        step = self.services.checkpointing.roll_back()
        self.services.reporting.samples = self.samples_before(step)
        self.services.nonfinite.rolled_back(step)
        return step

    def _run_in_segments(self, start_step: int) -> None:
        """An engine whose ranks do not step together runs a segment of steps at a time; the
        services then see every step of it on every rank, so their collectives line up."""
        step = start_step
        while step < self.train.max_steps:
            end = self._segment_end(step)
            batches = []
            for number in range(step + 1, end + 1):
                for service in self.services.all:
                    service.before_step(number)
                batches.append(self.sampler.next_global())
            for outcome, elapsed in cast(SegmentEngine, self.stepper).run_segment(batches, self.probe):
                for service in self.services.all:
                    service.after_step(outcome, elapsed)
            step = end

    def _segment_end(self, step: int) -> int:
        """The next step a service needs every rank at (a checkpoint, an evaluation), the last
        step, or SEGMENT_STEPS on, whichever comes first."""
        last = min(step + SEGMENT_STEPS, self.train.max_steps)
        return next((s for s in range(step + 1, last) if any(x.wants_all_ranks(s) for x in self.services.all)), last)

    def begin(self) -> int:
        """The run directory, the engine's own files, any checkpoint; the step to go on from."""
        joined = self.session.joined
        if not joined:  # a host whose agent was replaced starts at attempt 0 while its peers restarted
            self.restarted = largest(float(self.restarted), self.topo.group("world")) > 0
        if self.run_dir and self.topo.is_main and not joined:
            rundir.ensure_writable(self.run_dir)
            if not (self.checkpointing.resume or self.restarted):
                rundir.start_fresh(self.run_dir)
        self.engine.start(self.run_dir if not joined else None, self.topo.is_main and not self.ctx.quiet)
        if joined:
            start_step = self.sampler.step
        else:
            dist.barrier(group=self.topo.group("world"))
            start_step = self.services.checkpointing.restore(self.restarted)
        self.services.reporting.samples = self.samples_before(start_step)
        for service in self.services.all:
            service.start(start_step)
        return start_step

    def samples_before(self, step: int) -> int:
        """Samples consumed by the first `step` steps (only an epoch's last batch is short)."""
        epochs, rest = divmod(step, self.sampler.batches_per_epoch)
        return epochs * self.sampler.dataset_len + rest * self.train.global_batch_size

    def evaluate(self) -> dict:
        from gradmesh.loop.reporting import evaluate

        return evaluate(self.ctx, self.eval_fn)

    def print_summary(self, sample: str | None = None) -> None:
        if self.topo.is_main and not self.ctx.quiet:
            print_summary(self.summary, sample)


__all__ = ["NonFiniteError", "Session", "Trainer", "UsageError", "init", "optimizer_spec"]
