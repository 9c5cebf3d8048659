"""The dispatcher: the first server's second role, handing out a segment's shares.

Workers ask it for work (TAKE) and it answers each with a share (TASK) or, once every share is
committed, with DONE. The queue of shares itself (who holds what, what is back in line after a
worker died, what is overdue) is `gradmesh.engine.ps.segment.Dispatcher`; this desk answers the
workers from it: it parks a TAKE it cannot answer yet, bundles its server's shard with a share
when the worker asked so and the mode lets the pull be answered at once (saving its round
trip), and keeps the log of the commit that counted for each share, which the segment's report
is built from.
"""

from collections.abc import Callable

from gradmesh.comm.ps_records import SegmentDone, Task
from gradmesh.comm.ps_wire import Wire
from gradmesh.engine.ps.apply import UpdateRule
from gradmesh.engine.ps.mode import Mode
from gradmesh.engine.ps.segment import Dispatcher, Segment

LogEntry = tuple[int, int, int, float]
"""(worker, oldest version, samples, loss) of the commit that counted."""


class DispatchDesk:
    def __init__(
        self,
        queue: Dispatcher,
        segment: Segment,
        wire: Wire,
        mode: Mode,
        updates: UpdateRule,
        send_params: Callable[[int], None],
    ):
        self.queue, self.segment, self.wire, self.mode = queue, segment, wire, mode
        self.updates, self.send_params = updates, send_params
        """The server's update rule (its frontier, the steps' norms) and its PARAMS to a worker."""
        self.log: dict[tuple[int, int], LogEntry] = {}
        """(clock, chunk) -> the commit that counted."""
        self.parked: list[int] = []
        """Workers whose TAKE is not answered yet."""
        self.bundled: set[int] = set()
        """Parked workers whose TAKE asked for this server's shard with the share."""
        self.told_done: set[int] = set()

    def take(self, worker: int, with_params: bool) -> None:
        """TAKE: `worker` asks for its next share (`with_params`: and this server's shard)."""
        self.parked.append(worker)
        if with_params:
            self.bundled.add(worker)
        self.serve_parked()

    def give_back(self, worker: int, task: tuple[int, int]) -> None:
        """RETURN: `worker` did not start the share `task`; it goes back in line."""
        self.queue.give_back(worker, task)
        self.serve_parked()

    def committed(self, worker: int, task: tuple[int, int], entry: LogEntry | None) -> None:
        """A commit of `task` by `worker`; `entry`: the log's, when it is the one that counts."""
        self.queue.commit(worker, task)
        if entry is not None:
            self.log[task] = entry

    def told_every_live(self, workers: int, lost: set[int]) -> bool:
        """Every worker still alive has been told the segment is done."""
        return set(range(workers)) - lost <= self.told_done

    def serve_parked(self) -> None:
        """Hand each waiting worker a share; once all are committed, tell it so."""
        still = []
        for worker in self.parked:
            task = self.queue.next(worker)
            if task is not None:
                self._hand(worker, task)
            elif self.queue.finished:
                last = self.segment.clocks[-1]
                self.wire.send(worker, SegmentDone(norm_sq=self.updates.norm_sq(last)).message())
                self.told_done.add(worker)
                self.bundled.discard(worker)
            else:  # the others still hold the last shares: one may die and leave its share to this one
                still.append(worker)
        self.parked = still

    def _hand(self, worker: int, task: tuple[int, int]) -> None:
        """TASK, and this server's shard with it when the worker asked so and the bound allows."""
        least = self.mode.least_version(task[0])
        bundled = worker in self.bundled and self.mode.may_answer(self.updates.frontier, least)
        self.bundled.discard(worker)
        self.wire.send(worker, Task(task[0], task[1], params_follow=bundled).message())
        if bundled:
            self.send_params(worker)

    def lose(self, worker: int) -> None:
        """A worker died: its shares go back in line and others may now take them."""
        self.queue.lose(worker)
        self.parked = [w for w in self.parked if w != worker]
        self.bundled.discard(worker)
        self.serve_parked()

    def earlier_than(self, worker: int, clock: int) -> bool:
        """A share of a step before `clock` is back in line, and `worker` may take it."""
        return self.queue.earlier_than(worker, clock)
