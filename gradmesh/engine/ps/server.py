"""A parameter server: it answers workers' messages (`Server.handle`) for its shard of the flat
parameter vector, which its update rule (`gradmesh.engine.ps.apply.UpdateRule`, with the
optimizer state of that shard) changes; the first server also holds the dispatcher's desk
(`gradmesh.engine.ps.dispatch.DispatchDesk`). The mode's rules (`gradmesh.engine.ps.mode.Mode`):

sync (ssp:0): the shares of one step are summed in share order (as data parallelism sums them)
and applied as one optimizer step once all have arrived, steps in order, so the model is the
single-process one. async and ssp:K with K >= 1: each share is applied when it arrives, its
learning rate scaled by its samples over the global batch, so a step's worth of shares moves
the model as far as one synchronous step; a worker thus reads parameters with every update so
far, its own included. ssp:K adds the clock table of stale synchronous parallel (Ho et al.
2013, whose updates are likewise applied as they come): a pull for the share of step c waits
until every step before c - K is wholly applied (the server's frontier).

The staleness of every applied share is recorded: async, updates applied since its worker
pulled; sync and ssp, the steps its parameters lacked (c minus the frontier it pulled at, at
most K); per step, its sum, count and maximum are kept for the metrics.
"""

import sys
from typing import cast

import torch
import torch.nn as nn

from gradmesh.comm.compress import PushCodec
from gradmesh.comm.ps_records import Commit, Params, Pull, RowsWanted, Take, bare
from gradmesh.comm.ps_wire import Kind, Message, Wire
from gradmesh.config.fault import auto_timeout
from gradmesh.engine.ps.accept import check_lookup, check_message
from gradmesh.engine.ps.apply import UpdateRule
from gradmesh.engine.ps.dispatch import DispatchDesk
from gradmesh.engine.ps.mode import Mode
from gradmesh.engine.ps.segment import Dispatcher, Segment
from gradmesh.engine.ps.slots import slot_bytes
from gradmesh.engine.ps.tables import ServerTables
from gradmesh.engine.ps.timing import RoleClock


