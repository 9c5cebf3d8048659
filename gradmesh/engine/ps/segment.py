"""What every rank of a parameter-server job knows about a segment of steps before it starts.

The loop hands the engine the global batches of a segment (every rank draws the same ones).
Each batch is cut into W shares ("chunks", one per worker, as data parallelism would) in
global order; empty shares (an epoch's short last batch) are no work. Clock c is the global
step `batch.step`; a server's version counts the updates it applied since step 0 (sync and
ssp: clocks; async: shares).
"""

import time
from dataclasses import dataclass, field

from gradmesh.data import GlobalBatch


@dataclass
class Segment:
    batches: list[GlobalBatch]
    workers: int
    chunks: dict[int, list[tuple[int, list[int]]]] = field(default_factory=dict)
    """clock -> [(chunk, sample indices)] of its non-empty shares, in order."""
    started: float = field(default_factory=time.time)

    def __post_init__(self):
        for batch in self.batches:
            shares = [(j, batch.share(j, self.workers, 1)[0]) for j in range(self.workers)]
            self.chunks[batch.step] = [(j, indices) for j, indices in shares if indices]

    @property
    def first(self) -> int:
        return self.batches[0].step

    @property
    def clocks(self) -> list[int]:
        return [batch.step for batch in self.batches]

    def batch(self, clock: int) -> GlobalBatch:
        return self.batches[clock - self.first]

    def indices(self, clock: int, chunk: int) -> list[int]:
        return dict(self.chunks[clock])[chunk]

    @property
    def total_chunks(self) -> int:
        return sum(len(found) for found in self.chunks.values())

    def order(self) -> list[tuple[int, int]]:
        """Every (clock, chunk) of the segment in global order."""
        return [(clock, j) for clock in self.clocks for j, _ in self.chunks[clock]]


class Dispatcher:
    """Hands out the segment's shares. Static (sync): worker w always computes share w, as data
    parallelism would. Dynamic (async, ssp): whoever is free takes the next share in global
    order, so a fast worker takes more of them; every share is handed out exactly once."""

    def __init__(self, segment: Segment, static: bool):
        order = segment.order()
        if static:
            self.queues = {w: [task for task in order if task[1] == w] for w in range(segment.workers)}
        else:
            self.shared = order
        self.static = static

    def next(self, worker: int) -> tuple[int, int] | None:
        queue = self.queues[worker] if self.static else self.shared
        return queue.pop(0) if queue else None
