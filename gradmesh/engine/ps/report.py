"""What a segment leaves for its report: a rank's figures of the work (`Done`), a server's view
of workers dying (`Lookout`), each step's share of the segment's time, and the report itself
(`SegmentReport`, the engine's half that turns them into each step's outcome)."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.comm.ps_wire import Wire
from gradmesh.engine.base import Job, StepOutcome, peak_memory_bytes
from gradmesh.engine.nonfinite import Finding
from gradmesh.engine.ps.segment import Segment
from gradmesh.engine.ps.timing import roles_row
from gradmesh.engine.records import scheduled_lr
from gradmesh.parallel.ps import Roles
from gradmesh.topology import Topology


@dataclass
class Done:
    """What a rank did in a segment's point-to-point part, kept for its report (which a regroup
    may repeat: a role clock and a byte counter are taken once)."""

    segment: Segment
    log: torch.Tensor | None
    """The dispatcher's log (`ParameterServerEngine._log_rows`); None elsewhere."""
    stats: dict | None
    """A server's staleness figures per step (`Server.stats`)."""
    clock: torch.Tensor
    sent: int


class Lookout:
    """A server's view of workers dying under in-place recovery: `lookout()` is true while a
    death is unseen, `take()` gives the ranks (in the segment's group) of those newly seen."""

    def __init__(self, membership, identities: list[int]):
        self.membership, self.identities = membership, identities
        self.seen: set[int] = set()

    def _new(self) -> set[int]:
        return (self.membership.departed & set(self.identities)) - self.seen

    def __call__(self) -> bool:
        return bool(self._new())

    def take(self) -> list[int]:
        new = self._new()
        self.seen |= new
        return sorted(self.identities.index(identity) for identity in new)


def step_seconds(started: float, applied: list[float]) -> list[float]:
    """Each step's share of the segment's time, from when each was applied (in order of steps).

    A step applied before an earlier one (async and ssp let later steps finish first) took no
    time of its own: it shares the time of the step that finished last before it (or, at the
    start, the next one's), so no step reports zero seconds and the sum is the segment's time."""
    groups: list[list] = []  # [seconds, steps]
    latest = started
    for moment in applied:
        gained = moment - latest
        if gained > 0 or not groups:
            groups.append([max(gained, 0.0), 1])
        else:
            groups[-1][1] += 1
        latest = max(latest, moment)
    if len(groups) > 1 and groups[0][0] == 0:  # steps done at the very start share the next one's time
        _, steps = groups.pop(0)
        groups[0][1] += steps
    return [max(seconds / steps, 1e-9) for seconds, steps in groups for _ in range(steps)]