class Server:
    def __init__(
        self,
        index: int,
        shard: tuple[int, int],
        buckets: list[tuple[int, int]],
        flat: torch.Tensor,
        wire: Wire,
        job,
        mode: Mode,
        servers_group,
        tables: list | None = None,
        dense_on_workers: bool = False,
    ):
        self.index, self.wire, self.job, self.mode = index, wire, job, mode
        self.dense_on_workers = dense_on_workers
        """Hybrid: the dense parameters are the workers' (all-reduced); this server holds tables only."""
        self.codec = PushCodec(job.train.compression)
        self.tables = ServerTables(
            tables or [], job.optimizer_kwargs.get("table_lr", job.optimizer_kwargs["lr"]), self.codec
        )
        self.low, self.high = shard
        self.buckets, self.servers_group = buckets, servers_group
        self.param = nn.Parameter(flat[self.low : self.high])  # a view: the mirror model sees every update
        self.spare: list[torch.Tensor] = []
        self.receiving: dict[int, torch.Tensor] = {}
        self.failed: set[int] = set()
        """Workers a send or receive failed with (they died), handled between messages."""
        self.slowest_share = 0.0
        """--step-timeout auto: the longest any share of the run was held, across segments."""
        self.clock = RoleClock("server")
        self.updates = UpdateRule(
            self.param, self.tables, mode, job, wire, servers_group, self.clock, self.spare, self.failed,
            dense_on_workers,
        )  # fmt: skip
        self.optimizer = self.updates.optimizer
        self.dispatcher: Dispatcher | None = None
        """The segment's queue of shares, on the first server (`serve`); None elsewhere."""
        self.desk: DispatchDesk | None = None

    @property
    def version(self) -> int:
        """Updates applied here (`UpdateRule.version`)."""
        return self.updates.version

    @property
    def applied(self) -> int:
        """Shares of the segment applied here."""
        return self.updates.applied

    @property
    def stats(self) -> dict[int, list[float]]:
        """Per step of the segment: staleness sum, count, max, when applied, refused pushes, 1 +
        the identity of the last worker refused."""
        return self.updates.stats

    def rewire(self, wire: Wire, servers_group) -> None:
        """In-place recovery: the survivors' new wire and the servers' new group."""
        self.wire, self.servers_group = wire, servers_group
        self.updates.rewire(wire, servers_group)

    def state_bytes(self) -> int:
        slots = slot_bytes(self.optimizer, self.param)
        held = self.param.numel() * self.param.element_size() * (2 + len(self.spare) + len(self.receiving))
        return held + slots + self.tables.state_bytes()

    # -- a segment -------------------------------------------------------------------------------

    def serve(
        self, segment: Segment, dispatcher: Dispatcher | None, identities: list[int], probe, lookout=None
    ) -> None:
        """Answer workers until every share of the segment is applied here (and, on the
        dispatcher, every live worker has been told the segment is done).

        `identities`: the rank each rank was started as; `lookout` (in-place recovery): sees
        workers die, whose shares go to the others."""
        self.segment, self.dispatcher, self.probe = segment, dispatcher, probe
        self.identities, self.workers = identities, segment.workers
        self._begin(segment)
        timed = dispatcher is not None and self.job.step_timeout != 0
        overdue = (lambda: cast(Dispatcher, dispatcher).overdue(self.share_limit())) if timed else list
        wake = (lambda: (lookout is not None and lookout()) or bool(overdue())) if lookout or timed else None
        while not self._served():
            with self.clock.phase("idle"):
                got = self.wire.receive_any(wake)
            if got is not None:
                self.handle(*got)
            for worker in (lookout.take() if lookout else []) + sorted(self.failed):
                self.lose(worker)
            self.failed.clear()
            self._stop_hung(overdue())
        self._end()

    def _begin(self, segment: Segment) -> None:
        """A segment's bookkeeping, fresh."""
        self.waiting: list[tuple] = []  # (worker, clock, least version, the ids of a row request or None)
        self.accepted: set[tuple[int, int]] = set()
        self.lost: set[int] = set()
        self.broken: set[int] = set()
        self.updates.begin(segment, self.probe)
        self.desk = None
        if self.dispatcher is not None:
            self.desk = DispatchDesk(self.dispatcher, segment, self.wire, self.mode, self.updates, self._send_params)

    def _end(self) -> None:
        with self.clock.phase("send"):
            self.wire.settle(tolerant=True)
        for worker in self.lost | self.broken:
            self.tables.take(worker)
            if worker in self.receiving:
                self.spare.append(self.receiving.pop(worker))

    def serve_lookups(self, workers: int) -> None:
        """Evaluation: answer row requests at once until a worker says it is done (the dispatcher
        is not involved; nothing changes)."""
        while True:
            source, message = cast(tuple[int, Message], self.wire.receive_any())  # no lookout: it waits
            check_lookup(self, source, message, workers)
            if message.kind == Kind.FINISHED:
                break
            ids = cast(torch.Tensor, self.tables.message(self.wire, source, message))  # ROWS: their ids
            self.tables.answer(self.wire, source, ids, self.version, 0.0)
        self.wire.settle()

    def _served(self) -> bool:
        if self.applied < self.segment.total_chunks:
            return False
        return self.desk is None or self.desk.told_every_live(self.workers, self.lost)

    def receive_push(self, source: int, bucket: int) -> None:
        """One bucket of a worker's gradient, into that worker's receiving buffer (in fp32; a
        half-width push is received apart and widened)."""
        low, high = self.buckets[bucket]
        if source not in self.receiving:  # a spare buffer, taken only when a share starts
            self.receiving[source] = self.spare.pop() if self.spare else torch.empty_like(self.param.detach())
        into = self.receiving[source][low - self.low : high - self.low]
        pushed = self.codec.buffer(into)
        with self.clock.phase("receive"):
            try:
                self.wire.payload_from(source, pushed).wait()
            except RuntimeError:  # its worker died before sending it
                self.broken.add(source)
                self.failed.add(source)
                return
        self.codec.decode(pushed, into)

    def handle(self, source: int, message: Message) -> None:
        kind = message.kind
        if source in self.broken:
            return  # what a dead worker sent after a payload it never finished: incomplete
        check_message(self, source, message)
        if kind == Kind.PUSH:
            self.receive_push(source, message.bucket)
        elif kind in (Kind.ROWS, Kind.GRADS):
            self.table_message(source, message)
        elif kind == Kind.COMMIT:
            self.commit(source, message)
        elif kind == Kind.PULL:
            pull = Pull.read(message)
            self.waiting.append((source, pull.clock, pull.least, None))
            self.answer_pulls()
        elif kind == Kind.CANCEL:
            if any(entry[0] == source for entry in self.waiting):
                self.waiting = [entry for entry in self.waiting if entry[0] != source]
                self.wire.send(source, bare(Kind.RETRY))
        elif kind == Kind.TAKE:  # TAKE and RETURN reach the dispatcher alone (`check_message`)
            cast(DispatchDesk, self.desk).take(source, Take.read(message).with_params)
        else:  # RETURN (check_message let through only what is handled here)
            cast(DispatchDesk, self.desk).give_back(source, (message.clock, message.chunk))

    def commit(self, worker: int, message: Message) -> None:
        """A share's commit: the first of each share counts (`UpdateRule.count`)."""
        gradient = self.receiving.pop(worker) if worker in self.receiving else self.param.detach()[:0]
        rows = self.tables.take(worker)
        task = (message.clock, message.chunk)
        counts = task not in self.accepted  # a share redone after its worker died counts once
        if self.desk:
            self.desk.committed(
                worker, task, (worker, message.oldest, message.samples, message.loss) if counts else None
            )
        if counts:
            self.accepted.add(task)
            self.updates.count(self.identities[worker], gradient, rows, Commit.read(message))
        else:
            self.spare.append(gradient)
        if self.desk:  # after applying: a worker told DONE may read the last step's norm
            self.desk.serve_parked()
        self.answer_pulls()

    def table_message(self, source: int, message: Message) -> None:
        """GRADS kept with the worker's share; ROWS answered like a pull, once the version it asks
        for is here (hybrid: a share's first row request is its pull)."""
        with self.clock.phase("receive"):
            try:
                wanted = self.tables.message(self.wire, source, message)
            except RuntimeError:  # its worker died before sending it
                self.broken.add(source)
                self.failed.add(source)
                return
        if message.kind == Kind.ROWS:
            wants = RowsWanted.read(message)
            self.waiting.append((source, wants.clock, wants.least, wanted))
            self.answer_pulls()

    def share_limit(self) -> float:
        """--step-timeout in seconds; auto: from the longest any share of the run was held."""
        if self.job.step_timeout > 0:
            return self.job.step_timeout
        self.slowest_share = max(self.slowest_share, cast(Dispatcher, self.dispatcher).longest)
        return auto_timeout(self.slowest_share)

    def _stop_hung(self, overdue: list[tuple[int, tuple[int, int]]]) -> None:
        """Dispatcher, --step-timeout: a worker holding a share that long without committing it
        hangs. Under in-place recovery the launcher stops it and the others take its shares;
        otherwise the job ends here (or restarts, under --recovery restart) rather than wait."""
        for worker, (clock, _) in overdue:
            cast(Dispatcher, self.dispatcher).hung.add(worker)
            what = (
                f"parameter server: worker rank {worker} has held a share of step {clock} for more than "
                f"--step-timeout {self.share_limit():g} s without committing it"
            )
            if self.job.membership is None:
                raise RuntimeError(what + "; it hangs (--recovery inplace would go on without it)")
            print(f"gradmesh: {what}: it hangs and is stopped", file=sys.stderr, flush=True)
            self.job.membership.evict(self.identities[worker])

    def _send_params(self, worker: int) -> None:
        level = self.mode.reported_version(self.version, self.updates.frontier)
        self.wire.send(worker, Params(version=level, updates=self.version).message(), self.param.detach())

    def lose(self, worker: int) -> None:
        """A worker died: what it pushed is dropped; the dispatcher hands its shares out again."""
        if worker in self.lost:
            return
        self.lost.add(worker)  # its pushes are kept: a commit it sent before it died may still be on the way
        self.waiting = [entry for entry in self.waiting if entry[0] != worker]
        if self.desk:
            self.desk.lose(worker)
            self.answer_pulls()

    def answer_pulls(self) -> None:
        still = []
        for worker, clock, least, rows in self.waiting:
            if self.mode.may_answer(self.updates.frontier, least):
                if rows is not None:
                    level = self.mode.reported_version(self.version, self.updates.frontier)
                    self.tables.answer(self.wire, worker, rows, level, self.updates.norm_sq(clock - 1))
                    continue
                self._send_params(worker)
            elif self.desk and self.desk.earlier_than(worker, clock):
                # a dead worker's share of an earlier step is back in line: this worker must do it
                # (waiting for it would wait forever), so it gives its own share back
                self.wire.send(worker, bare(Kind.RETRY))
            else:
                still.append((worker, clock, least, rows))
        self.waiting = still
