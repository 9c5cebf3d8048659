"""Step reporting: every rank's figures gathered into metrics.jsonl, the monitor's view of them,
the progress bar, and the replica check and evaluation that share the reporter's group."""

from collections.abc import Callable

import torch
import torch.distributed as dist

from gradmesh.loop.services import Notes, RunContext, Service
from gradmesh.monitor import consistency, trace
from gradmesh.monitor.breakdown import FIGURES
from gradmesh.monitor.monitor import Monitor
from gradmesh.monitor.progress import TrainingProgress
from gradmesh.monitor.reporter import RunTotals, StepRecord, StepReporter


class Reporting(Service):
    lockstep = True

    def __init__(self, ctx: RunContext, monitor: Monitor, log_every: int, max_steps: int, membership=None):
        self.ctx, self.monitor, self.log_every, self.membership = ctx, monitor, log_every, membership
        self.progress = TrainingProgress(max_steps, enabled=ctx.is_main and not ctx.quiet)
        self.samples, self.train_time = 0, 0.0
        self.busy_s: float | None = None
        """This rank's step time less its waiting (the straggler detector's busy time)."""
        self.work_s: float | None = None
        """This rank's work in the last step that grows with its samples (data, forward and
        backward; no waiting, no optimizer step), with monitoring on."""
        self.totals = RunTotals()  # one set across regroups
        self.reporter = self._reporter()

    def _reporter(self) -> StepReporter:
        ctx = self.ctx
        path = ctx.run_dir / "metrics.jsonl" if ctx.run_dir and ctx.is_main else None
        return StepReporter(
            ctx.topology.side_group("metrics"),
            self.log_every,
            path,
            on_record=self._show,
            membership=self.membership,
            on_row=self.monitor.on_row if ctx.is_main else None,
            with_breakdown=self.monitor.clock is not None,
            totals=self.totals,
        )

    def start(self, first_step: int) -> None:
        self.progress.start = first_step
        self.monitor.start()

    def before_step(self, step: int) -> None:
        if self.monitor.clock:
            self.monitor.clock.begin(step)

    def after_step(self, outcome, elapsed: float) -> None:
        step, batch = outcome.step, outcome.batch
        mine = self.monitor.step_figures(step)
        phases = dict(zip(FIGURES, mine))
        self.work_s = phases["data"] + phases["forward"] + phases["backward"] if self.monitor.clock else None
        self.busy_s = phases["step_s"] - phases["comm"] - phases["idle"] if self.monitor.clock else None
        figures = torch.cat([outcome.figures, torch.tensor(mine, dtype=torch.float64)])
        self.train_time += elapsed
        self.samples += batch.size
        split = batch.proportions  # a batch redone after a regroup to fewer ranks was split equally
        row = (
            outcome.row
            if split is None or len(split) != self.ctx.topology.dp_size
            else {**outcome.row, "shares": [round(p, 4) for p in split]}
        )
        self.reporter.add(
            StepRecord(step, batch.epoch, batch.size, self.samples, outcome.lr, elapsed, figures, row=row)
        )

    def _show(self, row: dict) -> None:
        self.progress.update(row["step"], row["loss"], row["samples_per_s"])

    def note(self, text: str) -> None:
        self.progress.note(text)

    def regrouped(self) -> None:
        self.reporter = self._reporter()
        self.progress.enabled = self.ctx.is_main and not self.ctx.quiet

    def finish(self) -> None:
        self.reporter.flush()
        clock, ctx = self.monitor.clock, self.ctx
        if clock and clock.trace_range:
            trace.gather_and_write(
                clock.events,
                ctx.topology.rank,
                ctx.topology.world_size,
                self.reporter.group,
                ctx.run_dir / "trace.json" if ctx.run_dir else None,
            )
        self.progress.close()


class ReplicaCheck(Service):
    """Replicated plans (ddp, zero1) compare parameter checksums; rank 0 reports a divergence."""

    lockstep = True

    def __init__(self, ctx: RunContext, group: Callable[[], dist.ProcessGroup], monitor: Monitor, every: int):
        """group: the reporter's, read when used (a regroup replaces it)."""
        self.ctx, self.group, self.monitor, self.every, self.diverged = ctx, group, monitor, every, False

    def after_step(self, outcome, elapsed: float) -> None:
        module = self.ctx.engine.replica()
        if not self.every or outcome.step % self.every or module is None or self.ctx.topology.world_size < 2:
            return
        found = consistency.compare_replicas(module, self.group(), self.ctx.topology.world_size)
        reported, self.diverged = self.diverged, bool(found)
        if found and self.ctx.is_main and not reported:  # once, until the replicas agree again
            step, ranks = outcome.step, ", ".join(map(str, found["ranks"]))
            self.monitor.alert(
                {
                    "step": step,
                    "kind": "divergence",
                    "rank": found["ranks"][0],
                    "tensor": found["tensor"],
                    "message": f"replicas diverged by step {step}: rank(s) {ranks} differ from the others, "
                    f"first in {found['tensor']!r} ({found['differing_tensors']} tensor(s) differ)",
                }
            )


def evaluate(ctx: RunContext, eval_fn) -> dict:
    """Collective (a pipeline gathers its stages): the eval function on the whole model."""
    if eval_fn is None:
        return {}
    model = ctx.engine.eval_model()
    if model is None:  # this rank serves the others' evaluation (a parameter server's tables)
        return {}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        metrics = eval_fn(model)
    model.train(was_training)
    ctx.engine.eval_done()  # engines whose evaluation others serve release them
    return metrics


class Evaluation(Service):
    """--eval-every: held-out metrics during the run (the last step's come with the summary)."""

    lockstep = True

    def __init__(self, ctx: RunContext, reporting: Notes, eval_fn, every: int, max_steps: int):
        self.ctx, self.reporting, self.eval_fn = ctx, reporting, eval_fn
        self.every, self.max_steps = every, max_steps

    def wants_all_ranks(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step < self.max_steps

    def after_step(self, outcome, elapsed: float) -> None:
        step = outcome.step
        if not self.wants_all_ranks(step):
            return
        metrics = evaluate(self.ctx, self.eval_fn)
        if metrics and self.ctx.is_main:
            self.reporting.note(f"step {step} eval " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
