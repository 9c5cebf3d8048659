"""What applying a strategy needs besides the model and the topology."""

from dataclasses import dataclass

DEFAULT_BUCKET_MB = 25.0
"""DDP's own default, and where --bucket-mb auto starts."""


@dataclass
class ApplyOptions:
    reducer: object
    """gradmesh.comm.Reducer: the one path data-parallel gradients are averaged on."""
    bucket_mb: float = 25.0
    """DDP's gradient bucket size in MiB."""
    counter: object = None
    """gradmesh.comm.CommCounter: where collectives the reducer does not issue (FSDP2's) count their bytes."""
    compression: str = "none"
    """--compression: what fsdp sets its reduce dtype from (other strategies use the reducer)."""
    pipeline: object = None
    """gradmesh.parallel.pipeline.PipelineOptions when the plan has a pipeline axis."""
