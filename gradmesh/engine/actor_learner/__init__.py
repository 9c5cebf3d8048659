"""The actor-learner engine (IMPALA, Espeholt et al., 2018): reinforcement learning's ranks play
actors, which act in their environments with the policy they last pulled and send trajectories,
and learners, which train on those trajectories with V-trace's off-policy correction and
all-reduce among themselves. Nothing steps in lockstep between the two roles; actors pull new
weights every K trajectories and the policy lag (learner updates between the weights an actor
acted with and the update that applies its trajectory) is measured like a parameter server's
staleness.

The same machinery as the parameter servers' (roles fixed by rank, the point-to-point wire of
`gradmesh.comm.ps_wire`, in-place survival of a lost rank that holds nothing unique) with other
roles, so it is an engine family of its own, chosen by the registry row whose `experience` is
set. It runs whole (`run`), not a step at a time: there is no dataset and no global batch, so
the Trainer's loop and its contracts of global order and single-process parity do not apply
(actor-learner runs are not reproducible); what holds instead is that every trajectory an actor
sends is applied exactly once (`roles`), which tests/test_rl.py counts.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.comm.ps_wire import Wire
from gradmesh.config.rl import RLConfig
from gradmesh.engine.actor_learner.learner import Episodes, Learner
from gradmesh.engine.actor_learner.links import ActorEnd, LearnerEnd, LocalLink
from gradmesh.engine.actor_learner.roles import ActorRole, LearnerRole, Plan
from gradmesh.engine.actor_learner.rollout import Actor, Layout
from gradmesh.engine.actor_learner.rounds import Hooks, Round, learn
from gradmesh.engine.actor_learner.vtrace import LossWeights
from gradmesh.parallel.actor_learner import ActorLearnerRanks
from gradmesh.topology import Topology

GRAD_CLIP = 40.0
"""Gradient norm bound (IMPALA's), on the mean gradient per valid step."""


@dataclass
class Setup:
    """What the loop hands the engine."""

    rl: RLConfig
    max_updates: int
    seed: int
    make_net: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    hooks: Hooks = field(default_factory=Hooks)


class ActorLearnerEngine:
    lockstep = False

    def __init__(self, topology: Topology, setup: Setup):
        self.topology, self.setup = topology, setup
        rl = setup.rl
        self.ranks = ActorLearnerRanks(topology.world_size, rl.learners)
        self.layout = Layout(rl.unroll, rl.envs)
        rank = topology.rank
        # every rank takes part in making every group, in the same order
        self.learners_group = dist.new_group(list(range(rl.learners)), backend="gloo")
        self.wire = Wire(topology.side_group("actor-learner", waits_on_peers=True), topology.group("world"))
        self.role = "learner" if self.ranks.is_learner(rank) else "actor"
        topology.role = self.role
        torch.manual_seed(setup.seed)  # the same initial weights on every rank
        self.net = setup.make_net()
        self.learner: Learner | None = None
        self.episodes = Episodes()
        if self.ranks.is_learner(rank):
            weights = LossWeights(gamma=rl.gamma, baseline=rl.baseline_cost, entropy=rl.entropy_cost)
            optimizer = setup.make_optimizer(self.net)
            self.learner = Learner(self.net, optimizer, weights, self.learners_group, GRAD_CLIP)

    def flat_size(self) -> int:
        return sum(param.numel() for param in self.net.parameters())

    @property
    def is_learner(self) -> bool:
        return self.learner is not None

    def _actor(self, rank: int, net: nn.Module, link) -> ActorRole:
        seed = self.setup.seed * 100_003 + rank * 7919 + self.setup.hooks.generation()
        actor = Actor(net, self.layout, seed)
        return ActorRole(actor, link, self.layout, self.setup.rl.pull_every, self.setup.hooks.before_trajectory)

    def run(self) -> Round | None:
        """This rank's part of the whole run: a learner's last round (learner 0's tells the run's
        figures), None on an actor."""
        rank = self.topology.rank
        if self.learner is None:
            self._actor(rank, self.net, ActorEnd(self.wire, self.ranks.learner_of(rank), self.flat_size())).run()
            return None
        rl = self.setup.rl
        plan = Plan(batch=rl.batch, target_return=rl.target_return, max_updates=self.setup.max_updates)
        actors = self.ranks.actors_of(rank)
        role = LearnerRole(self.learner, None, actors, self.layout, plan, self.episodes)
        if self.topology.world_size == 1:
            link = LocalLink(role.on_pull)
            local = self._actor(rank, self.setup.make_net(), link)
            link.produce = local.step
            role.link = link
        else:
            role.link = LearnerEnd(self.wire, actors, self.layout.size)
        return learn(role, self.ranks.actors, self.setup.hooks)

    # -- checkpoints (collective over the learners) --------------------------------------------

    def checkpoint_state(self, for_load: bool = False) -> dict:
        from gradmesh.parallel.state import named_optimizer_state

        assert self.learner is not None
        if for_load:
            self.learner.prime()
        return {"model": self.net.state_dict(), "optim": named_optimizer_state(self.net, self.learner.optimizer)}

    def install_checkpoint(self, payload: dict) -> None:
        from gradmesh.parallel.state import install_optimizer_state

        assert self.learner is not None
        self.net.load_state_dict(payload["model"])
        install_optimizer_state(self.net, self.learner.optimizer, payload["optim"])
