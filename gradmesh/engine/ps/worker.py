"""A parameter-server worker: take a share, pull the parameters, compute, push the gradient.

The model's parameters and gradients are views into two flat buffers laid out as the servers
shard them, so a pull receives each server's shard straight into the parameters and a push
sends a range of the gradient buffer with no copy. Each server's shard is cut into buckets; a
hook on every parameter's accumulated gradient pushes a bucket as soon as backward has produced
all of it, so pushing overlaps the rest of backward.
"""

import time
from typing import cast

import torch
import torch.nn as nn

from gradmesh.comm.compress import PushCodec
from gradmesh.comm.ps_records import Commit, Params, Pull, Push, Return, Take, Task, bare
from gradmesh.comm.ps_wire import Kind, Message, Wire
from gradmesh.data import fetch
from gradmesh.data.sampler import split_evenly
from gradmesh.engine.base import to_device
from gradmesh.engine.ps.hybrid import DenseReplica
from gradmesh.engine.ps.lookup import WorkerTables
from gradmesh.engine.ps.mode import Mode
from gradmesh.engine.ps.predict import WeightPrediction
from gradmesh.engine.ps.segment import Segment
from gradmesh.engine.ps.timing import RoleClock
from gradmesh.parallel.ps import Layout, Roles

Share = tuple[int, int, list[int] | None]
"""(clock, chunk, each server's version the share was computed from; hybrid: None, the share's
first row request hears them, `WorkerTables.versions`)."""


