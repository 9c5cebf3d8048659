"""Strategies composed on a named mesh (`--mesh dp=2,tp=2`, `fsdp=2,tp=2`, `dp=2,pp=2`).

The order is fixed: tensor parallel first (it rewrites modules into DTensor shards), then the
pipeline split (it cuts the rewritten model into stage views), then data parallelism or
sharding over whatever each rank holds. DDP takes neither DTensor parameters nor a module
that a pipeline schedule drives stage by stage, so plain data parallelism over tensor- or
pipeline-parallel ranks averages the local gradients itself: one flattened all-reduce over the
dp axis after the step's backward — what DDP's reducer does, minus bucketing and overlap.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from gradmesh.errors import UsageError
from gradmesh.parallel.data import apply_ddp, ddp_sync
from gradmesh.parallel.pipeline import PipelineOptions, apply_pipeline
from gradmesh.parallel.sharded import apply_fsdp, fsdp_sync
from gradmesh.parallel.tensor import apply_tp
from gradmesh.topology import MESH_AXES, Topology

SUPPORTED = ({"dp"}, {"fsdp"}, {"tp"}, {"pp"}, {"dp", "tp"}, {"fsdp", "tp"}, {"dp", "pp"})


def parse_mesh(text: str) -> dict[str, int]:
    """'dp=2,tp=2' -> {'dp': 2, 'tp': 2} (order kept: the first axis is the outermost)."""
    shape: dict[str, int] = {}
    for part in text.split(","):
        axis, sep, size = part.strip().partition("=")
        if not sep or axis not in MESH_AXES or not size.isdigit() or int(size) < 1 or axis in shape:
            raise UsageError(f"--mesh {text!r}: each part must be AXIS=N with AXIS one of "
                             f"{', '.join(MESH_AXES)} (each once), e.g. dp=2,tp=2")
        shape[axis] = int(size)
    if set(shape) not in SUPPORTED:
        accepted = "; ".join(",".join(sorted(s)) for s in SUPPORTED)
        raise UsageError(f"--mesh {text!r} combines {', '.join(shape)}, which gradmesh does not compose yet; "
                         f"supported axis sets: {accepted}")
    return shape


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


@contextlib.contextmanager
def _average_over(model: nn.Module, group, size: int, last_micro_batch: bool):
    yield
    if last_micro_batch:
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat /= size
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)


def composed(topology: Topology, pipeline: PipelineOptions | None = None):
    """(wrap, sync) for the topology's mesh, in the fixed composition order."""
    axes = topology.mesh_shape
    model_parallel = "tp" in axes or "pp" in axes

    def wrap(model: nn.Module, topo: Topology) -> nn.Module:
        if "tp" in axes:
            model = apply_tp(model, topo)
        if "pp" in axes:
            model = apply_pipeline(model, topo, pipeline)
        if "fsdp" in axes:
            return apply_fsdp(model, topo)
        if "dp" in axes and not model_parallel:
            return apply_ddp(model, topo)
        return model.to(topo.device)

    def sync(model: nn.Module, last_micro_batch: bool):
        if "fsdp" in axes:
            return fsdp_sync(model, last_micro_batch)
        if "dp" in axes and model_parallel:
            return _average_over(model, topology.mesh["dp"].get_group(), axes["dp"], last_micro_batch)
        if "dp" in axes:
            return ddp_sync(model, last_micro_batch)
        return contextlib.nullcontext()

    return wrap, sync
