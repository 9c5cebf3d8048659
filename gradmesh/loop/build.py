"""Assembling a run's monitor, services and step probe from its configuration."""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradmesh.chaos import parse_chaos
from gradmesh.chaos import plan as plan_chaos
from gradmesh.comm import CommCounter
from gradmesh.comm.auto import AutoCompression
from gradmesh.config import CheckpointConfig, FaultConfig, MonitorConfig, TrainConfig
from gradmesh.data import GlobalOrderSampler
from gradmesh.engine import StepProbe
from gradmesh.fault.inject import Injector, parse_faults
from gradmesh.loop.checkpointing import Checkpointing
from gradmesh.loop.nonfinite import NonFinitePolicy
from gradmesh.loop.reporting import Evaluation, ReplicaCheck, Reporting
from gradmesh.loop.services import FaultInjection, RunContext, SampleRecorder, Service, WatchdogService
from gradmesh.monitor.breakdown import NullClock
from gradmesh.monitor.monitor import Monitor
from gradmesh.parallel.registry import Plan

if TYPE_CHECKING:  # imported only under in-place recovery
    from gradmesh.fault.inplace import Membership
    from gradmesh.fault.recovery import InplaceRecovery


@dataclass(frozen=True, kw_only=True)
class RunParts:
    """What a run's services and its end (`gradmesh.loop.finish`) are built from: the parts of
    the trainer they read, so that neither needs the trainer."""

    ctx: RunContext
    train: TrainConfig
    checkpointing: CheckpointConfig
    sampler: GlobalOrderSampler
    monitor: Monitor
    plan: Plan
    membership: "Membership | None"
    run_info: dict
    eval_fn: Callable | None
    auto_compression: object
    """What `gradmesh.comm.compress.reducer_for` chose: an AutoCompression under --compression auto."""


@dataclass
class Services:
    reporting: Reporting
    checkpointing: Checkpointing
    nonfinite: NonFinitePolicy
    faults: FaultInjection
    recovery: "InplaceRecovery | None" = None
    watchdog: WatchdogService | None = None
    all: list[Service] = field(default_factory=list)
    """In calling order."""


def monitor(session, config: MonitorConfig | None, run_dir, plan) -> tuple[Monitor, CommCounter]:
    counter = CommCounter()
    config = config or MonitorConfig()
    if not plan.step_breakdown:  # its ranks do not step together: no per-step phases to compare
        config = dataclasses.replace(config, enabled=False)
    mon = Monitor(
        config, run_dir, session.identity, session.topology.is_main, same_work=plan.same_work, counter=counter
    )
    return mon, counter


def _injector(parts: RunParts, faults: FaultConfig) -> Injector:
    """--inject's faults, a chaos spec's planned ones among them (the same on every worker)."""
    planned, pace = parse_faults(faults.inject), 0.0
    chaos = parse_chaos(faults.inject)
    if chaos:
        planned += plan_chaos(chaos, parts.train.max_steps, parts.checkpointing.every)
        pace = chaos.pace
    ctx = parts.ctx  # its topology is renumbered in place by in-place recovery: read it when asked
    return Injector(
        planned,
        ctx.identity,
        ctx.run_dir,
        pace=pace,
        spare_last=faults.recovery == "inplace",
        position=lambda: (ctx.topology.rank, ctx.topology.world_size),
    )


def _checks(parts: RunParts, reporting: Reporting, checkpointing: Checkpointing) -> list[Service]:
    """The services that look at the model after a step: evaluation, checkpoints, replica checks."""
    ctx, train = parts.ctx, parts.train
    checks: list[Service] = []
    if train.eval_every:
        checks.append(Evaluation(ctx, reporting, parts.eval_fn, train.eval_every, train.max_steps))
    checks.append(checkpointing)
    if parts.monitor.clock is not None:
        every = parts.monitor.config.check_every
        checks.append(ReplicaCheck(ctx, lambda: reporting.reporter.group, parts.monitor, every))
    return checks


def _nonfinite(parts: RunParts, faults: FaultConfig, reporting: Reporting) -> NonFinitePolicy:
    policy = (
        faults.on_nonfinite if parts.ctx.run_dir or faults.on_nonfinite != "rollback" else "stop"
    )  # nothing to go back to
    return NonFinitePolicy(
        parts.ctx, reporting, parts.monitor, policy, faults.max_skips, faults.max_restarts, parts.train
    )


def services(parts: RunParts, faults: FaultConfig) -> Services:
    """Every service of a run; the order of `all` is the order they are called in."""
    ctx, train, membership = parts.ctx, parts.train, parts.membership
    injector = _injector(parts, faults)
    reporting = Reporting(ctx, parts.monitor, train.log_every, train.max_steps, membership)
    nonfinite = _nonfinite(parts, faults, reporting)
    checkpointing = Checkpointing(
        ctx,
        parts.checkpointing,
        parts.sampler,
        reporting,
        parts.monitor,
        parts.run_info,
        nonfinite,
        on_written=injector.at_checkpoint,
        in_place=membership is not None,
    )
    found = Services(reporting, checkpointing, nonfinite, FaultInjection(ctx, injector, lambda: reporting.busy_s))
    if faults.step_timeout != 0 and ctx.engine.lockstep:  # other engines time each share themselves
        from gradmesh.fault.watchdog import Watchdog

        watchdog = Watchdog(faults.step_timeout, ctx.identity, ctx.topology.world_size, ctx.run_dir)
        found.watchdog = WatchdogService(watchdog, membership)
    if membership:
        from gradmesh.fault.recovery import InplaceRecovery

        found.recovery = InplaceRecovery(ctx, membership, parts.sampler, reporting, train.max_steps)
    recorder: list[Service] = [SampleRecorder(ctx)] if train.record_samples else []
    checks = _tuning(parts, reporting, injector) + _checks(parts, reporting, checkpointing)
    first: list[Service | None] = [found.watchdog, found.faults, reporting, nonfinite, found.recovery]
    found.all = [s for s in first if s] + recorder + checks
    if found.recovery:
        found.recovery.services = [s for s in found.all if s is not found.recovery]
    return found


def _tuning(parts: RunParts, reporting: Reporting, injector: Injector) -> list[Service]:
    """What adjusts the run as it goes, from measurements: compression, bucket size, shares."""
    ctx, train = parts.ctx, parts.train
    found: list[Service] = []
    if isinstance(parts.auto_compression, AutoCompression):
        from gradmesh.loop.compression import CompressionChoice

        found.append(CompressionChoice(ctx, reporting, parts.auto_compression, not parts.plan.has_servers))
    if not train.bucket_mb and ctx.engine.lockstep:
        from gradmesh.loop.buckets import BucketTuning

        found.append(BucketTuning(ctx, reporting, train.max_steps))
    if train.balance != "off":
        from gradmesh.loop.balance import Balancing

        found.append(Balancing(ctx, reporting, parts.sampler, train.balance, train.grad_accum, injector.free_memory))
    return found


def probe(mon: Monitor, found: Services) -> StepProbe:
    beat = found.watchdog.beat if found.watchdog else StepProbe().beat
    made = StepProbe(
        mon.clock or NullClock(),
        beat,
        found.faults.slow_down,
        found.faults.straggle,
        found.faults.reached,
        spoil=found.faults.injector.spoil,
    )
    for service in found.all:
        if service.around_forward is not None:  # --balance's memory guard
            made.around_forward = service.around_forward
    return made
