"""The reinforcement-learning section of the configuration (`--model rl-cartpole`, the actor-learner
strategy): how many ranks learn, what each actor steps and sends, and when the run has learnt enough."""

from dataclasses import dataclass

from gradmesh.config.checks import finite, positive
from gradmesh.errors import UsageError

MAX_ENVS, MAX_UNROLL, MAX_BATCH = 4096, 1024, 256
"""Bounds that keep one trajectory (and a learner's batch of them) a tensor of reasonable size."""


@dataclass(kw_only=True)
class RLConfig:
    """Actors and learners (IMPALA with V-trace): the ranks' roles and the algorithm's settings."""

    learners: int = 1
    """Ranks that train (the first ones; the others act). With --nproc 1 the one rank does both."""
    envs: int = 32
    """CartPole-v1 environments each actor steps together (numpy-vectorised)."""
    unroll: int = 16
    """Steps of every environment in one trajectory (T): a trajectory holds unroll x envs steps."""
    batch: int = 2
    """Trajectories per learner in one update."""
    pull_every: int = 1
    """An actor pulls the latest weights every this many trajectories (K); in between it acts with
    the ones it has, and the learners correct for the lag with V-trace."""
    gamma: float = 0.99
    """Discount factor."""
    entropy_cost: float = 0.01
    """Weight of the entropy bonus in the loss."""
    baseline_cost: float = 0.5
    """Weight of the value (baseline) loss."""
    target_return: float = 450.0
    """The run ends once the mean return of the last 100 episodes reaches this (CartPole-v1's
    episodes end at 500 steps: 500 is the most), or at train.max_steps learner updates."""
    log_every: int = 10
    """A metrics row every this many learner updates (and at the end)."""

    def __post_init__(self):
        finite(self)
        for name in ("learners", "envs", "unroll", "batch", "pull_every", "log_every"):
            positive("rl", name, getattr(self, name))
        for name, bound in (("envs", MAX_ENVS), ("unroll", MAX_UNROLL), ("batch", MAX_BATCH)):
            if getattr(self, name) > bound:
                raise UsageError(f"rl.{name} must be 1..{bound}, got {getattr(self, name)}")
        if not 0.0 <= self.gamma <= 1.0:
            raise UsageError(f"rl.gamma must be in [0, 1] (a discount factor), got {self.gamma}")
        for name in ("entropy_cost", "baseline_cost"):
            if getattr(self, name) < 0:
                raise UsageError(f"rl.{name} must be >= 0 (a loss weight), got {getattr(self, name)}")
