"""`--balance`: split each global batch among the data-parallel ranks by their speed.

A synchronous step lasts as long as its slowest rank. gradmesh weights every sample by
1/(global batch) whatever rank computes it, so any split trains the same model; giving a slow
rank fewer samples shortens the step (LB-BSP, Chen et al. 2020, resizes batches at the barrier
the same way). `static:S1,S2,...` fixes the proportions. `auto`: every `EVERY` steps the ranks
all-gather the time of their work that grows with samples (data, forward and backward from the
step breakdown: no waiting, and not the optimizer step, whose fixed cost would make a rank with
fewer samples look slower per sample) per step over those steps. Each share is scaled by the
mean of those times over its rank's own (a slow rank gives samples away until the ranks' work
takes equally long: with costs proportional to samples, shares proportional to speed; with a
fixed cost per step as well, still equal times, which is what the step waits for), smoothed with
the current shares, and taken only when some share moves by more than `HYSTERESIS`. Every rank computes
the same split from the same gathered figures, so all switch at the same step. The shares go to
metrics.jsonl (`shares`), the sampler's checkpoint state and, when they change, the console and
alerts.jsonl.
"""

import torch
import torch.distributed as dist

from gradmesh.config.balance import parse_balance
from gradmesh.loop.services import RunContext, Service

EVERY = 5
SMOOTH = 0.5
"""Weight of the current shares in the new ones."""
HYSTERESIS = 0.02


class Balancing(Service):
    lockstep = True

    def __init__(self, ctx: RunContext, reporting, sampler, balance: str):
        self.ctx, self.reporting, self.sampler = ctx, reporting, sampler
        self.how, self.static = parse_balance(balance)
        self.busy = self.samples = 0.0

    def start(self, first_step: int) -> None:
        if self.how == "static":
            self.sampler.proportions = self.static

    def regrouped(self) -> None:
        self.sampler.proportions = None  # another number of ranks: equal until measured again
        self.busy = self.samples = 0.0

    def after_step(self, outcome, elapsed: float) -> None:
        if self.how != "auto":
            return
        self.busy += self.reporting.work_s if self.reporting.work_s is not None else elapsed
        self.samples += 1
        if outcome.step % EVERY:
            return
        times = self._times()
        self.busy = self.samples = 0.0
        current = self.sampler.proportions or tuple(1 / len(times) for _ in times)
        if len(times) < 2 or min(times) <= 0 or len(current) != len(times):
            return
        mean = sum(times) / len(times)
        target = [c * mean / t for c, t in zip(current, times)]
        new = tuple(SMOOTH * c + (1 - SMOOTH) * x / sum(target) for c, x in zip(current, target))
        if max(abs(n - c) for n, c in zip(new, current)) <= HYSTERESIS:
            return
        self.sampler.proportions = new
        if self.ctx.is_main:
            self._tell(outcome.step, new, times)

    def _times(self) -> list[float]:
        """Collective: each data-parallel rank's work per step over the window (its slowest
        member's, when model-parallel partners share a data-parallel index)."""
        topology = self.ctx.topology
        mine = torch.tensor([float(topology.dp_rank), self.busy / max(self.samples, 1)], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(topology.world_size)]
        dist.all_gather(everyone, mine, group=topology.group("world"))
        times = [0.0] * topology.dp_size
        for dp_rank, seconds in (t.tolist() for t in everyone):
            times[int(dp_rank)] = max(times[int(dp_rank)], seconds)
        return times

    def _tell(self, step: int, shares: tuple[float, ...], times: list[float]) -> None:
        slowest = max(range(len(times)), key=lambda r: times[r])
        text = (f"balance: from step {step + 1} the shares are {', '.join(f'{s:.0%}' for s in shares)} "
                f"(data-parallel rank {slowest} the slowest: {times[slowest] * 1e3:.1f} ms of work per step against "
                f"{min(times) * 1e3:.1f})")
        self.reporting.note(text)
        self.reporting.monitor.alert({"step": step, "kind": "balance", "rank": slowest, "shares": [round(s, 4) for s in shares],
                                      "message": text})
