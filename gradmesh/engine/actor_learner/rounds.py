"""The learners' rounds: gather a batch, apply it together, agree on whether the run is over.

Every round is one all-reduce among the learners (`Learner.update`), which also sums what the
decision needs, so every learner decides alike: the run stops once the mean return over the
learners' windows reaches the target, or at the update bound; it finishes once no learner has an
actor left to stop or a trajectory left to apply.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradmesh.engine.actor_learner.roles import LearnerRole

SUMS = ("return_sum", "episodes_window", "episodes", "pending", "live", "lag_sum", "lags", "trajectories")
"""What each learner adds to a round's all-reduce beside the gradient (then every actor's steps)."""


@dataclass
class Round:
    """A round as every learner sees it (the sums are over all learners)."""

    version: int
    loss: float
    """Per valid step of the round's batch."""
    steps: int
    """Valid steps trained on in this round."""
    trajectories: int
    env_steps: list[int]
    """Environment steps received so far from each actor (in the order of `ActorLearnerRanks.actors`)."""
    return_mean: float | None
    episodes: int
    lag_mean: float | None
    lag_max: int
    reached: bool
    """The target mean return is reached."""
    stopping: bool
    finished: bool
    counts: dict[str, list[int]] = field(default_factory=dict)
    """At the end: per actor, trajectories sent (as its last pull said), received, applied; lost (1/0)."""


@dataclass
class Hooks:
    """What the loop does around the engine's work (by default nothing)."""

    before_update: Callable[[int], None] = lambda version: None
    before_trajectory: Callable[[int], None] = lambda sent: None
    after_round: Callable[[Round], None] = lambda round_: None
    lost: Callable[[int], None] = lambda rank: None
    generation: Callable[[], int] = lambda: 0
    """Which start of the job this is (a restart's actors step other episodes)."""


def play_round(role: LearnerRole, actors: list[int]) -> Round:
    taken = role.gather()
    version = role.learner.version
    lags = [version - acted for _, acted, _ in taken]
    trajectories = [role.layout.unpack(payload) for _, _, payload in taken]
    for (rank, _, _), trajectory in zip(taken, trajectories):
        role.episodes.add(rank, trajectory)
        role.counts.applied[rank] += 1
    mine = [role.counts.steps.get(rank, 0) for rank in actors]
    return_sum, window = role.episodes.sums()
    extras = [return_sum, window, role.episodes.count, role.pending(), len(role.live), sum(lags), len(lags), len(taken)]
    loss, steps, sums = role.learner.update(trajectories, torch.tensor(extras + mine, dtype=torch.float64))
    total = dict(zip(SUMS, sums[: len(SUMS)].tolist()))
    lag_max = torch.tensor([max(lags, default=0)])
    dist.all_reduce(lag_max, op=dist.ReduceOp.MAX, group=role.learner.group)
    reached = role.enough(total["return_sum"], total["episodes_window"])
    finished = role.stopping and total["pending"] == 0
    if not role.stopping and total["live"] == 0:
        raise RuntimeError("every actor was lost: no experience is left to learn from")
    role.stopping = role.stopping or reached or role.learner.version >= role.plan.max_updates
    windowed, lagged = total["episodes_window"], total["lags"]
    return Round(
        role.learner.version, loss, steps, int(total["trajectories"]), [int(n) for n in sums[len(SUMS) :].tolist()],
        total["return_sum"] / windowed if windowed else None, int(total["episodes"]),
        total["lag_sum"] / lagged if lagged else None, int(lag_max.item()), reached, role.stopping, finished,
    )  # fmt: skip


def final_counts(role: LearnerRole, actors: list[int]) -> dict[str, list[int]]:
    """Collective over the learners: every actor's counts (each learner knows its own actors')."""
    counts = role.counts
    table = torch.tensor(
        [
            [counts.sent.get(r, 0), counts.received.get(r, 0), counts.applied.get(r, 0), r in counts.lost]
            for r in actors
        ],
        dtype=torch.float64,
    ).reshape(len(actors), 4)
    dist.all_reduce(table, group=role.learner.group)
    columns = table.long().t().tolist()
    return dict(zip(("sent", "received", "applied", "lost"), columns))


def learn(role: LearnerRole, actors: list[int], hooks: Hooks) -> Round:
    """A learner's rounds until the learners agree the run is finished; the last round, with counts."""
    role.on_lost = hooks.lost
    while True:
        hooks.before_update(role.learner.version)
        round_ = play_round(role, actors)
        if round_.finished:
            round_.counts = final_counts(role, actors)
        hooks.after_round(round_)
        if round_.finished:
            return round_
