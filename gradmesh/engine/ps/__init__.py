"""The parameter-server engine: servers hold the parameters sharded, workers compute gradients.

Ranks play roles (`gradmesh.parallel.ps.Roles`) and do not step together: the loop hands the
engine a segment of global batches (`run_segment`), the servers serve and the workers work
until every share of it is applied, and then every rank reports every step of the segment to
the services at once. Between segments nothing is in flight, so checkpoints, evaluation and the
metrics gather see exactly the model after the segment's last step. Checkpoints hold the whole
model and optimizer state under parameter names, as data parallelism writes them, so they
reshard to another number of servers or to any other strategy.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from gradmesh.comm.ps_wire import Wire
from gradmesh.data import GlobalBatch
from gradmesh.engine.base import Job, StepOutcome, lr_factor, peak_memory_bytes
from gradmesh.engine.ps.segment import Dispatcher, Segment
from gradmesh.engine.ps.server import Server
from gradmesh.engine.ps.slots import OptimizerSlots
from gradmesh.engine.ps.timing import roles_row
from gradmesh.engine.ps.worker import Share, Worker, flat_views
from gradmesh.parallel.ps import Roles, layout_of
from gradmesh.parallel.registry import Plan
from gradmesh.topology import Topology


class ParameterServerEngine:
    lockstep = False

    def __init__(self, topology: Topology, plan: Plan, model: nn.Module, job: Job):
        self.topology, self.plan, self.job = topology, plan, job
        self.roles = Roles(topology.world_size, job.ps.servers)
        self.bound = job.ps.bound
        self.model = self.plain = model.to(topology.device)
        self.layout = layout_of(model, self.roles.servers)
        server_ranks = [self.roles.server_rank(s) for s in range(self.roles.servers)]
        servers_group = dist.new_group(server_ranks, backend="gloo")  # every rank takes part in making it
        self.wire = Wire(topology.side_group("ps"), topology.group("world"), job.counter)
        self.slots = OptimizerSlots(job.optimizer_class, job.optimizer_kwargs)
        is_server = self.roles.is_server(topology.rank)
        topology.role = "server" if is_server else "worker"
        self.flat, grads = flat_views(model, topology.device, gradients=not is_server)
        bucket = max(1, int(job.train.bucket_mb * 2**20) // self.flat.element_size())
        self.server = self.worker = self.optimizer = None
        if is_server:
            index = topology.rank - self.roles.workers
            self.server = Server(index, self.layout.shard(index), self.layout.buckets(index, bucket), self.flat,
                                 self.wire, job, self.bound, servers_group)
            self.optimizer = self.server.optimizer
        else:
            self.worker = Worker(self.roles, self.layout, model, self.flat, grads, self.wire, job,
                                 self.bound, bucket, topology.device)
        self.positioned = False

    # -- segments --------------------------------------------------------------------------------

    def run_segment(self, batches: list[GlobalBatch], probe) -> list[tuple[StepOutcome, float]]:
        """Every step of `batches`, as this rank saw it: (outcome, seconds the step took)."""
        segment = Segment(batches, self.roles.workers)
        shares: dict[int, Share] = {}
        if self.server:
            if not self.positioned:  # versions count from the step the run starts at (0, or a checkpoint's)
                self.server.version = segment.first
            is_dispatcher = self.topology.rank == self.roles.dispatcher
            self.server.serve(segment, Dispatcher(segment, static=self.job.ps.mode == "sync") if is_dispatcher else None)
        else:
            shares = self.worker.run(segment, probe)
        self.positioned = True
        roles = self._gather_roles(len(segment.clocks))
        return self._outcomes(segment, shares, self._gather_stats(segment), roles)

    def _gather_roles(self, steps: int) -> dict:
        """Every rank's role breakdown of the segment (`gradmesh.engine.ps.timing`), per step."""
        clock = (self.server or self.worker).clock
        mine = torch.tensor(clock.take(), dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(self.topology.world_size)]
        dist.all_gather(gathered, mine, group=self.wire.header_group)
        return roles_row([g.tolist() for g in gathered], steps)

    def _gather_stats(self, segment: Segment) -> torch.Tensor:
        """Per step, over every server: staleness sum, count, max, when the step was applied, and
        the bytes every rank sent in the segment (spread evenly over its steps)."""
        stats = torch.zeros(len(segment.clocks), 5, dtype=torch.float64)
        if self.server:
            stats[:, :4] = torch.tensor([self.server.stats[clock] for clock in segment.clocks], dtype=torch.float64)
        sent = self.job.counter.take()[0] if self.job.counter is not None else 0
        group = self.wire.header_group
        sums = torch.cat([stats[:, :2].reshape(-1), torch.tensor([float(sent)], dtype=torch.float64)])
        highs = stats[:, 2:4].contiguous()
        dist.all_reduce(sums, group=group)
        dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group)
        stats[:, :2], stats[:, 2:4] = sums[:-1].view(-1, 2), highs
        stats[:, 4] = sums[-1] / len(segment.clocks)
        return stats

    def _outcomes(self, segment: Segment, shares: dict[int, Share], stats: torch.Tensor, roles: dict):
        held = self.state_bytes()
        peak = peak_memory_bytes(self.topology.device)
        before, found = segment.started, []
        for i, batch in enumerate(segment.batches):
            share = shares.get(batch.step, Share())
            stale_sum, count, stale_max, applied, wire = stats[i].tolist()
            figures = torch.tensor([share.loss, share.samples, held, peak], dtype=torch.float64)
            lr = self.job.optimizer_kwargs["lr"] * lr_factor(batch.step, self.job.train)
            outcome = StepOutcome(batch, lr, share.indices, figures,
                                  row={"staleness_max": int(stale_max), "staleness_mean": stale_sum / max(count, 1),
                                       "wire_bytes": int(wire), "roles": roles},
                                  detail={"versions": share.versions} if self.worker else {})
            found.append((outcome, max(applied - before, 1e-9)))
            before = max(before, applied)
        return found

    def state_bytes(self) -> int:
        if self.server:
            return self.server.state_bytes()
        return 2 * self.flat.numel() * self.flat.element_size()  # parameters and gradients

    # -- the whole model: evaluation, checkpoints, final weights ---------------------------------

    def refresh(self) -> None:
        """Collective: every rank's model gets the servers' current parameters."""
        for s in range(self.roles.servers):
            low, high = self.layout.shard(s)
            dist.broadcast(self.flat[low:high], src=self.roles.server_rank(s), group=self.topology.group("world"))

    def eval_model(self) -> nn.Module:
        self.refresh()
        return self.model

    def full_state(self) -> dict[str, torch.Tensor]:
        self.refresh()
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def replica(self) -> None:
        return None  # servers hold shards; workers' copies differ between pulls

    def start(self, run_dir, show: bool) -> None:
        pass

    def checkpoint_state(self, for_load: bool = False) -> dict:
        """Collective: {"model", "optim"} under parameter names, whole tensors, as ddp writes them."""
        names = [name for name, _ in self.model.named_parameters()]
        if for_load:
            return {"model": get_model_state_dict(self.model), "optim": self.slots.template(self.model)}
        self.refresh()
        slots = self.slots.gather(self.server.optimizer.state.get(self.server.param, {}) if self.server else None,
                                  self.layout, self.roles, self.wire, self.flat)
        return {"model": get_model_state_dict(self.model), "optim": self.slots.named(slots, names, self.layout)}

    def install_checkpoint(self, payload: dict) -> None:
        set_model_state_dict(self.model, payload["model"])
        if self.server:
            names = [name for name, _ in self.model.named_parameters()]
            state = self.slots.shard_of(payload["optim"]["state"], names, (self.server.low, self.server.high))
            if state:
                self.server.optimizer.state[self.server.param] = state
