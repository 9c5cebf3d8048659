"""What applying a strategy needs besides the model and the topology."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: comm and the pipeline module import torch
    from gradmesh.comm.reducer import CommCounter, Reducer
    from gradmesh.parallel.pipeline import PipelineOptions

DEFAULT_BUCKET_MB = 25.0
"""DDP's own default, and where --bucket-mb auto starts."""


@dataclass
class ApplyOptions:
    reducer: Reducer
    """gradmesh.comm.Reducer: the one path data-parallel gradients are averaged on."""
    bucket_mb: float = 25.0
    """DDP's gradient bucket size in MiB."""
    counter: CommCounter | None = None
    """gradmesh.comm.CommCounter: where collectives the reducer does not issue (FSDP2's) count their bytes."""
    compression: str = "none"
    """--compression: what fsdp sets its reduce dtype from (other strategies use the reducer)."""
    table_sharding: str = "row"
    """--table-sharding: how the tables strategy places the sparse tables' rows (row or table)."""
    pipeline: PipelineOptions | None = None
    """gradmesh.parallel.pipeline.PipelineOptions when the plan has a pipeline axis."""
