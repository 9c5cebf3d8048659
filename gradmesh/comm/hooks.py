"""DDP's gradient all-reduce, run through gradmesh's reducer.

DDP's built-in all-reduce cannot be interrupted, timed or counted from Python. A comm hook
hands each gradient bucket to the job's reducer (`gradmesh.comm.reducer`), which does the same
arithmetic as torch's default hook and adds the wrappers around it. DDP still buckets the
gradients and overlaps the all-reduces with the backward pass.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradmesh.comm.reducer import Reducer


@dataclass
class HookState:
    reducer: Reducer
    group: dist.ProcessGroup
    names: dict[int, str]
    """id(parameter) -> its name in the plain model: a bucket's parts, for per-parameter state."""


def _reduce_bucket(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    parts = [(state.names[id(p)], p.shape) for p in bucket.parameters()]
    return state.reducer.reduce(bucket.buffer(), state.group, parts)


def register(model: DistributedDataParallel, reducer: Reducer) -> DistributedDataParallel:
    names = {id(p): name for name, p in model.module.named_parameters()}
    model.register_comm_hook(HookState(reducer, model.process_group, names), _reduce_bucket)
    return model
