"""Averaging the gradients of model-parallel ranks over the data axis, with the job's reducer.

DDP takes neither DTensor parameters (tensor parallel) nor a module that a pipeline schedule
drives stage by stage, so data parallelism over such ranks averages the local gradients after
the step's backward: one flat buffer through the same reducer DDP's hook uses — DDP's
arithmetic without its bucketing and overlap.
"""

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gradmesh.comm.reducer import Reducer


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def average_gradients(named_parameters, reducer: Reducer, group: dist.ProcessGroup) -> None:
    named = [(name, _local(p.grad)) for name, p in named_parameters if p.grad is not None]
    if not named:
        return
    grads = [grad for _, grad in named]
    flat = reducer.average(_flatten_dense_tensors(grads), group, [(name, grad.shape) for name, grad in named])
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)
