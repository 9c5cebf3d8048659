"""Step engines, one per family of strategies (the registry's `engine` column).

collective: every rank runs the same step at the same moment (ddp, zero1, fsdp, tp, meshes).
pipeline: stages on different ranks, micro-batches in flight, still in lockstep.
ps: parameter servers and workers, whose ranks play roles and do not run in lockstep; the
loop runs it a segment of steps at a time (`SegmentEngine.run_segment`).
actor-learner: reinforcement learning's actors and learners, which train on experience rather than
a dataset: not a step engine of the Trainer, run whole by `gradmesh.loop.actor_learner`.

Every engine class named here but actor-learner's is a `StepEngine`, and a `LockstepEngine` or
(ps) a `SegmentEngine`: what the loop and the services call on it is that protocol, not the class.
"""

from typing import TYPE_CHECKING

from gradmesh.engine.base import (
    Engine,
    Job,
    LockstepEngine,
    SegmentEngine,
    StepEngine,
    StepOutcome,
    StepProbe,
    lr_factor,
    peak_memory_bytes,
    scheduled_lr,
)

ENGINES = {
    "collective": "gradmesh.engine.collective:CollectiveEngine",
    "pipeline": "gradmesh.engine.pipeline:PipelineEngine",
    "ps": "gradmesh.engine.ps:ParameterServerEngine",
    "actor-learner": "gradmesh.engine.actor_learner:ActorLearnerEngine",
}

if TYPE_CHECKING:  # each family meets its protocol (mypy says where one does not)
    from gradmesh.engine.collective import CollectiveEngine
    from gradmesh.engine.pipeline import PipelineEngine
    from gradmesh.engine.ps import ParameterServerEngine

    def _collective(engine: CollectiveEngine) -> LockstepEngine:
        return engine

    def _pipeline(engine: PipelineEngine) -> LockstepEngine:
        return engine

    def _ps(engine: ParameterServerEngine) -> SegmentEngine:
        return engine


def build_engine(topology, plan, model, job: Job) -> StepEngine:
    from gradmesh.parallel.registry import load

    return load(ENGINES[plan.engine])(topology, plan, model, job)


__all__ = [
    "ENGINES",
    "Engine",
    "Job",
    "LockstepEngine",
    "SegmentEngine",
    "StepEngine",
    "StepOutcome",
    "StepProbe",
    "build_engine",
    "lr_factor",
    "peak_memory_bytes",
    "scheduled_lr",
]
