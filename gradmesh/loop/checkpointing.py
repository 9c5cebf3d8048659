"""Checkpoints as a service: written every N steps and at the end, and resumed from at the start."""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from gradmesh import rundir
from gradmesh.config import CheckpointConfig
from gradmesh.data import GlobalOrderSampler
from gradmesh.fault import checkpoint
from gradmesh.loop.nonfinite import NonFinitePolicy
from gradmesh.loop.services import RunContext, Service, StepRows
from gradmesh.monitor.monitor import Monitor


class Checkpointing(Service):
    lockstep = True

    def __init__(
        self,
        ctx: RunContext,
        config: CheckpointConfig,
        sampler: GlobalOrderSampler,
        reporting: StepRows,
        monitor: Monitor,
        run_info: dict,
        policy: NonFinitePolicy,
        on_written=lambda step: None,
        in_place: bool = False,
    ):
        self.ctx, self.config, self.sampler, self.reporting = ctx, config, sampler, reporting
        self.monitor = monitor
        self.run_info, self.on_written = run_info, on_written
        self.in_place = in_place
        """In-place recovery: a worker lost mid-write abandons that checkpoint, not the run."""
        self.policy = policy
        """--on-nonfinite's service: the batches it skips travel in the checkpoint's state."""
        self.checkpointer = self._checkpointer()

    def _checkpointer(self) -> checkpoint.Checkpointer | None:
        ctx = self.ctx
        if not ctx.run_dir:
            return None
        return checkpoint.Checkpointer(
            ctx.run_dir,
            ctx.topology.side_group("checkpoint"),
            ctx.is_main,
            self.config.keep,
            self.config.async_save,
            on_written=self.on_written,
        )

    def regrouped(self) -> None:
        self.checkpointer = self._checkpointer()

    def wants_all_ranks(self, step: int) -> bool:
        return bool(self.config.every) and step % self.config.every == 0

    def after_step(self, outcome, elapsed: float) -> None:
        if self.wants_all_ranks(outcome.step):
            self.save(outcome.step)

    def save(self, step: int) -> None:
        if self.checkpointer is None:
            return
        self.reporting.reporter.flush()  # the metrics of every step the checkpoint covers are on disk with it
        topo = self.ctx.topology
        state = {
            "step": step,
            "sampler": self.sampler.state_dict(),
            "world_size": topo.world_size,
            "strategy": self.ctx.engine.plan.label,
            "run": self.run_info,
            **self.policy.state(),
        }
        with self.monitor.timed("checkpoint", step):  # checkpoint I/O, outside the step's phases
            try:
                self.checkpointer.save(step, self.ctx.engine, state)
            except (RuntimeError, CheckpointException) as err:  # DCP's is a BaseException
                if not self.in_place:
                    raise
                # Never published, so nothing will resume from it; the next step's collectives
                # fail on the same loss and the survivors regroup there.
                cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                self.reporting.note(
                    f"gradmesh: the checkpoint of step {step} was abandoned: a worker was lost "
                    f"while it was written ({cause[:160]})"
                )

    def finish_run(self, max_steps: int, steps_run: int) -> None:
        """The last step is always checkpointed; an async write in flight is published."""
        if self.ctx.run_dir and steps_run and (self.config.every == 0 or max_steps % self.config.every):
            self.save(max_steps)
        if self.checkpointer:
            self.checkpointer.wait()

    def start(self, first_step: int) -> None:
        """--on-nonfinite rollback before the first checkpoint goes back to the initial weights."""
        if self.policy.policy == "rollback" and first_step == 0:
            self.save(0)

    def roll_back(self) -> int:
        """Collective: every rank reloads the newest intact checkpoint; the step it holds."""
        self.reporting.reporter.flush()
        return self.restore(True, keep_alerts=True)

    def restore(self, restarted: bool, keep_alerts: bool = False) -> int:
        """Collective: load the newest intact checkpoint when resuming or restarted; the step it holds."""
        checkpointer, run_dir = self.checkpointer, self.ctx.run_dir
        if not ((self.config.resume or restarted) and checkpointer and run_dir):  # a checkpointer has a run_dir
            return 0
        # Rank 0 verifies checksums and picks the newest intact checkpoint for everyone.
        chosen = torch.tensor([-1], dtype=torch.int64)
        if self.ctx.is_main:
            path = checkpoint.latest_good_checkpoint(run_dir, warn=self.reporting.note)
            chosen[0] = int(path.name.split("-")[1]) if path else -1
        dist.broadcast(chosen, src=0, group=checkpointer.group)
        if chosen.item() < 0 and restarted and not self.config.resume:
            self._forget_steps_after(0, keep_alerts)  # failed before its first checkpoint: start again
            return 0
        if chosen.item() < 0:
            raise checkpoint.CheckpointError(f"--resume: no intact checkpoint under {run_dir / 'checkpoints'}")
        path = checkpoint.checkpoint_root(run_dir) / f"step-{chosen.item()}"
        state = checkpointer.load(path, self.ctx.engine)
        self.sampler.load_state_dict(state["sampler"])
        self.policy.load(state)
        self._forget_steps_after(state["step"], keep_alerts)
        self.reporting.note(
            f"resumed from {path} (step {state['step']}, written by {state.get('strategy')} "
            f"at world size {state.get('world_size')})"
        )
        return state["step"]

    def _forget_steps_after(self, step: int, keep_alerts: bool = False) -> None:
        """Records of steps after the checkpoint go: the resumed run does them again, once (a
        rollback keeps its alerts: they say why the steps are done again)."""
        run_dir, me = self.ctx.run_dir, self.ctx.identity
        if run_dir is None:  # only a run with a run directory restores
            return
        shared = ["metrics.jsonl"] + ([] if keep_alerts else ["alerts.jsonl"]) if self.ctx.is_main else []
        for name in shared + [f"samples-rank{me}.jsonl", f"steps-rank{me}.jsonl"]:
            rundir.truncate_steps(run_dir / name, step)
