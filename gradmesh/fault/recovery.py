"""In-place recovery around the step engine: a lost member makes the survivors regroup and redo
the step with the same global batch; replacement workers are admitted between steps.

It wraps `engine.step` (the loop calls `step` here instead) and is a service for the rest:
admissions before a step, a new group for the engine and every service after a regroup, the
hand-over of state to newcomers, and the end of the run in the membership protocol
(`gradmesh.fault.inplace`).
"""

import torch
import torch.distributed as dist

from gradmesh.fault import inplace
from gradmesh.fault.handover import hand_over
from gradmesh.loop.services import RunContext, Service, StepRows


class InplaceRecovery(Service):
    lockstep = True

    def __init__(self, ctx: RunContext, membership: inplace.Membership, sampler, reporting: StepRows, max_steps: int):
        self.ctx, self.membership, self.sampler, self.reporting = ctx, membership, sampler, reporting
        self.max_steps = max_steps
        self.services: list[Service] = []
        """Every service of the run (set by the loop): each rebuilds its part after a regroup."""

    def before_step(self, step: int) -> None:
        if self.membership.admits_now(step, self.max_steps):
            self.reporting.reporter.flush()  # every member is at this step boundary: nothing is lost
            self.membership.next()
            self.regroup(None)

    def after_step(self, outcome, elapsed: float) -> None:
        """A member lost after the step's own collectives (or the segment's report) succeeded: the
        survivors regroup now, before any service's collective (a checkpoint, an evaluation, the
        metrics gather) runs on the broken group and waits there for the dead member."""
        if self.membership.loss_seen():
            for service in self.services:
                service.regrouping()
            self.membership.next()
            self.regroup(None)

    def step(self, batch, probe):
        """The engine's step; after a loss the same global batch splits over the survivors."""
        while True:
            try:
                return self.ctx.engine.step(batch, probe)
            except RuntimeError as err:  # gloo reports a lost peer as a RuntimeError subclass
                self.ctx.engine.abandon_step()  # the failed step never reached the optimizer
                for service in self.services:
                    service.regrouping()
                self.membership.next()
                self.regroup(err, in_flight=batch)

    def run_segment(self, batches, probe):
        """An engine whose ranks do not step together (parameter servers) survives a lost worker
        within the segment itself; the segment's report then goes to the survivors' new group."""
        done = self.ctx.engine.work_segment(batches, probe)
        while True:
            try:
                return self.ctx.engine.report_segment(done)
            except RuntimeError as err:  # MembersLost, or gloo's own error for the lost peer
                for service in self.services:
                    service.regrouping()
                self.membership.next()
                self.regroup(err)

    def regroup(self, err: Exception | None, in_flight=None) -> None:
        """Form the group of the membership's current generation and go on from the same step.

        Parameters and optimizer state are untouched by a failed step; newcomers get the state
        from the new rank 0. `in_flight`: the global batch of the failed step, which the members
        redo (a newcomer admitted in the same regroup starts with it too)."""
        membership = self.membership
        while True:
            if membership.identity not in membership.members:
                raise err or RuntimeError("in-place recovery: this worker was dropped from the job")
            try:
                membership.gather()
                break
            except inplace.Regroup:  # another loss (or an admission) meanwhile: the newest generation
                membership.next()
        pending = self.reporting.reporter.abandon()
        topo = self.ctx.topology
        topo.rejoin(membership.members.index(membership.identity), len(membership.members), membership.generation)
        self.ctx.engine.rebuild(topo)  # rank 0's weights to all (DDP's construction broadcast)
        for service in self.services:
            service.regrouped()
        self.after_regroup(pending, in_flight)

    def after_regroup(self, pending: list, in_flight=None) -> None:
        """Every member of a new group, the newcomers included, runs this in the same order."""
        membership, topo = self.membership, self.ctx.topology
        if membership.newcomers:
            # The sampler as it was before the batch being redone: the newcomer draws that batch
            # next and so works on the same step as the members, not the one after.
            position = self.sampler.state_before(in_flight) if in_flight is not None else self.sampler.state_dict()
            pending = hand_over(
                topo.side_group("metrics"),
                topo.is_main,
                self.ctx.identity in membership.newcomers,
                self.ctx.engine.optimizer,
                self.sampler,
                position,
                pending,
            )
        step = in_flight.step if in_flight is not None else self.sampler.step  # the step each member is at
        where = torch.tensor([step, -step], dtype=torch.int64)
        dist.all_reduce(where, op=dist.ReduceOp.MIN, group=topo.group("world"))
        if where[0].item() != -where[1].item():
            raise RuntimeError("in-place recovery: the members stopped at different steps; use --recovery restart")
        self.reporting.reporter.resend(pending)
        joined = f"; rank(s) {', '.join(map(str, membership.newcomers))} joined" if membership.newcomers else ""
        self.reporting.note(
            f"gradmesh: in-place recovery: {topo.world_size} rank(s) go on from step "
            f"{self.sampler.step + 1} (generation {membership.generation}{joined}; "
            f"rank {self.ctx.identity} is now rank {topo.rank})"
        )

    def finish(self) -> None:
        self.membership.finish()
