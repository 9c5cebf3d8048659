"""DDP comm hooks: the gradient all-reduce, run where gradmesh can see it.

DDP's built-in all-reduce cannot be interrupted or timed from Python. The hook here does the
same arithmetic (sum, divide by the group size: the mean torch's default hook computes) and
adds what gradmesh needs around it: the monitor's clock sees each bucket's all-reduce issued
and completed (time and bytes: `gradmesh.monitor.breakdown`), and under in-place recovery the all-reduce's future fails at
once when a member is lost (`Membership.guard`), instead of blocking until the collective
timeout.
"""

import contextlib
import time
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


@contextlib.contextmanager
def timed_pipeline_p2p(clock):
    """Within the block, time every stage-to-stage send/recv wait of torch's pipeline schedules.

    torch.distributed.pipelining offers no hook around its point-to-point transfers; its
    schedules call the module functions `_batch_p2p` (issue) and `_wait_batch_p2p` (wait), so
    those two are wrapped for the duration of one schedule step and restored after. Bytes are
    the tensors this rank sends. Without a clock (monitoring off) nothing is touched."""
    from torch.distributed.pipelining import schedules

    issue, wait = getattr(schedules, "_batch_p2p", None), getattr(schedules, "_wait_batch_p2p", None)
    if clock is None or issue is None or wait is None:
        yield
        return
    sent: dict[int, int] = {}

    def timed_issue(p2p_ops, *args, **kwargs):
        works = issue(p2p_ops, *args, **kwargs)
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in p2p_ops if op.op is dist.isend)
        if works and nbytes:
            sent[id(works[0])] = nbytes
        return works

    def timed_wait(works):
        start = time.perf_counter()
        wait(works)
        nbytes = sent.pop(id(works[0]), 0) if works else 0
        clock.waited("send/recv", start, time.perf_counter(), nbytes)

    schedules._batch_p2p, schedules._wait_batch_p2p = timed_issue, timed_wait
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = issue, wait
