"""Stragglers and load imbalance, named from every rank's step breakdown (on rank 0).

In synchronous data parallelism every rank's step takes as long as the slowest one's: the fast
ranks wait for the slow one inside the gradient all-reduce. So the step time itself cannot tell
them apart; the time a rank spends working can. A rank's *busy* time is its step time less the
time it waited (`comm`, the all-reduce not hidden by the backward pass, and `idle`). A rank whose
busy time stays above the median of the other ranks' by more than `margin` (a fraction) for
`steps` consecutive steps is a straggler; the slow phase is the group (data loading, compute =
forward + backward + optimizer, communication) in which it exceeded the others' median most,
summed over those steps: one step's phases are noisy on shared cores (a fast rank busy serving
a scrape makes the slow one wait in its all-reduce), the sum over the streak is not.
The imbalance score of a step is max/mean - 1 of the busy times (0: perfectly even).
"""

import statistics

PHASE_GROUPS = {"data": ("data",), "compute": ("forward", "backward", "optimizer"), "communication": ("comm_busy_s",)}


def busy_times(breakdown: dict[str, list[float]]) -> list[float]:
    return [s - c - i for s, c, i in zip(breakdown["step_s"], breakdown["comm"], breakdown["idle"])]


def imbalance(busy: list[float]) -> float:
    mean = sum(busy) / len(busy) if busy else 0.0
    return max(busy) / mean - 1 if mean > 0 else 0.0


def phase_excess(breakdown: dict[str, list[float]], rank: int) -> dict[str, float]:
    """Seconds by which `rank` exceeds the other ranks' median in each phase group."""

    def group_time(r: int, group: str) -> float:
        return sum(breakdown[key][r] for key in PHASE_GROUPS[group])

    others = [r for r in range(len(breakdown["step_s"])) if r != rank]
    return {g: group_time(rank, g) - statistics.median(group_time(r, g) for r in others) for g in PHASE_GROUPS}


def worker_breakdown(workers: dict[str, list[float]]) -> dict[str, list[float]]:
    """A parameter-server job's workers as the detector reads ranks: their busy time (data and
    compute) per sample, since a fast worker takes more shares and a slow one fewer."""

    def per_sample(phase: str) -> list[float]:
        return [t / n if n else 0.0 for t, n in zip(workers[phase], workers["samples"])]

    data, compute = per_sample("data"), per_sample("compute")
    zeros = [0.0] * len(data)
    return {
        "step_s": [d + c for d, c in zip(data, compute)],
        "comm": zeros,
        "idle": zeros,
        "data": data,
        "forward": compute,
        "backward": zeros,
        "optimizer": zeros,
        "comm_busy_s": [p + q for p, q in zip(per_sample("push"), per_sample("pull"))],
    }


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value >= 0.1 else f"{value * 1e3:.3f} ms"


class StragglerDetector:
    def __init__(self, margin: float = 0.5, steps: int = 5):
        self.margin, self.steps = margin, steps
        self.streak: dict[int, int] = {}
        self.excess: dict[int, dict[str, float]] = {}
        self.reported: set[int] = set()

    def _count(self, rank: int, slow: bool, breakdown: dict[str, list[float]]) -> bool:
        """Extend or end `rank`'s streak (and its summed phase excess); True once it is long enough."""
        if not slow:
            self.streak[rank] = 0
            self.excess.pop(rank, None)
            self.reported.discard(rank)  # recovered: a later slowdown is reported again
            return False
        self.streak[rank] = self.streak.get(rank, 0) + 1
        summed = self.excess.setdefault(rank, dict.fromkeys(PHASE_GROUPS, 0.0))
        for group, seconds in phase_excess(breakdown, rank).items():
            summed[group] += seconds
        return self.streak[rank] >= self.steps

    def observe(self, step: int, breakdown: dict[str, list[float]], per: str = "step") -> tuple[list[dict], list[dict]]:
        """One step's per-rank breakdown -> (stragglers this step, new alerts). `per`: what the
        busy times are of ("sample" for parameter-server workers)."""
        busy = busy_times(breakdown)
        flagged: list[dict] = []
        alerts: list[dict] = []
        if len(busy) < 2:
            return flagged, alerts
        for rank, mine in enumerate(busy):
            median = statistics.median(b for r, b in enumerate(busy) if r != rank)
            if not self._count(rank, median > 0 and mine > median * (1 + self.margin), breakdown):
                continue
            phase = max(PHASE_GROUPS, key=self.excess[rank].__getitem__)
            excess = mine / median - 1
            flagged.append({"rank": rank, "phase": phase, "excess": round(excess, 3)})
            if rank not in self.reported:
                self.reported.add(rank)
                alerts.append(
                    {
                        "step": step,
                        "kind": "straggler",
                        "rank": rank,
                        "phase": phase,
                        "message": f"rank {rank} is a straggler ({phase}): busy {_seconds(mine)} per {per}, "
                        f"{excess:.0%} above the other ranks' median for {self.streak[rank]} steps",
                    }
                )
        return flagged, alerts
