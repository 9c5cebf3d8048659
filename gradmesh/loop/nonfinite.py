"""--on-nonfinite: what a run does after a step whose loss or gradients were NaN or infinite.

The engine has already applied nothing of such a step on any rank (`gradmesh.engine.nonfinite`:
every rank agrees before the optimizer). This service says so once — an alert (`kind: nonfinite`)
in alerts.jsonl, on the console and on the dashboard — and then, by policy:

- stop (default): the run ends with exit code 4 and that one line, which names the step, the
  rank(s), the loss or the gradient, and what to try;
- skip: the step counts as done without an update; `max_skips` skipped steps in a row stop the
  run as above (a model that has gone bad does not come back by skipping);
- rollback: every rank goes back to the newest intact checkpoint together, in the same processes,
  and the bad step's global batch is skipped when the replay reaches it — the recovery PaLM used
  for loss spikes (Chowdhery et al. 2022, section 5.1); at most `max_rollbacks` times, then stop.

Skipping a batch leaves the global order (contract 1) alone: step N still draws batch N, and a
skipped step is a step without an update, so a resumed or restarted run skips the same batches
(they travel in the checkpoint's state).
"""

import json
import time

from gradmesh.engine import StepOutcome
from gradmesh.errors import EXIT_NONFINITE  # noqa: F401 (re-exported)
from gradmesh.files import open_append
from gradmesh.loop.services import RunContext, Service, StepRows
from gradmesh.monitor.monitor import Monitor


class NonFiniteError(Exception):
    """The run stopped on non-finite values (one line: step, rank(s), what, what to try)."""


class RollBack(Exception):
    """Raised on every rank at once: the loop reloads the newest intact checkpoint."""


class NonFinitePolicy(Service):
    lockstep = True

    def __init__(
        self,
        ctx: RunContext,
        reporting: StepRows,
        monitor: Monitor,
        policy: str,
        max_skips: int,
        max_rollbacks: int,
        train,
    ):
        self.ctx, self.reporting, self.monitor, self.policy = ctx, reporting, monitor, policy
        self.max_skips, self.max_rollbacks = max_skips, max_rollbacks
        clip = (
            f"a tighter gradient clip (now --set train.grad_clip={train.grad_clip:g})"
            if train.grad_clip
            else "gradient clipping (--set train.grad_clip=1.0)"
        )
        self.advice = f"try a lower --lr (now {train.lr:g}), {clip}, or --on-nonfinite skip|rollback"
        self.in_row, self.rollbacks = 0, 0
        self.skipped: list[int] = []
        """Steps whose update was dropped (skip) or whose batch was skipped (rollback), in order."""
        self.batches_to_skip: set[int] = set()

    def after_step(self, outcome: StepOutcome, elapsed: float) -> None:
        found = outcome.nonfinite
        if found is None:
            self.in_row = 0
            return
        self.in_row += 1
        if self.policy == "skip" and self.in_row < self.max_skips:
            self.skipped.append(found.step)
            self._alert(
                found,
                f"its update was dropped on every rank (--on-nonfinite skip, {self.in_row} of "
                f"{self.max_skips} in a row before the run stops)",
            )
        elif self.policy == "rollback" and self.rollbacks < self.max_rollbacks:
            self.rollbacks += 1
            self.batches_to_skip.add(found.step)
            self._alert(
                found,
                f"rolling back to the last intact checkpoint; the batch of step {found.step} will be "
                f"skipped (--on-nonfinite rollback, {self.rollbacks} of {self.max_rollbacks})",
            )
            raise RollBack(found.step)
        else:
            self._stop(found)

    def _stop(self, found) -> None:
        why = {
            "skip": f"{self.in_row} steps in a row were not finite",
            "rollback": f"{self.rollbacks} rollback(s) did not help",
        }.get(self.policy, "--on-nonfinite stop")
        message = self._alert(found, f"nothing of it was applied and the run stops ({why}): {self.advice}")
        self.reporting.reporter.flush()  # every rank is here: the rows before this one reach metrics.jsonl
        raise NonFiniteError(message)

    def _alert(self, found, action: str) -> str:
        alert = found.alert(self.policy, action)
        if self.ctx.is_main:
            self.monitor.alert(alert)
        return alert["message"]

    def rolled_back(self, to_step: int) -> None:
        """Rank 0 records where the run went back to (RUN_DIR/faults.jsonl) and says it."""
        if self.ctx.is_main and self.ctx.run_dir:
            with open_append(self.ctx.run_dir / "faults.jsonl") as log:
                log.write(
                    json.dumps(
                        {
                            "event": "rollback",
                            "to_step": to_step,
                            "skip_batches": sorted(self.batches_to_skip),
                            "time": time.time(),
                        }
                    )
                    + "\n"
                )
        self.reporting.note(f"gradmesh: rolled back to step {to_step}")

    def skipped_outcome(self, batch, lr: float, figures) -> StepOutcome:
        """A step whose batch rollback skips: drawn (the order goes on) but never computed."""
        self.skipped.append(batch.step + 1)
        return StepOutcome(batch, lr, [], figures, row={"skipped": "rollback"})

    def state(self) -> dict:
        return {"skip_batches": sorted(self.batches_to_skip)}

    def load(self, state: dict) -> None:
        self.batches_to_skip |= set(state.get("skip_batches", []))
