"""`--bucket-mb auto`: time a few DDP bucket sizes over the first steps and keep the fastest.

Smaller buckets start communicating earlier in backward (more overlap) but pay a collective's
fixed cost more often; which wins depends on the model, the link and the machine, so it is
measured, not guessed. Step 1 runs at DDP's default (25 MiB) and carries one-off costs; then each
candidate runs `TRIAL` steps, the first of which rebuilds DDP's buckets and is not timed; the
slowest rank's step time counts. The candidates and timings go to `RUN_DIR/buckets.json`. Every
trial step is an ordinary training step: bucketing changes which gradients travel together,
not the arithmetic.
"""

import json
import statistics
from typing import cast

from gradmesh.engine import LockstepEngine
from gradmesh.files import atomic_write
from gradmesh.loop.services import Notes, RunContext, Service, largest

CANDIDATES_MB = (1.0, 5.0, 25.0, 100.0)
TRIAL = 3


def candidates(model_mb: float) -> list[float]:
    """The sizes that bucket this model differently: every candidate below its size and the
    first one at or above it (larger ones would make the same single bucket)."""
    below = [mb for mb in CANDIDATES_MB if mb < model_mb]
    above = [mb for mb in CANDIDATES_MB if mb >= model_mb][:1]
    return below + above


class BucketTuning(Service):
    lockstep = True

    def __init__(self, ctx: RunContext, reporting: Notes, max_steps: int):
        self.ctx, self.reporting, self.max_steps = ctx, reporting, max_steps
        self.sizes: list[float] = []
        self.timings: dict[float, list[float]] = {}
        self.first = 0

    def _engine(self) -> LockstepEngine:
        """Bucket tuning runs only with an engine in lockstep (`gradmesh.loop.build`)."""
        return cast(LockstepEngine, self.ctx.engine)

    def start(self, first_step: int) -> None:
        model = self.ctx.engine.model
        model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        sizes = candidates(model_mb)
        if first_step + 1 + TRIAL * len(sizes) > self.max_steps:
            sizes = []  # too short a run to time them: DDP's default stays
        self.sizes, self.first = sizes, first_step + 1

    def _trial(self, step: int) -> tuple[int, int]:
        """(candidate index, step within its trial) of `step`; index -1 before the trials."""
        offset = step - self.first - 1
        return (offset // TRIAL, offset % TRIAL) if offset >= 0 else (-1, 0)

    def after_step(self, outcome, elapsed: float) -> None:
        if not self.sizes:
            return
        index, within = self._trial(outcome.step)
        if 0 <= index < len(self.sizes) and within > 0:
            self.timings.setdefault(self.sizes[index], []).append(largest(elapsed, self.ctx.topology.group("dp")))
        following, _ = self._trial(outcome.step + 1)
        if following != index and 0 <= following < len(self.sizes):
            if not self._engine().rebucket(self.sizes[following]):
                self.sizes = []  # no DDP buckets here (a mesh's flat buffer)
        elif following == len(self.sizes) and index == len(self.sizes) - 1:
            self._keep_fastest(outcome.step)

    def _keep_fastest(self, step: int) -> None:
        means = {mb: statistics.fmean(times) for mb, times in self.timings.items()}
        best = min(means, key=means.__getitem__)
        self._engine().rebucket(best)
        self.sizes = []
        if self.ctx.is_main:
            record = {
                "candidates_mb": list(means),
                "step_s": {str(mb): t for mb, t in self.timings.items()},
                "mean_step_s": {str(mb): t for mb, t in means.items()},
                "chosen_mb": best,
                "from_step": step + 1,
            }
            if self.ctx.run_dir:
                atomic_write(self.ctx.run_dir / "buckets.json", json.dumps(record, indent=1))
            timed = ", ".join(f"{mb:g} MiB {t * 1e3:.1f} ms" for mb, t in means.items())
            self.reporting.note(f"--bucket-mb auto: {best:g} MiB from step {step + 1} ({timed})")
