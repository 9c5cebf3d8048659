"""Cutting a sequence of model units into contiguous pipeline stages.

A pipeline runs at the pace of its slowest stage and must fit on its fullest one, so the cut
minimises the bottleneck: the largest stage share of time or of memory, each measured against
a perfectly even split. Contiguous min-max partitioning is exact by dynamic programming
(O(stages x units^2)); units are a model's layers, so this is instant.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class UnitCost:
    name: str
    seconds: float
    """Forward plus backward time of one micro-batch."""
    bytes: float
    """Parameters, gradients, optimizer state and in-flight activations."""


def stage_load(costs: Sequence[UnitCost], starts: Sequence[int]) -> list[float]:
    """Each stage's load: max(time share, memory share), 1.0 being a perfectly even split."""
    total_s = sum(c.seconds for c in costs) or 1.0
    total_b = sum(c.bytes for c in costs) or 1.0
    stages = len(starts)
    bounds = list(starts) + [len(costs)]
    loads = []
    for a, b in zip(bounds, bounds[1:]):
        part = costs[a:b]
        loads.append(max(sum(c.seconds for c in part) / total_s, sum(c.bytes for c in part) / total_b) * stages)
    return loads


def balanced_cut(costs: Sequence[UnitCost], stages: int) -> list[int]:
    """Start index of each stage, minimising the largest stage load (ties: the earlier cut)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} units into {stages} non-empty stages")
    total_s = sum(c.seconds for c in costs) or 1.0
    total_b = sum(c.bytes for c in costs) or 1.0
    prefix_s, prefix_b = [0.0], [0.0]
    for c in costs:
        prefix_s.append(prefix_s[-1] + c.seconds / total_s)
        prefix_b.append(prefix_b[-1] + c.bytes / total_b)

    def load(a: int, b: int) -> float:
        return max(prefix_s[b] - prefix_s[a], prefix_b[b] - prefix_b[a])

    inf = float("inf")
    # best[k][j]: smallest bottleneck placing the first j units on k stages; start[k][j]: its last start.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    start = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], load(i, j))
                if value < best[k][j] - 1e-12:
                    best[k][j], start[k][j] = value, i
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = start[k][j]
        starts.append(j)
    return starts[::-1]


def equal_cut(units: int, stages: int) -> list[int]:
    """The naive cut: the same number of units per stage (the first stages take the remainder)."""
    base, extra = divmod(units, stages)
    starts, at = [], 0
    for s in range(stages):
        starts.append(at)
        at += base + (s < extra)
    return starts


def cut_at(names: Sequence[str], split_points: Sequence[str], stages: int) -> list[int]:
    """A manual cut: each split point is the unit that begins a new stage."""
    if len(split_points) != stages - 1:
        raise ValueError(f"{stages} stages need {stages - 1} split point(s), got {len(split_points)}")
    starts = [0]
    for point in split_points:
        if point not in names:
            raise ValueError(f"split point {point!r} is not a unit of the model; units: {', '.join(names)}")
        starts.append(list(names).index(point))
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"split points {', '.join(split_points)} must be in model order, after {names[0]!r}, each once"
        )
    return starts
