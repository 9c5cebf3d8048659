"""DDP comm hooks: the gradient all-reduce, run where gradmesh can see it.

DDP's built-in all-reduce cannot be interrupted or timed from Python. The hook here does the
same arithmetic (sum, divide by the group size: the mean torch's default hook computes) and
adds what gradmesh needs around it: the monitor's clock sees each bucket's all-reduce issued
and completed (time and bytes: `gradmesh.monitor.breakdown`), and under in-place recovery the all-reduce's future fails at
once when a member is lost (`Membership.guard`), instead of blocking until the collective
timeout.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass
class HookState:
    group: dist.ProcessGroup
    membership: object = None
    """gradmesh.fault.inplace.Membership under in-place recovery, else None."""
    clock: object = None
    """gradmesh.monitor.breakdown.StepClock with monitoring on, else None."""


def allreduce_mean(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer().div_(state.group.size())
    completed = state.clock.collective("all_reduce", tensor.numel() * tensor.element_size()) if state.clock else None
    work = dist.all_reduce(tensor, group=state.group, async_op=True)
    future = state.membership.guard(work) if state.membership is not None else work.get_future()

    def result(done: torch.futures.Future) -> torch.Tensor:
        if completed:
            completed()
        done.value()  # raises the collective's (or the guard's) error into DDP's backward
        return tensor

    return future.then(result)


def register(model: DistributedDataParallel, membership=None, clock=None) -> None:
    model.register_comm_hook(HookState(model.process_group, membership, clock), allreduce_mean)
