"""What every rank of a parameter-server job knows about a segment of steps before it starts.

The loop hands the engine the global batches of a segment (every rank draws the same ones).
Each batch is cut into W shares ("chunks", one per worker, as data parallelism would; under
async and ssp, W x `ps.shares` smaller ones) in global order; empty shares (an epoch's short last
batch) are no work. Clock c is the global
step `batch.step`; a server's version counts the updates it applied since step 0 (sync and
ssp: clocks; async: shares).
"""

import bisect
import time
from dataclasses import dataclass, field

from gradmesh.comm.ps_wire import Message
from gradmesh.data import GlobalBatch


@dataclass
class Segment:
    batches: list[GlobalBatch]
    workers: int
    split: int = 1
    """Shares per worker: each batch is cut into workers x split shares (async and ssp)."""
    chunks: dict[int, list[tuple[int, list[int]]]] = field(default_factory=dict)
    """clock -> [(chunk, sample indices)] of its non-empty shares, in order."""
    started: float = field(default_factory=time.time)

    def __post_init__(self):
        for batch in self.batches:
            n = self.workers * self.split
            shares = [(j, batch.share(j, n, 1)[0]) for j in range(n)]
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

    def check_share(self, sender: int, message: Message) -> None:
        """WireError unless the message's (clock, chunk) is a share of this segment."""
        clocks = self.clocks
        message.check(sender, "clock", message.clock in self.chunks, f"{clocks[0]}..{clocks[-1]}")
        chunks = [j for j, _ in self.chunks[message.clock]]
        message.check(sender, "chunk", message.chunk in chunks, ", ".join(map(str, chunks)) or "none")

    @property
    def total_chunks(self) -> int:
        return sum(len(found) for found in self.chunks.values())

    def order(self) -> list[tuple[int, int]]:
        """Every (clock, chunk) of the segment in global order."""
        return [(clock, j) for clock in self.clocks for j, _ in self.chunks[clock]]


class Dispatcher:
    """Hands out the segment's shares, each to one worker at a time, until each is committed.

    Static (sync): worker w computes share w, as data parallelism would. Dynamic (async, ssp):
    whoever is free takes the earliest share left in global order, so a fast worker takes more.
    A worker that dies leaves its uncommitted shares to the others (static: its later shares
    too), first in line; a worker that could not start a share gives it back.
    """

    def __init__(self, segment: Segment, static: bool):
        self.queue = segment.order()  # kept in global order
        self.static = static
        self.orphaned: set[int] = set()
        """Static: workers whose shares anyone may take (they died)."""
        self.held: dict[int, set[tuple[int, int]]] = {w: set() for w in range(segment.workers)}
        self.committed: set[tuple[int, int]] = set()
        self.since: dict[tuple[int, int], float] = {}
        """When each held share was handed out (time.monotonic)."""
        self.hung: set[int] = set()
        """Workers found holding a share too long (their loss is on its way)."""
        self.longest = 0.0
        """The longest a committed share was held (seconds): --step-timeout auto's measure."""

    def _mine(self, worker: int, task: tuple[int, int]) -> bool:
        return not self.static or task[1] == worker or task[1] in self.orphaned

    def next(self, worker: int) -> tuple[int, int] | None:
        """The earliest share this worker may take, now held by it; None: none now (see `finished`)."""
        for i, task in enumerate(self.queue):
            if self._mine(worker, task):
                self.held[worker].add(task)
                self.since[task] = time.monotonic()
                return self.queue.pop(i)
        return None

    @property
    def finished(self) -> bool:
        """Every share committed: nothing is queued and nobody holds one."""
        return not self.queue and not any(self.held.values())

    def commit(self, worker: int, task: tuple[int, int]) -> bool:
        """A worker committed a share; False when it already was (a redone share: drop it)."""
        self.held.get(worker, set()).discard(task)
        if task in self.committed:
            return False
        if task in self.since:
            self.longest = max(self.longest, time.monotonic() - self.since[task])
        self.committed.add(task)
        if task in self.queue:  # handed out again after its worker died, yet its commit arrived
            self.queue.remove(task)
        return True

    def give_back(self, worker: int, task: tuple[int, int]) -> None:
        self.held[worker].discard(task)
        bisect.insort(self.queue, task)

    def lose(self, worker: int) -> None:
        """The worker died: what it held goes back in line; static, its shares are anyone's."""
        for task in self.held.pop(worker, set()):
            if task not in self.committed:
                bisect.insort(self.queue, task)
        self.orphaned.add(worker)

    def overdue(self, seconds: float) -> list[tuple[int, tuple[int, int]]]:
        """(worker, share) of each share of the earliest step not yet committed that has been held
        longer than `seconds`. A later share may be late only because its worker waits for an
        earlier step (sync and ssp hold its pull), held by another or back in line after a loss;
        a share of the earliest step never waits."""
        held = [(task, worker) for worker, tasks in self.held.items() for task in tasks]
        if not held:
            return []
        earliest, now = min([task[0] for task, _ in held] + [task[0] for task in self.queue]), time.monotonic()
        return [
            (worker, task)
            for task, worker in sorted(held)
            if task[0] == earliest and now - self.since[task] > seconds and worker not in self.hung
        ]

    def earlier_than(self, worker: int, clock: int) -> bool:
        """A share of an earlier step is waiting that this worker may take."""
        return any(task[0] < clock and self._mine(worker, task) for task in self.queue)
