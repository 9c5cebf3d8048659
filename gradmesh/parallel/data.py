"""Data parallelism on torch's DistributedDataParallel (C++ reducer: bucketing and overlap)."""

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradmesh.topology import Topology


def apply_ddp(model: nn.Module, topology: Topology) -> DistributedDataParallel:
    device_ids = [topology.local_rank] if topology.device_type == "cuda" else None
    return DistributedDataParallel(
        model.to(topology.device),
        device_ids=device_ids,
        process_group=topology.mesh["dp"].get_group(),
        # Buffers are synced once at construction; the built-in models never change them, so
        # the per-forward broadcast would be a wasted collective per micro-batch.
        forward_sync_buffers=False,
    )


def ddp_sync(model: nn.Module, last_micro_batch: bool):
    """Gradient all-reduce only on the last micro-batch of a step (no_sync on the others)."""
    if isinstance(model, DistributedDataParallel) and not last_micro_batch:
        return model.no_sync()
    return contextlib.nullcontext()