def flat_views(
    params: list[nn.Parameter], device: torch.device, gradients: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(parameters, gradients): flat buffers the parameters (and gradients) now view."""
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(device)
    grads = torch.zeros_like(flat) if gradients else None
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        if grads is not None:
            p.grad = grads[offset : offset + n].view_as(p)
        offset += n
    return flat, grads


class Worker:
    def __init__(
        self,
        roles: Roles,
        layout: Layout,
        model: nn.Module,
        params: list[nn.Parameter],
        flat,
        grads,
        wire: Wire,
        job,
        mode: Mode,
        bucket_elements: int,
        device: torch.device,
        clock: RoleClock,
        tables: WorkerTables | None = None,
        replica: DenseReplica | None = None,
        prediction: WeightPrediction | None = None,
    ):
        self.roles, self.layout, self.model = roles, layout, model
        self.flat, self.grads, self.wire, self.job, self.mode, self.device = flat, grads, wire, job, mode, device
        self.replica = replica
        """Hybrid: the dense part all-reduced among the workers, not pushed."""
        self.prediction = prediction
        """Where `Mode.predicts`: the pulled parameters moved to where the gradient will land."""
        self.codec = PushCodec(job.train.compression)
        self._wire_buckets(roles, layout, bucket_elements, replica)
        self.missing = list(self.needed)
        self.pushing, self.task = False, cast(Share, (0, 0, None))
        self.compute_s = 0.0
        self.clock = clock
        for index, p in enumerate(params):  # the flat vector's; sparse tables push their rows after backward
            p.register_post_accumulate_grad_hook(lambda p, index=index: self._produced(index))
        self.tables = tables
        """The sparse tables' rows of the share being computed (None: the model has no table)."""

    def _wire_buckets(self, roles: Roles, layout: Layout, bucket_elements: int, replica) -> None:
        """The buckets gradients are pushed in (server, index, range) and, per parameter, the buckets
        waiting for its gradient."""
        self.buckets: list[tuple[int | None, int, int, int]] = [
            (s, k, low, high)
            for s in range(roles.servers)
            for k, (low, high) in enumerate(layout.buckets(s, bucket_elements))
        ]
        if replica is not None:  # server None: all-reduced among the workers
            self.buckets = [(None, k, low, high) for k, (low, high) in enumerate(replica.buckets(bucket_elements))]
        self.of_param: list[list[int]] = [[] for _ in layout.numels]
        self.needed = []  # per bucket: the parameters whose gradients it waits for
        for b, (_, _, low, high) in enumerate(self.buckets):
            overlapping = layout.params_in(low, high)
            self.needed.append(len(overlapping))
            for index in overlapping:
                self.of_param[index].append(b)

    def rewire(self, wire: Wire, roles: Roles) -> None:
        """In-place recovery: the survivors' new wire and ranks (the same roles)."""
        self.wire, self.roles = wire, roles
        if self.tables:
            self.tables.wire, self.tables.roles = wire, roles

    def run(self, segment: Segment, probe) -> None:
        """Take shares until the dispatcher says every share of the segment is committed.

        Static dispatch without in-place recovery: the next share is asked for as soon as this
        one is known (its answer arrives while this one computes); the dispatcher holds a TAKE it
        cannot answer yet, so a worker never holds two shares it could not finish."""
        dispatcher, asked = self.roles.dispatcher, None
        ahead = (self.mode.static_dispatch or self.replica is not None) and self.job.membership is None
        while True:
            with self.clock.phase("wait"):
                if asked is None:  # not asked ahead: the parameters may come with the share
                    self.wire.send(dispatcher, Take(with_params=self.replica is None).message())
                    asked = self.wire.expect(dispatcher, answer=True)
                asked[1].wait()
                reply, asked = Message.decode(asked[0], dispatcher).expect(dispatcher, Kind.TASK, Kind.DONE), None
            if reply.kind == Kind.DONE:
                if self.replica:
                    self.replica.catch_up(reply.norm_sq)
                break
            segment.check_share(dispatcher, reply)
            reply.check(dispatcher, "version", reply.version in (0, 1), "0 or 1")
            if ahead:
                self.wire.send(dispatcher, Take(with_params=False).message())
                asked = self.wire.expect(dispatcher, answer=True)
            task = Task.read(reply)
            least = self.mode.least_version(task.clock)
            if self.replica:  # hybrid: the share's first row request is its pull (`WorkerTables.gate`)
                with self.clock.phase("push"):
                    self.wire.settle()
                cast(WorkerTables, self.tables).gate, versions = (task.clock, least), None
            else:
                versions = self.pull(task.clock, least, bundled=task.params_follow)
            if versions is None and not self.replica:  # an earlier share, lost with a dead worker, comes first
                self.wire.send(dispatcher, Return(task.clock, task.chunk).message())
                continue
            indices = segment.indices(task.clock, task.chunk)
            self.compute(indices, segment.batch(task.clock).size, (task.clock, task.chunk, versions), probe)
            self.clock.samples += len(indices)
        with self.clock.phase("push"):
            self.wire.settle()

    def pull(self, clock: int, least: int, bundled: bool = False) -> list[int] | None:
        """Every server's shard, once its version is at least `least`: each server's version;
        None when the dispatcher says to give the share of step `clock` back instead (`bundled`: the
        dispatcher sent its shard with the share, unasked). (Hybrid
        servers hold no dense shard: their pull rides on the share's first row request.)"""
        with self.clock.phase("push"):
            self.wire.settle()
        with self.clock.phase("pull"):
            return self._pull(clock, least, bundled)

    def _pull(self, clock: int, least: int, bundled: bool) -> list[int] | None:
        servers = [self.roles.server_rank(s) for s in range(self.roles.servers)]
        heads = []
        for s, server in enumerate(servers):
            if not (bundled and s == 0):
                self.wire.send(server, Pull(clock, least).message())
            heads.append(self.wire.expect(server))
        versions, updates, payloads, retry = [], [], [], False
        for s, (head, work) in enumerate(heads):  # the dispatcher (server 0) first: only it says RETRY
            work.wait()
            reply = Message.decode(head, servers[s]).expect(servers[s], Kind.PARAMS, Kind.RETRY)
            if reply.kind == Kind.RETRY:
                if not retry:  # every other server answers once more: PARAMS if it already had, else RETRY
                    for later in servers[s + 1 :]:
                        self.wire.send(later, bare(Kind.CANCEL))
                retry = True
                continue
            low, high = self.layout.shard(s)
            payloads.append(self.wire.payload_from(servers[s], self.flat[low:high]))
            params = Params.read(reply)
            versions.append(params.version)
            updates.append(params.updates)
        for work in payloads:
            work.wait()
        if retry:
            return None
        if self.prediction:
            for s, count in enumerate(updates):
                self.prediction.pulled(s, count)
        return versions

    def compute(self, indices: list[int], batch_size: int, task: Share, probe) -> float:
        """Forward and backward of one share (weighted 1 / global batch, as data parallelism
        weights it); its buckets go out as backward produces them, then a commit to every server."""
        self.grads.zero_()
        self.task, self.missing = task, list(self.needed)
        probe.reached(task[0])
        micro = [m for m in split_evenly(indices, self.job.train.grad_accum) if m]
        with self.clock.phase("compute"):  # an injected straggler shows as slow compute...
            probe.straggle(self.compute_s)
        loss_sum, started = 0.0, time.perf_counter()  # ...but its delay is not part of its own time
        if self.tables:
            self.tables.active = True
        for i, part in enumerate(micro):
            with self.clock.phase("data"):
                data = to_device(fetch(self.job.dataset, part), self.device)
            with self.clock.phase("compute"):
                losses = self.job.loss_fn(self.model, data)
                losses = probe.spoil(losses, task[0] + 1) if i == 0 else losses  # a clock is its step - 1
                self.pushing = i == len(micro) - 1
                (losses.sum() / batch_size).backward()
                loss_sum += losses.detach().sum().item()
        self.pushing = False
        if self.tables:
            self.tables.active = False
        self.compute_s = time.perf_counter() - started
        for b in range(len(self.buckets)):  # parameters that got no gradient (unused this step) still push zeros
            if self.missing[b] > 0:
                self.missing[b] = 0
                self._push(b)
        tables_sq = 0.0
        if self.tables:
            with self.clock.phase("push"):
                tables_sq = self.tables.push()
        if self.replica:
            norm_sq = self._reduced(task[0], tables_sq, len(indices) / batch_size)
        else:
            norm_sq = self.grads.double().pow(2).sum().item() + tables_sq
        self._commit(task, len(indices), loss_sum, norm_sq)
        return loss_sum

    def _reduced(self, clock: int, tables_sq: float, share: float) -> float:
        """Hybrid: the dense gradient reduced among the workers and its step taken or deferred;
        what the commit tells the servers (sync: the dense part's square; ssp: the estimated global
        square, scaled as a share's own norm is)."""
        replica = cast(DenseReplica, self.replica)
        with self.clock.phase("push"):
            dense_sq = replica.reduced()
            global_sq = 0.0 if replica.deferred else replica.estimate_sq(dense_sq, tables_sq)
        with self.clock.phase("compute"):
            replica.computed(clock, global_sq)
        return dense_sq if replica.deferred else global_sq * share * share

    def _commit(self, task: Share, samples: int, loss_sum: float, norm_sq: float) -> None:
        clock, chunk, pulled = task
        versions = pulled or cast(WorkerTables, self.tables).versions  # hybrid: what its first row request heard
        commits = [
            Commit(clock, chunk, version, samples, oldest=min(versions), loss=loss_sum, norm_sq=norm_sq).message()
            for version in versions
        ]
        for s in range(1, self.roles.servers):
            self.wire.send(self.roles.server_rank(s), commits[s])
        if self.roles.servers > 1:
            # The dispatcher hears of a commit only once every other server has it: a share the
            # dispatcher counts as done is never handed out again, so no server may lack it.
            with self.clock.phase("push"):
                self.wire.settle()
        self.wire.send(self.roles.dispatcher, commits[0])

    def _produced(self, index: int) -> None:
        if not self.pushing:
            return
        for b in self.of_param[index]:
            self.missing[b] -= 1
            if self.missing[b] == 0:
                self._push(b)

    def _push(self, bucket: int) -> None:
        server, k, low, high = self.buckets[bucket]
        if server is None:
            cast(DenseReplica, self.replica).reduce(low, high)
            return
        clock, chunk, pulled = self.task
        versions = cast(list[int], pulled)  # pushed to a server: the share was pulled
        self.wire.send(
            self.roles.server_rank(server),
            Push(clock, chunk, pulled=versions[server], bucket=k).message(),
            self.codec.encode(self.grads[low:high]),
        )  # fp32: a view, else a copy the wire keeps until sent
