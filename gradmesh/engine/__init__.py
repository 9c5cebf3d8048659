"""Step engines, one per family of strategies (the registry's `engine` column).

collective: every rank runs the same step at the same moment (ddp, zero1, fsdp, tp, meshes).
pipeline: stages on different ranks, micro-batches in flight, still in lockstep.
A parameter-server engine, whose ranks play roles (servers and workers) and do not run in
lockstep, takes the third slot here.
"""

from gradmesh.engine.base import Engine, Job, StepOutcome, StepProbe, lr_factor, peak_memory_bytes

ENGINES = {
    "collective": "gradmesh.engine.collective:CollectiveEngine",
    "pipeline": "gradmesh.engine.pipeline:PipelineEngine",
}


def build_engine(topology, plan, model, job: Job) -> Engine:
    from gradmesh.parallel.registry import load

    return load(ENGINES[plan.engine])(topology, plan, model, job)


__all__ = ["ENGINES", "Engine", "Job", "StepOutcome", "StepProbe", "build_engine", "lr_factor", "peak_memory_bytes"]
