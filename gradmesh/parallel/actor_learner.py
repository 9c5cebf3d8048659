"""The actor-learner strategy's ranks (IMPALA, Espeholt et al., 2018): which play learners and
which actors, and the checks before launch. Its engine is `gradmesh.engine.actor_learner`.

It is a registry row of its own, not a parameter-server mode: its ranks train on experience
their actors make, not on a dataset's global batches, so none of the dataset strategies applies
to its workloads and it applies to no other workload (`experience` in the row). The first
`rl.learners` ranks learn (rank 0 writes the run's files), the others act, actor i for learner
i mod L. With one rank, that rank does both (the single-process run of the same algorithm).
"""

from dataclasses import dataclass

from gradmesh.errors import UsageError


@dataclass(frozen=True)
class ActorLearnerRanks:
    world: int
    learners: int

    @property
    def actors(self) -> list[int]:
        """Actor ranks (with one rank, rank 0 is its own actor)."""
        return list(range(self.learners, self.world)) if self.world > 1 else [0]

    def is_learner(self, rank: int) -> bool:
        return rank < self.learners

    def learner_of(self, actor: int) -> int:
        return (actor - self.learners) % self.learners if self.world > 1 else 0

    def actors_of(self, learner: int) -> list[int]:
        return [actor for actor in self.actors if self.learner_of(actor) == learner]


def apply_actor_learner(model, topology, options):
    """The model as it is: each rank holds the whole small network (learners train it, actors act with it)."""
    return model


def learner_ranks(cfg, world: int) -> list[int]:
    """The learners: a lost one restarts every rank from the last checkpoint."""
    return list(range(cfg.rl.learners))


def check_actor_learner(cfg, mesh: dict[str, int], meta_model) -> None:
    world, learners = sum(mesh.values()), cfg.rl.learners
    most = max(world // 2, 1)
    if learners > most:
        raise UsageError(
            f"--learners {learners} leaves {'no actor' if learners >= world else 'a learner without an actor'} "
            f"among --nproc {world} ranks; give --learners 1..{most} (each learner needs an actor of its own; "
            "the other ranks act), or --nproc 1 for one process that does both"
        )
