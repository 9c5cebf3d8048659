"""Step engines, one per family of strategies (the registry's `engine` column).

collective: every rank runs the same step at the same moment (ddp, zero1, fsdp, tp, meshes).
pipeline: stages on different ranks, micro-batches in flight, still in lockstep.
ps: parameter servers and workers, whose ranks play roles and do not run in lockstep; the
loop runs it a segment of steps at a time (`Engine.run_segment`).
"""

from gradmesh.engine.base import Engine, Job, StepOutcome, StepProbe, lr_factor, peak_memory_bytes

ENGINES = {
    "collective": "gradmesh.engine.collective:CollectiveEngine",
    "pipeline": "gradmesh.engine.pipeline:PipelineEngine",
    "ps": "gradmesh.engine.ps:ParameterServerEngine",
}


def build_engine(topology, plan, model, job: Job) -> Engine:
    from gradmesh.parallel.registry import load

    return load(ENGINES[plan.engine])(topology, plan, model, job)


__all__ = ["ENGINES", "Engine", "Job", "StepOutcome", "StepProbe", "build_engine", "lr_factor", "peak_memory_bytes"]
