"""Services: what happens around each step, behind one small interface.

The loop calls every service before a step, after it, when in-place recovery has formed a new
group, and at the end. A service that runs a collective (the metrics gather, checkpoints, the
replica check, evaluation) needs every rank at the same step and says so (`lockstep`). An engine
whose ranks do not step together runs segments of steps and reports each segment's steps to
the services afterwards on every rank; a service makes a segment end where it needs the model
exactly as it is after a step (`wants_all_ranks`). A service may also measure inside the
step's forward pass by giving `around_forward` (the step probe uses the last one given).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gradmesh.engine import StepEngine, StepOutcome
from gradmesh.engine.records import Forward
from gradmesh.files import open_append
from gradmesh.monitor.reporter import StepReporter
from gradmesh.topology import Topology


@dataclass
class RunContext:
    """What services share: where the run is and who this worker is."""

    topology: Topology
    engine: StepEngine
    run_dir: Path | None
    identity: int
    """The rank this worker was started as (kept when in-place recovery renumbers ranks)."""
    quiet: bool = False

    @property
    def is_main(self) -> bool:
        return self.topology.is_main


class Notes(Protocol):
    """What a service that only tells the user something needs of step reporting
    (`gradmesh.loop.reporting.Reporting`): a line shown beside the progress bar."""

    def note(self, text: str) -> None: ...


class StepRows(Notes, Protocol):
    """What a service that settles the gathered step rows (flushes them before a checkpoint or a
    stop, carries them across a regroup) needs of step reporting, besides notes: the reporter. A
    regroup replaces it, so it is read where used, not kept."""

    @property
    def reporter(self) -> StepReporter: ...


def largest(value: float, group) -> float:
    """Collective over `group`: the largest of every rank's `value` (the slowest rank's time)."""
    import torch
    import torch.distributed as dist

    found = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found.item()


class Service:
    lockstep = False
    """True: calls a collective, so every rank must reach the same step."""
    around_forward: Forward | None = None
    """The context each micro-batch's forward pass runs in (`StepProbe.around_forward`), for a
    service that measures there (--balance's memory guard); None: this service does not."""

    def start(self, first_step: int) -> None:
        """After the run directory is prepared and any checkpoint loaded."""

    def regrouping(self) -> None:
        """In-place recovery: this worker's step failed; it waits for the next group."""

    def before_step(self, step: int) -> None:
        pass

    def wants_all_ranks(self, step: int) -> bool:
        """This service needs the model as it is right after `step` (a checkpoint, an evaluation)."""
        return False

    def after_step(self, outcome: StepOutcome, elapsed: float) -> None:
        pass

    def regrouped(self) -> None:
        """In-place recovery formed a new group: rebuild what belonged to the old one."""

    def finish(self) -> None:
        pass


class SampleRecorder(Service):
    """--record-samples: the sample indices this rank consumed, per step."""

    def __init__(self, ctx: RunContext):
        self.ctx, self.file = ctx, None

    def start(self, first_step: int) -> None:
        if self.ctx.run_dir:
            self.file = open_append(self.ctx.run_dir / f"samples-rank{self.ctx.identity}.jsonl", buffering=1)

    def after_step(self, outcome: StepOutcome, elapsed: float) -> None:
        if self.file:
            batch = outcome.batch
            self.file.write(
                json.dumps({"step": outcome.step, "epoch": batch.epoch, "indices": outcome.indices, **outcome.detail})
                + "\n"
            )

    def finish(self) -> None:
        if self.file:
            self.file.close()


class FaultInjection(Service):
    """--inject: kills and hangs before a step, a straggler's delay inside it, divergence after it."""

    def __init__(self, ctx: RunContext, injector, work: Callable[[], float | None] = lambda: None):
        self.ctx, self.injector = ctx, injector
        self.slept = self.own_time = self.previous_sleep = 0.0
        self.work = work
        """This rank's busy time in the last step (its step less the time it waited), where
        measured: a straggler is slower at its own work, so its delay follows its own share
        (--balance), not the whole step it waits in."""

    def before_step(self, step: int) -> None:
        # An engine whose ranks do not step together draws a segment's batches before working on
        # them: its kills and hangs fire when work on the step starts (`reached`).
        self.injector.before_step(step, explicit=self.ctx.engine.lockstep)
        self.slept = 0.0

    def reached(self, step: int) -> None:
        self.injector.reached(step)

    def slow_down(self) -> None:
        """In the forward phase: an injected straggler shows as slow compute."""
        work = self.work()
        own = self.own_time if work is None else max(work - self.previous_sleep, 0.0)
        self.slept += self.injector.slow_down(own)

    def straggle(self, seconds: float) -> None:
        """Before a piece of work like one that took `seconds`: a straggler's delay for it."""
        self.injector.slow_down(seconds)

    def after_step(self, outcome: StepOutcome, elapsed: float) -> None:
        self.injector.after_step(outcome.step, self.ctx.engine.model)
        self.own_time, self.previous_sleep = elapsed - self.slept, self.slept


class WatchdogService(Service):
    """--step-timeout: a heartbeat per phase; evaluation and checkpoints are not steps."""

    def __init__(self, watchdog, membership=None):
        self.watchdog, self.membership, self.step = watchdog, membership, 0
        if membership:
            watchdog.ranks = list(membership.members)

    def before_step(self, step: int) -> None:
        self.step = step
        self.watchdog.beat(step, 0)

    def beat(self, phase: int, micro: int = 0) -> None:
        self.watchdog.beat(self.step, phase, micro)

    def after_step(self, outcome: StepOutcome, elapsed: float) -> None:
        self.watchdog.pause()
        self.watchdog.completed(elapsed)

    def regrouping(self) -> None:
        self.watchdog.regrouping(self.step)

    def regrouped(self) -> None:
        self.watchdog.ranks = list(self.membership.members)

    def finish(self) -> None:
        self.watchdog.stop()
