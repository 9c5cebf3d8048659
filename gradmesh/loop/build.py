"""Assembling a run's monitor, services and step probe from its configuration."""

import dataclasses
from dataclasses import dataclass, field

from gradmesh.chaos import parse_chaos
from gradmesh.chaos import plan as plan_chaos
from gradmesh.comm import CommCounter
from gradmesh.comm.auto import AutoCompression
from gradmesh.config import FaultConfig, MonitorConfig
from gradmesh.engine import StepProbe
from gradmesh.fault.inject import Injector, parse_faults
from gradmesh.loop.checkpointing import Checkpointing
from gradmesh.loop.nonfinite import NonFinitePolicy
from gradmesh.loop.reporting import Evaluation, ReplicaCheck, Reporting
from gradmesh.loop.services import FaultInjection, SampleRecorder, Service, WatchdogService
from gradmesh.monitor.breakdown import NullClock
from gradmesh.monitor.monitor import Monitor


@dataclass
class Services:
    reporting: Reporting
    checkpointing: Checkpointing
    nonfinite: NonFinitePolicy
    recovery: Service | None = None
    faults: FaultInjection | None = None
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


def _injector(trainer, faults: FaultConfig) -> Injector:
    """--inject's faults, a chaos spec's planned ones among them (the same on every worker)."""
    planned, pace = parse_faults(faults.inject), 0.0
    chaos = parse_chaos(faults.inject)
    if chaos:
        planned += plan_chaos(chaos, trainer.train.max_steps, trainer.checkpointing.every)
        pace = chaos.pace
    ctx = trainer.ctx  # its topology is renumbered in place by in-place recovery: read it when asked
    return Injector(
        planned,
        trainer.session.identity,
        trainer.run_dir,
        pace=pace,
        spare_last=faults.recovery == "inplace",
        position=lambda: (ctx.topology.rank, ctx.topology.world_size),
    )


def _checks(trainer, reporting: Reporting, checkpointing: Checkpointing) -> list:
    """The services that look at the model after a step: evaluation, checkpoints, replica checks."""
    ctx, train = trainer.ctx, trainer.train
    checks = []
    if train.eval_every:
        checks.append(Evaluation(ctx, reporting, trainer.eval_fn, train.eval_every, train.max_steps))
    checks.append(checkpointing)
    if trainer.monitor.clock is not None:
        checks.append(ReplicaCheck(ctx, reporting, trainer.monitor.config.check_every))
    return checks


def services(trainer, faults: FaultConfig) -> Services:
    """Every service of a run; the order of `all` is the order they are called in."""
    ctx, train, session = trainer.ctx, trainer.train, trainer.session
    injector = _injector(trainer, faults)
    reporting = Reporting(ctx, trainer.monitor, train.log_every, train.max_steps, session.membership)
    checkpointing = Checkpointing(
        ctx,
        trainer.checkpointing,
        trainer.sampler,
        reporting,
        trainer.run_info,
        on_written=injector.at_checkpoint,
        in_place=session.membership is not None,
    )
    policy = (
        faults.on_nonfinite if ctx.run_dir or faults.on_nonfinite != "rollback" else "stop"
    )  # nothing to go back to
    nonfinite = NonFinitePolicy(ctx, reporting, policy, faults.max_skips, faults.max_restarts, train)
    checkpointing.policy = nonfinite
    found = Services(reporting, checkpointing, nonfinite, faults=FaultInjection(ctx, injector))
    found.faults.work = lambda: reporting.busy_s
    if faults.step_timeout != 0 and trainer.engine.lockstep:  # other engines time each share themselves
        from gradmesh.fault.watchdog import Watchdog

        watchdog = Watchdog(faults.step_timeout, session.identity, trainer.topo.world_size, trainer.run_dir)
        found.watchdog = WatchdogService(watchdog, session.membership)
    if session.membership:
        from gradmesh.fault.recovery import InplaceRecovery

        found.recovery = InplaceRecovery(ctx, session.membership, trainer.sampler, reporting, train.max_steps)
    recorder = [SampleRecorder(ctx)] if train.record_samples else []
    checks = _tuning(trainer, reporting, injector) + _checks(trainer, reporting, checkpointing)
    found.all = (
        [s for s in (found.watchdog, found.faults, reporting, nonfinite, found.recovery) if s] + recorder + checks
    )
    if found.recovery:
        found.recovery.services = [s for s in found.all if s is not found.recovery]
    return found


def _tuning(trainer, reporting: Reporting, injector: Injector) -> list[Service]:
    """What adjusts the run as it goes, from measurements: compression, bucket size, shares."""
    ctx, train, found = trainer.ctx, trainer.train, []
    if isinstance(trainer.auto_compression, AutoCompression):
        from gradmesh.loop.compression import CompressionChoice

        found.append(CompressionChoice(ctx, reporting, trainer.auto_compression, trainer.plan.engine != "ps"))
    if not train.bucket_mb and trainer.engine.lockstep:
        from gradmesh.loop.buckets import BucketTuning

        found.append(BucketTuning(ctx, reporting, train.max_steps))
    if train.balance != "off":
        from gradmesh.loop.balance import Balancing

        found.append(Balancing(ctx, reporting, trainer.sampler, train.balance, train.grad_accum, injector.free_memory))
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
        made.around_forward = getattr(service, "around_forward", made.around_forward)  # --balance's memory guard
    return made
