"""The parameter-server engine: servers hold the parameters sharded, workers compute gradients.

Ranks play roles (`gradmesh.parallel.ps.Roles`) and do not step together: the loop hands the
engine a segment of global batches (`run_segment`), the servers serve and the workers work
until every share of it is applied, and then every rank reports every step of the segment to
the services at once. Between segments nothing is in flight, so checkpoints, evaluation and the
metrics gather see exactly the model after the segment's last step. Checkpoints hold the whole
model and optimizer state under parameter names, as data parallelism writes them, so they
reshard to another number of servers or to any other strategy.

The hybrid strategy is this engine with the dense parameters kept on the workers and
all-reduced among them (`gradmesh.engine.ps.hybrid`); its servers hold only the sparse tables.
"""

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.comm.compress import PushCodec
from gradmesh.comm.ps_records import bare
from gradmesh.comm.ps_wire import Kind, Wire
from gradmesh.comm.reducer import CommCounter
from gradmesh.config.ps import PSConfig
from gradmesh.data import GlobalBatch
from gradmesh.engine.base import Job, StepOutcome
from gradmesh.engine.ps.dispatch import LogEntry
from gradmesh.engine.ps.hybrid import DenseReplica
from gradmesh.engine.ps.lookup import WorkerTables
from gradmesh.engine.ps.mode import Mode
from gradmesh.engine.ps.predict import WeightPrediction
from gradmesh.engine.ps.report import Done, Lookout, SegmentReport
from gradmesh.engine.ps.segment import Dispatcher, Segment
from gradmesh.engine.ps.server import Server
from gradmesh.engine.ps.slots import OptimizerSlots
from gradmesh.engine.ps.tables import TableShard
from gradmesh.engine.ps.timing import RoleClock
from gradmesh.engine.ps.whole import WholeTables
from gradmesh.engine.ps.worker import Worker, flat_views
from gradmesh.parallel.options import DEFAULT_BUCKET_MB
from gradmesh.parallel.ps import Roles, dense_parameters, layout_of, sparse_tables, to_device
from gradmesh.parallel.registry import Plan
from gradmesh.topology import Topology


