"""Hand a running job's state to replacement workers, from a live peer (not from disk).

Run by every member of a new group right after it forms, newcomers included. The weights have
already arrived: DDP's construction broadcasts rank 0's parameters and buffers to every rank.
What DDP does not carry is sent here with `broadcast_object_list` on the reporter's gloo group:
the optimizer state (moved to CPU, so it pickles the same under NCCL), the sampler's position,
and the step records still waiting to be gathered, for which a newcomer has no figures of its
own (it contributes zeros, which count no samples).
"""

from typing import Any

import torch
import torch.distributed as dist

from gradmesh.monitor.reporter import FIGURES, StepRecord


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def hand_over(
    group, is_main: bool, is_newcomer: bool, optimizer, sampler, position: dict, pending: list[StepRecord]
) -> list[StepRecord]:
    """Collective over `group` (every member of the new group); returns the records to resend.
    `position`: the sampler state a newcomer starts from."""
    payload: list[Any] = [None]  # the broadcast puts rank 0's state dict in the slot
    if is_main:
        payload = [
            {
                "optimizer": _to_cpu(optimizer.state_dict()),
                "sampler": position,
                "pending": [(r.step, r.epoch, r.size, r.samples, r.lr, r.elapsed, r.finished) for r in pending],
            }
        ]
    dist.broadcast_object_list(payload, src=0, group=group)
    if not is_newcomer:
        return pending
    state = payload[0]
    optimizer.load_state_dict(state["optimizer"])  # moves the state to the parameters' device
    sampler.load_state_dict(state["sampler"])
    return [
        StepRecord(step, epoch, size, samples, lr, elapsed, torch.zeros(len(FIGURES), dtype=torch.float64), finished)
        for step, epoch, size, samples, lr, elapsed, finished in state["pending"]
    ]
