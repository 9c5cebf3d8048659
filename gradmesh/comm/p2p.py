"""Timing and counting the stage-to-stage sends and receives of torch's pipeline schedules.

torch.distributed.pipelining offers no hook around its point-to-point transfers; its schedules
call the module functions `_batch_p2p` (issue) and `_wait_batch_p2p` (wait), so those two are
wrapped for the duration of one schedule step and restored after. Bytes are the tensors this
rank sends.
"""

import contextlib
import time

import torch.distributed as dist

from gradmesh.comm.reducer import CommCounter


@contextlib.contextmanager
def watched_p2p(counter: CommCounter, clock):
    """Within the block, count every send and time every wait on `clock` (a StepClock or NullClock)."""
    from torch.distributed.pipelining import schedules

    issue, wait = getattr(schedules, "_batch_p2p", None), getattr(schedules, "_wait_batch_p2p", None)
    if issue is None or wait is None:
        yield
        return

    def counted_issue(p2p_ops, *args, **kwargs):
        works = issue(p2p_ops, *args, **kwargs)
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in p2p_ops if op.op is dist.isend)
        if nbytes:
            counter.add(nbytes)
        return works

    def timed_wait(works):
        start = time.perf_counter()
        wait(works)
        clock.waited("send/recv", start, time.perf_counter())

    schedules._batch_p2p, schedules._wait_batch_p2p = counted_issue, timed_wait
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = issue, wait
