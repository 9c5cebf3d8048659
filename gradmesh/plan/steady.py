"""A run's steady step time: what the planner calibrates from and what a run is judged by.

On a shared machine a millisecond step is bimodal: most steps run clear, and a share of them wait
for a process that took the core. The median of such a run jumps between the two modes from run
to run, while the mean moves little and is what throughput is made of (docs/planning.md#steady).
A long step from a rare event (a neighbour's burst, a page fault) still should not move the
figure, so the slowest tenth is left out: the mean of the rest is the steady step.
"""

import math

SLOWEST_LEFT_OUT = 0.1


def steady_step_s(times: list[float]) -> float:
    """The mean step time of the latest half of `times` (the first steps carry one-off costs),
    its slowest tenth left out."""
    latest = sorted(times[len(times) // 2 :])
    kept = latest[: max(1, len(latest) - math.floor(len(latest) * SLOWEST_LEFT_OUT))]
    return sum(kept) / len(kept)


def steps_for(estimate_s: float, least: int, seconds: float = 0.6, most: int = 240) -> int:
    """Steps for a run whose steady half lasts about `seconds` at `estimate_s` a step: short steps
    need many to average their waits out; at least `least`, at most `most`."""
    wanted = math.ceil(2 * seconds / max(estimate_s, 1e-6))
    return max(least, min(most, wanted))
