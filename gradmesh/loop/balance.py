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
alerts.jsonl. Under auto and static alike, no share exceeds what its rank's memory holds
(`gradmesh.loop.memory_guard`); a cap that binds is reported the same way.
"""

from typing import Protocol, cast

import torch
import torch.distributed as dist

from gradmesh.config.balance import parse_balance
from gradmesh.loop.memory_guard import ActivationMeter, capped, sample_caps
from gradmesh.loop.services import RunContext, Service
from gradmesh.monitor.monitor import Monitor
from gradmesh.topology import available_bytes

EVERY = 5
SMOOTH = 0.5
"""Weight of the current shares in the new ones."""
HYSTERESIS = 0.02


class MeasuredWork(Protocol):
    """What balancing reads of step reporting (`gradmesh.loop.reporting.Reporting`): this rank's
    measured work in the last step, and the monitor its alerts go to."""

    @property
    def work_s(self) -> float | None: ...
    @property
    def monitor(self) -> Monitor: ...


class Balancing(Service):
    lockstep = True

    def __init__(
        self,
        ctx: RunContext,
        reporting: MeasuredWork,
        sampler,
        balance: str,
        grad_accum: int = 1,
        free_memory=lambda: None,
    ):
        """free_memory: bytes this rank is told it has free (an injected fault), or None."""
        self.ctx, self.reporting, self.sampler = ctx, reporting, sampler
        self.how, self.static = parse_balance(balance)
        self.grad_accum, self.free_memory = grad_accum, free_memory
        self.busy = self.samples = 0.0
        self.meter = ActivationMeter(lambda: ctx.engine.model)
        self.bound: set[int] = set()

    def start(self, first_step: int) -> None:
        if self.how == "static":
            self.sampler.proportions = self.static

    def regrouped(self) -> None:
        self.sampler.proportions = (
            self.static if self.how == "static" and len(self.static) == self.ctx.topology.dp_size else None
        )  # another number of ranks: equal until measured again
        self.busy = self.samples = 0.0
        self.meter.due, self.bound = True, set()

    def around_forward(self, samples: int):
        return self.meter.around_forward(samples)

    def after_step(self, outcome, elapsed: float) -> None:
        self.busy += self.reporting.work_s if self.reporting.work_s is not None else elapsed
        self.samples += 1
        if outcome.step % EVERY:
            return
        times, per_sample, free = self._gather()
        self.busy, self.samples, self.meter.due = 0.0, 0.0, True
        current = self.sampler.proportions or tuple(1 / len(times) for _ in times)
        if len(times) < 2 or len(current) != len(times):
            return
        wanted = self._target(current, times) if self.how == "auto" else self.static
        caps = sample_caps(per_sample, free, self.grad_accum)
        new, bound = capped(wanted, caps, self.sampler.global_batch_size)
        moved = max(abs(n - c) for n, c in zip(new, current)) > (HYSTERESIS if self.how == "auto" else 1e-9)
        if not moved and bound == self.bound:
            return
        self.sampler.proportions, newly = new, bound - self.bound
        self.bound = bound
        if self.ctx.is_main:
            self._tell(outcome.step, new, times)
            for rank in sorted(newly):
                self._tell_cap(outcome.step, rank, cast(int, caps[rank]), per_sample[rank], free[rank])  # bound: capped

    def _target(self, current: tuple[float, ...], times: list[float]) -> tuple[float, ...]:
        """auto: each share scaled towards equal work times, smoothed with the current ones."""
        if min(times) <= 0:
            return current
        mean = sum(times) / len(times)
        target = [c * mean / t for c, t in zip(current, times)]
        return tuple(SMOOTH * c + (1 - SMOOTH) * x / sum(target) for c, x in zip(current, target))

    def _gather(self) -> tuple[list[float], list[float], list[float]]:
        """Collective: per data-parallel rank, its work per step over the window, its activation
        bytes per sample and its free bytes (the slowest, largest and least of model-parallel
        partners sharing a data-parallel index)."""
        topology = self.ctx.topology
        free = self.free_memory() or available_bytes(topology.device, topology.local_world_size) or 0
        mine = torch.tensor(
            [float(topology.dp_rank), self.busy / max(self.samples, 1), self.meter.per_sample or 0.0, float(free)],
            dtype=torch.float64,
        )
        everyone = [torch.zeros_like(mine) for _ in range(topology.world_size)]
        dist.all_gather(everyone, mine, group=topology.group("world"))
        times, per_sample, budget = (
            [0.0] * topology.dp_size,
            [0.0] * topology.dp_size,
            [float("inf")] * topology.dp_size,
        )
        for dp_rank, seconds, nbytes, room in (t.tolist() for t in everyone):
            r = int(dp_rank)
            times[r], per_sample[r], budget[r] = (
                max(times[r], seconds),
                max(per_sample[r], nbytes),
                min(budget[r], room),
            )
        return times, per_sample, budget

    def _tell(self, step: int, shares: tuple[float, ...], times: list[float]) -> None:
        slowest = max(range(len(times)), key=lambda r: times[r])
        why = (
            (
                f"data-parallel rank {slowest} the slowest: {times[slowest] * 1e3:.1f} ms of work per step against "
                f"{min(times) * 1e3:.1f}"
            )
            if self.how == "auto"
            else "the static shares within the ranks' memory"
        )
        rank = slowest if self.how == "auto" else min(self.bound, default=0)
        text = f"balance: from step {step + 1} the shares are {', '.join(f'{s:.0%}' for s in shares)} ({why})"
        self.reporting.monitor.alert(
            {"step": step, "kind": "balance", "rank": rank, "shares": [round(s, 4) for s in shares], "message": text}
        )

    def _tell_cap(self, step: int, rank: int, cap: int, per_sample: float, free: float) -> None:
        batch = self.sampler.global_batch_size
        text = (
            f"balance: data-parallel rank {rank}'s share is capped at {min(cap, batch)} of {batch} samples "
            "by its memory "
            f"({per_sample / 2**10:.1f} KiB of activations per sample, {free / 2**20:.1f} MiB free, "
            f"grad-accum {self.grad_accum})"
        )
        self.reporting.monitor.alert(
            {
                "step": step,
                "kind": "memory",
                "rank": rank,
                "cap": cap,
                "per_sample_bytes": per_sample,
                "free_bytes": free,
                "message": text,
            }
        )