class SegmentReport:
    """The parameter-server engine's report of a segment: collective over every rank (after a
    regroup, the survivors), each step as this rank reports it to the services."""

    # What it reads of the engine it is the half of (`ParameterServerEngine`).
    topology: Topology
    roles: Roles
    wire: Wire
    job: Job
    membership: Any
    identities: list[int]
    worker: object | None

    def state_bytes(self) -> int:
        raise NotImplementedError

    def report_segment(self, done: "Done") -> list[tuple[StepOutcome, float]]:
        """Collective over every rank (after a regroup, the survivors): the segment's figures."""
        roles = self._gather_roles(done)
        log = self._gather_log(done)
        return self._outcomes(done.segment, log, self._gather_stats(done), roles)

    def _wait(self, work) -> None:
        """A collective's wait; under in-place recovery it fails at once when a member is lost."""
        if self.membership:
            self.membership.wait(work)
        else:
            work.wait()

    def _gather_roles(self, done: "Done") -> dict:
        """Every rank's role breakdown of the segment (`gradmesh.engine.ps.timing`), per step."""
        gathered = [torch.zeros_like(done.clock) for _ in range(self.topology.world_size)]
        self._wait(dist.all_gather(gathered, done.clock, group=self.wire.header_group, async_op=True))
        return roles_row([g.tolist() for g in gathered], len(done.segment.clocks))

    def _gather_log(self, done: "Done") -> torch.Tensor:
        log = done.log if done.log is not None else torch.zeros(done.segment.total_chunks, 6, dtype=torch.float64)
        self._wait(dist.broadcast(log, src=self.roles.dispatcher, group=self.wire.header_group, async_op=True))
        return log

    def _gather_stats(self, done: "Done") -> torch.Tensor:
        """Per step, over every server: staleness sum, count, max, when the step was applied, and
        the bytes every rank sent in the segment (spread evenly over its steps)."""
        clocks = done.segment.clocks
        stats = torch.zeros(len(clocks), 7, dtype=torch.float64)  # ..., wire bytes, refused pushes, 1 + their worker
        if done.stats is not None:
            kept = torch.tensor([done.stats[clock] for clock in clocks], dtype=torch.float64)
            stats[:, :4], stats[:, 5:] = kept[:, :4], kept[:, 4:]
        group = self.wire.header_group
        sums = torch.cat([stats[:, [0, 1, 5]].reshape(-1), torch.tensor([float(done.sent)], dtype=torch.float64)])
        highs = stats[:, [2, 3, 6]].contiguous()
        self._wait(dist.all_reduce(sums, group=group, async_op=True))
        self._wait(dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group, async_op=True))
        stats[:, [0, 1, 5]], stats[:, [2, 3, 6]] = sums[:-1].view(-1, 3), highs
        total, steps = int(sums[-1].item()), len(clocks)  # whole bytes per row, summing to the segment's
        stats[:, 4] = torch.tensor([total // steps + (i < total % steps) for i in range(steps)], dtype=torch.float64)
        return stats

    def _outcomes(self, segment: Segment, log: torch.Tensor, stats: torch.Tensor, roles: dict):
        """Each step as this rank reports it: the shares its worker computed (from the
        dispatcher's log); the dispatcher also reports those of workers that died."""
        held = self.state_bytes()
        peak = peak_memory_bytes(self.topology.device)
        me = self.identities[self.topology.rank]
        reports_lost = self.topology.rank == self.roles.dispatcher
        mine: dict[int, list] = {clock: [] for clock in segment.clocks}
        for clock, chunk, worker, version, samples, loss in log.tolist():
            if worker == me or (reports_lost and worker not in self.identities):
                mine[int(clock)].append((int(chunk), int(worker), int(version), int(samples), loss))
        found, seconds = [], step_seconds(segment.started, stats[:, 3].tolist())
        for i, batch in enumerate(segment.batches):
            outcome = self._outcome(segment, batch, mine[batch.step], stats[i].tolist(), me, held, peak, roles)
            found.append((outcome, seconds[i]))
        return found

    def _outcome(self, segment: Segment, batch, shares: list, stats_row: list, me: int, held, peak, roles: dict):
        """One step's outcome from its shares in the dispatcher's log and its row of statistics."""
        own = [s for s in shares if s[1] == me]
        lost = [
            {"worker": w, "indices": segment.indices(batch.step, c), "version": v}
            for c, w, v, _, _ in shares
            if w != me
        ]
        stale_sum, count, stale_max, _, wire, refused, sender = stats_row
        figures = torch.tensor([sum(s[4] for s in shares), sum(s[3] for s in shares), held, peak], dtype=torch.float64)
        lr = scheduled_lr(self.job.optimizer_kwargs["lr"], batch.step, self.job.train)
        detail = {"versions": [v for _, _, v, _, _ in own]} if self.worker else {}
        if lost:
            detail["lost_workers"] = lost
        indices = [i for c, _, _, _, _ in own for i in segment.indices(batch.step, c)]
        outcome = StepOutcome(
            batch,
            lr,
            indices,
            figures,
            row={
                "staleness_max": int(stale_max),
                "staleness_mean": stale_sum / max(count, 1),
                "wire_bytes": int(wire),
                "roles": roles,
            },
            detail=detail,
        )
        if refused:
            outcome.row["skipped"] = "nonfinite"
            outcome.nonfinite = Finding(
                batch.step + 1,
                push=f"gradient pushed by worker rank {int(sender) - 1} "
                f"({int(refused)} push(es) refused by the parameter servers)",
            )
        return outcome
