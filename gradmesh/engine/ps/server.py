"""A parameter server: its shard of the flat parameter vector, the optimizer state of that
shard, and the rules of the mode for applying what workers push.

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

import torch
import torch.nn as nn

from gradmesh.comm.compress import PushCodec
from gradmesh.comm.ps_wire import Kind, Message, Wire
from gradmesh.config.fault import auto_timeout
from gradmesh.engine.ps.accept import check_lookup, check_message
from gradmesh.engine.ps.apply import Applying
from gradmesh.engine.ps.segment import Dispatcher, Segment
from gradmesh.engine.ps.tables import ServerTables
from gradmesh.engine.ps.timing import RoleClock


class Server(Applying):
    def __init__(
        self,
        index: int,
        shard: tuple[int, int],
        buckets: list[tuple[int, int]],
        flat: torch.Tensor,
        wire: Wire,
        job,
        bound: int | None,
        servers_group,
        tables: list | None = None,
        dense_on_workers: bool = False,
    ):
        self.index, self.wire, self.job, self.bound = index, wire, job, bound
        self.dense_on_workers = dense_on_workers
        """Hybrid: the dense parameters are the workers' (all-reduced); this server holds tables only."""
        self.codec = PushCodec(job.train.compression)
        self.tables = ServerTables(
            tables or [], job.optimizer_kwargs.get("table_lr", job.optimizer_kwargs["lr"]), self.codec
        )
        self.low, self.high = shard
        self.buckets, self.servers_group = buckets, servers_group
        self.param = nn.Parameter(flat[self.low : self.high])  # a view: the mirror model sees every update
        self.optimizer = job.optimizer_class([self.param], **job.optimizer_kwargs)
        self.base_lr = self.optimizer.param_groups[0]["lr"]
        self.version = 0
        """Updates applied (async: shares; sync: steps since step 0)."""
        self.additive = bound is None or bound > 0
        """Each share applied as it arrives (async, ssp:K >= 1), not summed into its step's update."""
        self.spare: list[torch.Tensor] = []
        self.receiving: dict[int, torch.Tensor] = {}
        self.stats: dict[int, list[float]] = {}
        self.failed: set[int] = set()
        """Workers a send or receive failed with (they died), handled between messages."""
        self.slowest_share = 0.0
        """--step-timeout auto: the longest any share of the run was held, across segments."""
        self.clock = RoleClock("server")

    def state_bytes(self) -> int:
        slots = sum(
            v.numel() * v.element_size()
            for v in self.optimizer.state.get(self.param, {}).values()
            if isinstance(v, torch.Tensor)
        )
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
        overdue = (lambda: self.dispatcher.overdue(self.share_limit())) if timed else list
        wake = (lambda: (lookout is not None and lookout()) or bool(overdue())) if lookout or timed else None
        while not self._served():
            with self.clock.phase("idle"):
                got = self.wire.receive_any(wake)
            if got is not None:
                self.handle(*got)
            for worker in (lookout.take() if lookout else []) + sorted(self.failed):
                self.lose(worker)
            self.failed = set()
            self._stop_hung(overdue())
        self._end()

    def _begin(self, segment: Segment) -> None:
        """A segment's bookkeeping, fresh."""
        self.done: dict[int, dict[int, torch.Tensor]] = {}
        self.pulled: dict[int, list[int]] = {}
        self.waiting: list[tuple] = []  # (worker, clock, least version, the ids of a row request or None)
        self.accepted: set[tuple[int, int]] = set()
        self.log: dict[tuple[int, int], tuple[int, int, int, float]] = {}
        """Dispatcher: (clock, chunk) -> (worker, oldest version, samples, loss) of the commit that counted."""
        self.parked: list[int] = []
        self.bundled: set[int] = set()
        """Parked workers whose TAKE asked for this server's shard with the share."""
        self.told_done: set[int] = set()
        self.lost: set[int] = set()
        self.broken: set[int] = set()
        self.applied = 0
        self.dense_sq: dict[int, float] = {}
        """Hybrid, sync: clock -> the square of the workers' all-reduced dense gradient norm."""
        self.norms: dict[int, float] = {}
        """Sync: clock -> the global gradient norm the step was clipped by (0 with clipping off)."""
        self.frontier = segment.first  # every step before it wholly applied (a segment starts with none in flight)
        self.left = {clock: len(segment.chunks[clock]) for clock in segment.clocks}
        self.stats = {clock: [0.0, 0.0, 0.0, segment.started, 0.0, 0.0] for clock in segment.clocks}
        self.refused: set[int] = set()
        """Steps with a push that was not finite: nothing of them is applied here."""

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
            source, message = self.wire.receive_any()
            check_lookup(self, source, message, workers)
            if message.kind == Kind.FINISHED:
                break
            ids = self.tables.message(self.wire, source, message)
            self.tables.answer(self.wire, source, ids, self.version, 0.0)
        self.wire.settle()

    def _served(self) -> bool:
        if self.applied < self.segment.total_chunks:
            return False
        return self.dispatcher is None or set(range(self.workers)) - self.lost <= self.told_done

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
            self.waiting.append((source, message.clock, message.version, None))
            self.answer_pulls()
        elif kind == Kind.CANCEL:
            if any(entry[0] == source for entry in self.waiting):
                self.waiting = [entry for entry in self.waiting if entry[0] != source]
                self.wire.send(source, Message(Kind.RETRY))
        elif kind == Kind.TAKE:
            self.parked.append(source)
            if message.version:
                self.bundled.add(source)
            self.serve_parked()
        else:  # RETURN (check_message let through only what is handled here)
            self.dispatcher.give_back(source, (message.clock, message.chunk))
            self.serve_parked()

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
            self.waiting.append((source, message.clock, message.version, wanted))
            self.answer_pulls()

    def share_limit(self) -> float:
        """--step-timeout in seconds; auto: from the longest any share of the run was held."""
        if self.job.step_timeout > 0:
            return self.job.step_timeout
        self.slowest_share = max(self.slowest_share, self.dispatcher.longest)
        return auto_timeout(self.slowest_share)

    def _stop_hung(self, overdue: list[tuple[int, tuple[int, int]]]) -> None:
        """Dispatcher, --step-timeout: a worker holding a share that long without committing it
        hangs. Under in-place recovery the launcher stops it and the others take its shares;
        otherwise the job ends here (or restarts, under --recovery restart) rather than wait."""
        for worker, (clock, _) in overdue:
            self.dispatcher.hung.add(worker)
            what = (
                f"parameter server: worker rank {worker} has held a share of step {clock} for more than "
                f"--step-timeout {self.share_limit():g} s without committing it"
            )
            if self.job.membership is None:
                raise RuntimeError(what + "; it hangs (--recovery inplace would go on without it)")
            print(f"gradmesh: {what}: it hangs and is stopped", file=sys.stderr, flush=True)
            self.job.membership.evict(self.identities[worker])

    def serve_parked(self) -> None:
        """Dispatcher: hand each waiting worker a share; once all are committed, tell it so."""
        still = []
        for worker in self.parked:
            task = self.dispatcher.next(worker)
            if task is not None:
                self._hand(worker, task)
            elif self.dispatcher.finished:
                self.wire.send(worker, Message(Kind.DONE, norm_sq=self._norm_sq(self.segment.clocks[-1])))
                self.told_done.add(worker)
                self.bundled.discard(worker)
            else:  # the others still hold the last shares: one may die and leave its share to this one
                still.append(worker)
        self.parked = still

    def _hand(self, worker: int, task: tuple[int, int]) -> None:
        """TASK, and this server's shard with it when the worker asked so and the bound allows."""
        bundled = worker in self.bundled and (self.bound is None or self.frontier >= task[0] - self.bound)
        self.bundled.discard(worker)
        self.wire.send(worker, Message(Kind.TASK, clock=task[0], chunk=task[1], version=int(bundled)))
        if bundled:
            self._send_params(worker)

    def _send_params(self, worker: int) -> None:
        level = self.version if self.bound is None else self.frontier
        self.wire.send(worker, Message(Kind.PARAMS, clock=self.version, version=level), self.param.detach())

    def _norm_sq(self, clock: int) -> float:
        """The square of step `clock`'s global gradient norm, once applied (sync; else 0)."""
        return self.norms.get(clock, 0.0) ** 2

    def lose(self, worker: int) -> None:
        """A worker died: what it pushed is dropped; the dispatcher hands its shares out again."""
        if worker in self.lost:
            return
        self.lost.add(worker)  # its pushes are kept: a commit it sent before it died may still be on the way
        self.waiting = [entry for entry in self.waiting if entry[0] != worker]
        if self.dispatcher:
            self.dispatcher.lose(worker)
            self.parked = [w for w in self.parked if w != worker]
            self.bundled.discard(worker)
            self.serve_parked()
            self.answer_pulls()

    def answer_pulls(self) -> None:
        still = []
        for worker, clock, least, rows in self.waiting:
            if self.bound is None or self.frontier >= least:
                if rows is not None:
                    level = self.version if self.bound is None else self.frontier
                    self.tables.answer(self.wire, worker, rows, level, self._norm_sq(clock - 1))
                    continue
                self._send_params(worker)
            elif self.dispatcher and self.dispatcher.earlier_than(worker, clock):
                # a dead worker's share of an earlier step is back in line: this worker must do it
                # (waiting for it would wait forever), so it gives its own share back
                self.wire.send(worker, Message(Kind.RETRY))
            else:
                still.append((worker, clock, least, rows))
        self.waiting = still
