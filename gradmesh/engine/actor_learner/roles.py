"""The two roles' loops. An actor pulls the weights every K trajectories and sends each trajectory
as soon as it is acted; a learner answers pulls, collects a batch of trajectories and takes one
step on it with its fellow learners, until they agree that the run is over.

Exactly once: each actor numbers its trajectories; a learner accepts the next number only (a
gap or a repeat ends it with a `WireError`) and applies everything it accepted, the trajectories
that arrive after the decision to stop included (it stops an actor by answering its next PULL,
and a PULL arrives after every trajectory sent before it). An actor's PULL says how many it
sent, so `counts` shows sent = received = applied for every actor that finished; a lost actor's
trajectories that arrived whole are applied, one cut off mid-message is neither received nor
applied.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gradmesh.comm.ps_wire import Kind, Message
from gradmesh.engine.actor_learner.learner import RETURN_WINDOW, Episodes, Learner
from gradmesh.engine.actor_learner.rollout import Actor, Layout

POLL_S = 0.1
AHEAD = 2
"""An actor acts at most this many trajectories after asking for weights before it waits for them:
with the learner holding back its answers while its queue is full (`QUEUED`), this bounds how
far actors run ahead of a learner slower than they are, and so the policy lag."""
QUEUED = 2
"""A learner holds back its answers to pulls while it has this many batches waiting."""


class ActorRole:
    """Acts trajectory after trajectory. Every `pull_every` trajectories it asks for the newest
    weights and takes them up at the first trajectory start after they arrived (IMPALA's actors
    do not wait for the learner); a STOP in their place ends it, after it tells its learner how
    many it sent."""

    def __init__(self, actor: Actor, link, layout: Layout, pull_every: int, before: Callable[[int], None]):
        self.actor, self.link, self.layout, self.pull_every, self.before = actor, link, layout, pull_every, before
        self.params = list(actor.net.parameters())
        self.flat = torch.cat([param.detach().reshape(-1) for param in self.params])
        self.sent, self.version, self.asked, self.asked_at = 0, -1, False, 0

    def _take_weights(self) -> bool:
        self.asked = False
        version = self.link.finish(self.flat)
        if version is None:
            self.link.leave(self.sent)
            return False
        self.version = version
        with torch.no_grad():
            for param, value in zip(self.params, self.flat.split([p.numel() for p in self.params])):
                param.copy_(value.view_as(param))
        return True

    def step(self) -> bool:
        """One trajectory; False once the learner said STOP."""
        if self.version < 0:  # the first weights are waited for
            self.link.start(self.sent)
            self.asked = True
        due = self.version < 0 or self.link.ready() or self.sent - self.asked_at >= AHEAD
        if self.asked and due and not self._take_weights():
            return False
        if not self.asked and self.sent - self.asked_at >= self.pull_every:
            self.link.start(self.sent)
            self.asked, self.asked_at = True, self.sent
        self.before(self.sent)
        trajectory = self.actor.rollout()
        self.link.send(self.sent, self.version, self.layout.steps, self.layout.pack(trajectory))
        self.sent += 1
        return True

    def run(self) -> None:
        while self.step():
            pass


@dataclass
class Counts:
    """Per actor rank: trajectories it said it sent (its last PULL), received whole, applied."""

    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    applied: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    """Environment steps received."""
    lost: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Plan:
    batch: int
    """Trajectories per update and learner."""
    target_return: float
    max_updates: int


class LearnerRole:
    def __init__(self, learner: Learner, link, actors: list[int], layout: Layout, plan: Plan, episodes: Episodes):
        self.learner, self.link, self.layout, self.plan, self.episodes = learner, link, layout, plan, episodes
        self.live = set(actors)
        """Actors neither lost nor told to stop."""
        self.counts = Counts(
            dict.fromkeys(actors, 0), dict.fromkeys(actors, 0), dict.fromkeys(actors, 0), dict.fromkeys(actors, 0)
        )
        self.queue: list[tuple[int, int, torch.Tensor]] = []
        self.held: list[tuple[int, Message]] = []
        """Pulls not answered yet: the queue was full (`QUEUED`)."""
        self.stopping = False
        self.on_lost: Callable[[int], None] = lambda rank: None

    def on_pull(self, rank: int, message: Message) -> tuple[int, torch.Tensor | None]:
        """PARAMS, or STOP once the learners decided to stop (the actor stays live until its own STOP)."""
        self.counts.sent[rank] = message.clock
        if self.stopping:
            return self.learner.version, None
        return self.learner.version, self.learner.weights_now()

    def handle(self, rank: int, message: Message | None, payload: torch.Tensor | None) -> None:
        if message is None:
            self.lose(rank)
        elif message.kind == Kind.TRAJECTORY and payload is not None:
            expected = self.counts.received[rank]
            message.check(rank, "clock", message.clock == expected, f"{expected} (its next trajectory)")
            message.check(rank, "samples", message.samples == self.layout.steps, f"{self.layout.steps}")
            self.counts.received[rank] += 1
            self.counts.steps[rank] += message.samples
            self.queue.append((rank, message.version, payload))
        elif message.kind == Kind.STOP:  # the actor's last word: it sent `clock` in all, and every one arrived
            expected = self.counts.received[rank]
            message.check(rank, "clock", message.clock == expected, f"{expected} (the trajectories received)")
            self.counts.sent[rank] = message.clock
            self.live.discard(rank)
        elif self.stopping or len(self.queue) < QUEUED * self.plan.batch:
            self.link.answer(rank, *self.on_pull(rank, message))
        else:
            self.held.append((rank, message))

    def lose(self, rank: int) -> None:
        if rank in self.live:  # a finished actor's closing connection is no loss
            self.live.discard(rank)
            self.counts.lost.add(rank)
            self.episodes.forget(rank)
            self.on_lost(rank)

    def gather(self) -> list[tuple[int, int, torch.Tensor]]:
        """Up to `batch` trajectories: a full batch, or what is left once no actor is live."""
        held, self.held = self.held, []
        for rank, message in held:
            if rank in self.live:
                self.link.answer(rank, *self.on_pull(rank, message))
        while len(self.queue) < self.plan.batch and self.live:
            arrival = self.link.next(POLL_S)
            if arrival is not None:
                self.handle(*arrival)
        for rank in self.link.settle():
            self.lose(rank)
        taken, self.queue = self.queue[: self.plan.batch], self.queue[self.plan.batch :]
        return taken

    def pending(self) -> int:
        return len(self.queue) + len(self.live)

    def enough(self, return_sum: float, episodes: float) -> bool:
        """Over every learner's window together: the target mean return reached (a full window)."""
        return episodes >= RETURN_WINDOW and return_sum / episodes >= self.plan.target_return