class ParameterServerEngine(SegmentReport):
    """The engine protocol of an engine whose ranks do not step together (`lockstep` False).

    In place of `step` / `abandon_step` / `rebucket` (which the loop calls only on lockstep
    engines) it runs segments, in two halves so that in-place recovery can regroup between them:

    - `work_segment(batches, probe) -> Done`: point to point until every share of the segment is
      applied; a worker that dies meanwhile leaves its shares to the others. Not collective.
    - `report_segment(done) -> [(StepOutcome, seconds)]`: collective over every rank (after a
      regroup, the survivors): each step of the segment as this rank reports it.
    - `run_segment(batches, probe)`: the two in a row (the loop's call without recovery).

    The rest is the collective engines' protocol: `checkpoint_state`, `install_checkpoint`,
    `eval_model` (and `eval_done`), `full_state`, `replica`, `start`, `rebuild`, `state_bytes`."""

    lockstep = False

    def __init__(self, topology: Topology, plan: Plan, model: nn.Module, job: Job):
        self.topology, self.plan, self.job = topology, plan, job
        self.membership: Any = job.membership  # in-place recovery's (`gradmesh.fault`, a layer above), or None
        self.model = self.plain = to_device(model, topology.device)
        self.slots = OptimizerSlots(job.optimizer_class, job.optimizer_kwargs)
        self.ps = cast(PSConfig, job.ps)  # `Job.ps` is typed object; this engine is built with a PSConfig
        self.mode = Mode.parse(self.ps.mode)
        self.roles = Roles(topology.world_size, self.ps.servers)
        self.hybrid = bool(plan.alone and plan.alone.dense_on_workers)  # ps and hybrid run alone, never composed
        """The dense parameters replicated on the workers, all-reduced among them (`gradmesh.engine.ps.hybrid`)."""
        self.split = self.mode.shares_per_worker(self.ps.shares, self.hybrid)
        """Shares per worker and step (`ps.shares`; sync and hybrid: one)."""
        self.layout = layout_of(model, self.roles.servers, on_servers=not self.hybrid)
        is_server = self.roles.is_server(topology.rank)
        topology.role = "server" if is_server else "worker"
        self.dense, self.sparse = dense_parameters(model), sparse_tables(model)
        self.flat, grads = flat_views([p for _, p in self.dense], topology.device, gradients=not is_server)
        bucket = max(1, int((job.train.bucket_mb or DEFAULT_BUCKET_MB) * 2**20) // self.flat.element_size())
        servers_group = self._connect(topology)
        self.server: Server | None = None
        self.worker: Worker | None = None
        self.optimizer = None
        if is_server:
            self.server = self._build_server(topology, model, job, bucket, servers_group)
            self.optimizer = self.server.optimizer
        else:
            self.worker = self._build_worker(topology, model, job, bucket, grads)
            self.optimizer = self.worker.replica.optimizer if self.worker.replica else None
        self.whole = WholeTables(self.sparse, self.roles, topology.device)
        self.whole.release()  # no rank holds a whole table while training
        self.positioned = False

    def _build_server(self, topology: Topology, model: nn.Module, job: Job, bucket: int, servers_group) -> Server:
        index = topology.rank - self.roles.workers
        init_rows = cast(Callable[..., torch.Tensor], getattr(model, "init_rows", None))  # a sparse model's
        shards = [
            TableShard(
                table,
                self.roles.servers,
                index,
                lambda low, high, t=t: init_rows(t, low, high),
                topology.device,
                name,
            )
            for t, (name, table) in enumerate(self.sparse)
        ]
        shard, buckets = self.layout.shard(index), self.layout.buckets(index, bucket)
        return Server(index, shard, buckets, self.flat, self.wire, job, self.mode, servers_group, shards, self.hybrid)

    def _build_worker(self, topology: Topology, model: nn.Module, job: Job, bucket: int, grads) -> Worker:
        clock = RoleClock("worker")
        replica = DenseReplica(self.flat, grads, self.workers_group, job, self.mode.lockstep) if self.hybrid else None
        tables = None
        if self.sparse:
            codec, heard = PushCodec(job.train.compression), replica.catch_up if replica else None
            tables = WorkerTables(model, self.sparse, self.roles, self.wire, codec, clock, heard)
        prediction = None
        if self.mode.predicts(self.ps.predict, self.hybrid):
            prediction = WeightPrediction(self.flat, [self.layout.shard(s) for s in range(self.roles.servers)])
        dense = [p for _, p in self.dense]
        return Worker(
            self.roles, self.layout, model, dense, self.flat, grads, self.wire, job, self.mode, bucket,
            topology.device, clock, tables, replica, prediction,
        )  # fmt: skip

    def _connect(self, topology: Topology):
        """The wire and the identities of the group's ranks; the servers' own group."""
        self.topology, self.roles = topology, Roles(topology.world_size, self.roles.servers)
        self.identities = list(self.membership.members) if self.membership else list(range(topology.world_size))
        server_ranks = [self.roles.server_rank(s) for s in range(self.roles.servers)]
        servers_group = dist.new_group(server_ranks, backend="gloo")  # every rank takes part in making it
        self.workers_group = dist.new_group(list(range(self.roles.workers))) if self.hybrid else None
        self.wire = Wire(topology.side_group("ps", waits_on_peers=True), topology.group("world"), self.job.counter)
        return servers_group

    def rebuild(self, topology: Topology) -> None:
        """In-place recovery after a worker died: the same roles over the survivors' new group
        (the servers are the last ranks still; a server's loss restarts the job instead)."""
        servers_group = self._connect(topology)
        if self.server:
            self.server.rewire(self.wire, servers_group)
        if self.worker:
            self.worker.rewire(self.wire, self.roles)

    def _lookout(self):
        """A server's view of workers dying (in-place recovery): the ranks of those not yet seen."""
        if self.membership is None:
            return None
        return Lookout(self.membership, self.identities)

    # -- segments --------------------------------------------------------------------------------

    def run_segment(self, batches: list[GlobalBatch], probe) -> list[tuple[StepOutcome, float]]:
        """Every step of `batches`, as this rank saw it: (outcome, seconds the step took)."""
        return self.report_segment(self.work_segment(batches, probe))

    def work_segment(self, batches: list[GlobalBatch], probe) -> "Done":
        """Point to point until every share of the segment is applied; workers that die meanwhile
        leave their shares to the others. What it did, for `report_segment`."""
        segment = Segment(batches, self.roles.workers, self.split)
        self.whole.release()  # evaluation or a checkpoint may have gathered them
        log = None
        if self.server:
            if not self.positioned:  # versions count from the step the run starts at (0, or a checkpoint's)
                self.server.updates.start_at(segment.first)
            is_dispatcher = self.topology.rank == self.roles.dispatcher
            static = self.mode.static_dispatch or self.hybrid  # hybrid: every worker in every step's all-reduce
            dispatcher = Dispatcher(segment, static=static) if is_dispatcher else None
            self.server.serve(segment, dispatcher, self.identities, probe, self._lookout())
            if self.server.desk:
                log = self._log_rows(self.server.desk.log, segment)
        if self.worker:
            self.worker.run(segment, probe)
        self.positioned = True
        clock = self.server.clock if self.server else cast(Worker, self.worker).clock
        sent = cast(CommCounter, self.job.counter).take()[0] if self.job.counter is not None else 0
        stats = self.server.stats if self.server else None
        return Done(segment, log, stats, torch.tensor(clock.take(), dtype=torch.float64), sent)

    def _log_rows(self, entries: dict[tuple[int, int], LogEntry], segment: Segment) -> torch.Tensor:
        """The dispatcher's log as rows (clock, chunk, worker identity, version, samples, loss), in
        global order: one per share, from the commit that counted."""
        rows = []
        for clock, chunk in segment.order():
            worker, oldest, samples, loss = entries[(clock, chunk)]
            rows.append([clock, chunk, self.identities[worker], oldest, samples, loss])
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 6)

    def _dense_holder(self) -> Server | DenseReplica | None:
        """Who holds dense parameters with optimizer state here: a server, or a hybrid worker."""
        return self.server or (self.worker.replica if self.worker else None)

    def state_bytes(self) -> int:
        holder = self._dense_holder()
        if holder:
            return holder.state_bytes()
        return 2 * self.flat.numel() * self.flat.element_size()  # parameters and gradients

    # -- the whole model: evaluation, checkpoints, final weights ---------------------------------

    def refresh(self) -> None:
        """Collective: every rank's dense parameters are the current ones (tables: `WholeTables`)."""
        group = self.topology.group("world")
        for holder, low, high in self.dense_pieces():
            dist.broadcast(self.flat[low:high], src=holder, group=group)

    def _model_state(self, tables: bool) -> dict[str, torch.Tensor]:
        """The model's state dict; the sparse tables' entries only where `tables` (whole there)."""
        skip = set() if tables else self.whole.keys()
        return {name: value for name, value in self.model.state_dict().items() if name not in skip}

    def dense_pieces(self) -> list[tuple[int, int, int]]:
        """(rank, low, high): who holds which range of the dense flat vector and its optimizer
        state (hybrid: every worker the whole; rank 0 speaks for them)."""
        if self.hybrid:
            return [(0, 0, self.flat.numel())]
        return [(self.roles.server_rank(s), *self.layout.shard(s)) for s in range(self.roles.servers)]

    def eval_model(self) -> nn.Module | None:
        """Collective. With sparse tables only rank 0 evaluates: its tables pull the rows each
        batch looks up, which the servers answer until it is done (`eval_done`); the others
        return None. Without tables every rank evaluates the refreshed model."""
        self.refresh()
        if not self.sparse:
            return self.model
        if self.server:
            self.server.serve_lookups(self.roles.workers)
            return None
        if self.topology.rank != 0 or not self.worker or not self.worker.tables:
            return None
        self.worker.tables.evaluating = True
        return self.model

    def eval_done(self) -> None:
        if self.worker and self.worker.tables and self.topology.rank == 0:
            self.worker.tables.evaluating = False
            for s in range(self.roles.servers):
                self.wire.send(self.roles.server_rank(s), bare(Kind.FINISHED))
            self.wire.settle()
            self.whole.release()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model on rank 0 (the tables collected there alone)."""
        self.refresh()
        me = self.topology.rank
        self.whole.collect(self.server.tables.shards if self.server else None, 0, me, self.topology.group("world"))
        state = {name: value.detach().cpu() for name, value in self._model_state(tables=me == 0).items()}
        self.whole.release()
        return state

    def replica(self) -> None:
        return None  # servers hold shards; workers' copies differ between pulls

    def start(self, run_dir, show: bool) -> None:
        pass

    def checkpoint_state(self, for_load: bool = False) -> dict:
        """Collective: {"model", "optim"} under parameter names, whole tensors, as ddp writes them
        (a sparse table's state as row-wise Adagrad keeps it: "sum" per row and "step")."""
        names = [name for name, _ in self.dense]
        if for_load:  # the servers load the tables whole and keep their ranges (`install_checkpoint`)
            optim = self.slots.template(self.dense)
            if self.server:
                optim["state"].update(self.whole.template())
                self.whole.make_room()
            return {"model": self._model_state(tables=bool(self.server)), "optim": optim}
        self.refresh()
        holder = self._dense_holder()
        slots = self.slots.gather(
            holder.optimizer.state.get(holder.param, {}) if holder else None, self.dense_pieces(), self.wire, self.flat
        )
        optim = self.slots.named(slots, names, self.layout)
        # the tables whole on the first server alone: its part of the checkpoint holds them
        first, me = self.roles.server_rank(0), self.topology.rank
        shards = self.server.tables.shards if self.server else None
        self.whole.collect(shards, first, me, self.topology.group("world"))
        optim["state"].update(self.whole.state(shards, first, me, self.topology.group("world")))
        return {"model": self._model_state(tables=me == first), "optim": optim}

    def install_checkpoint(self, payload: dict) -> None:
        missing, _ = self.model.load_state_dict(payload["model"], strict=False)
        assert set(missing) <= self.whole.keys(), missing  # only the tables, which workers do not load
        holder = self._dense_holder()
        if holder:
            names = [name for name, _ in self.dense]
            piece = (self.server.low, self.server.high) if self.server else (0, self.flat.numel())
            state = self.slots.shard_of(payload["optim"]["state"], names, piece)
            if state:
                holder.optimizer.state[holder.param] = state
        if self.server:
            self.whole.install(self.server.tables.shards, payload["optim"]["state"])
