"""Data parallelism on torch's DistributedDataParallel (C++ reducer: bucketing and overlap).

DDP's all-reduce goes through gradmesh's reducer (a comm hook): the same mean, counted, timed
and guarded. Beside a model-parallel axis, where DDP cannot wrap the model, the gradients are
averaged after the step's backward with the same reducer (`gradmesh.comm.flat`).
"""

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradmesh.comm import hooks
from gradmesh.comm.flat import average_gradients
from gradmesh.parallel.options import ApplyOptions
from gradmesh.topology import Topology


def apply_ddp(model: nn.Module, topology: Topology, options: ApplyOptions) -> DistributedDataParallel:
    return _wrap(model.to(topology.device), topology, options)


def rewrap_ddp(model: DistributedDataParallel, topology: Topology, options: ApplyOptions) -> DistributedDataParallel:
    """DDP again around the same module with `options`' buckets (--bucket-mb auto's trials), the
    hook's rider kept. No `.to()`: for a DTensor parameter (a wrapper subclass) torch swaps in a
    new tensor wholesale, attributes included, which would drop what strategies marked on it."""
    wrapped = _wrap(model.module, topology, options)
    before, after = hooks.state_of(model), hooks.state_of(wrapped)
    if before is not None and after is not None:
        after.rider = before.rider
    return wrapped


def _wrap(model: nn.Module, topology: Topology, options: ApplyOptions) -> DistributedDataParallel:
    device_ids = [topology.local_rank] if topology.device_type == "cuda" else None
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=topology.group("dp"),
        bucket_cap_mb=options.bucket_mb,
        # Buffers are synced once at construction; the only ones the built-in models change,
        # BatchNorm's running statistics, synchronised batch norm keeps the same on every rank
        # (gradmesh.parallel.batchnorm), so the per-forward broadcast would be a wasted
        # collective per micro-batch.
        forward_sync_buffers=False,
    )
    return hooks.register(ddp, options.reducer)


def apply_local(model: nn.Module, topology: Topology, options: ApplyOptions) -> nn.Module:
    """Beside model parallelism: the model stays as the model-parallel strategies left it."""
    return model.to(topology.device)


def ddp_sync(model: nn.Module, topology: Topology, options: ApplyOptions, last_micro_batch: bool):
    """Gradient all-reduce only on the last micro-batch of a step (no_sync on the others)."""
    if isinstance(model, DistributedDataParallel) and not last_micro_batch:
        return model.no_sync()
    return contextlib.nullcontext()


def no_sync(model: nn.Module, topology: Topology, options: ApplyOptions, last_micro_batch: bool):
    """Model-parallel strategies exchange activations, not gradients: nothing to synchronise."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def flat_average_sync(model: nn.Module, topology: Topology, options: ApplyOptions, last_micro_batch: bool):
    yield
    if last_micro_batch:
        average_gradients(model.named_parameters(), options.reducer, topology.group("dp"))
