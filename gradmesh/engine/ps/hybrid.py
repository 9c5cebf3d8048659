"""The hybrid strategy's worker side: the dense network replicated on the workers and averaged
among them by all-reduce, while the sparse tables live on the parameter servers (PERSIA's and
Monolith's split: the tables are most of the bytes and a batch touches few rows; the dense part
is small and touched whole every step).

Each bucket of the dense gradient is all-reduced among the workers as soon as backward has
produced it (the job's reducer chain: counted, timed, guarded), and every worker applies the
same optimizer step to its replica. Gradient clipping needs the whole model's norm, tables
included:

- sync: the servers know the tables' part only once every share of the step has arrived, so a
  worker sends its dense part's square with its commit and applies its own step when the
  dispatcher answers its next pull (the next share's first row request, which waits for the
  step's tables anyway) or says the segment is done, with the step's global norm: the
  single-process model exactly, at no extra wait;
- ssp:K >= 1: the workers do not wait for the servers, so the tables' part is the workers'
  own rows' squares summed (rows two workers both touched count apart: an estimate) and each
  worker applies its step at once; the servers clip the tables by the same factor.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.engine.ps.apply import clip_factor
from gradmesh.engine.ps.slots import slot_bytes
from gradmesh.engine.records import scheduled_lr


class DenseReplica:
    def __init__(self, flat: torch.Tensor, grads: torch.Tensor, group, job, deferred: bool):
        self.grads, self.group, self.job, self.deferred = grads, group, job, deferred
        self.param = nn.Parameter(flat)  # the same storage: the model's dense parameters see each step
        self.optimizer = job.optimizer_class([self.param], **job.optimizer_kwargs)
        self.base_lr = self.optimizer.param_groups[0]["lr"]
        self.workers = dist.get_world_size(group)
        self.futures: list = []
        self.pending: tuple[int, torch.Tensor] | None = None
        """Sync: (clock, reduced gradient) of the step whose update waits for its global norm
        (heard at the next share's first row request, after the gradient buffer is zeroed)."""

    def state_bytes(self) -> int:
        slots = slot_bytes(self.optimizer, self.param)
        return 2 * self.param.numel() * self.param.element_size() + slots

    def buckets(self, bucket_elements: int) -> list[tuple[int, int]]:
        total, step = self.param.numel(), max(1, bucket_elements)
        return [(low, min(low + step, total)) for low in range(0, total, step)]

    def reduce(self, low: int, high: int) -> None:
        """All-reduce one bucket of the gradient among the workers (issued, not waited for)."""
        self.futures.append(self.job.reducer.reduce(self.grads[low:high], self.group))

    def reduced(self) -> float:
        """Waits for every bucket: the step's dense gradient (the sum of the workers' parts, each
        weighted 1 / global batch), and the square of its norm."""
        for future in self.futures:
            future.wait()
        self.futures = []
        self.grads.mul_(self.workers)  # the reducer averages; the parts are already weighted
        return float(self.grads.double().pow(2).sum())

    def estimate_sq(self, dense_sq: float, tables_sq: float) -> float:
        """ssp: the global norm's square with the tables' part summed over the workers' rows."""
        if not self.job.train.grad_clip:
            return 0.0
        squares = torch.tensor([tables_sq], dtype=torch.float64, device=self.grads.device)
        dist.all_reduce(squares, group=self.group)
        return dense_sq + float(squares.item())

    def computed(self, clock: int, global_sq: float) -> None:
        """The step's gradient is reduced: step now (ssp, `global_sq` the estimate) or once the
        servers tell the global norm (sync)."""
        if self.deferred:
            self.pending = (clock, self.grads.clone())
        else:
            self.step(clock, self.grads, global_sq)

    def catch_up(self, global_sq: float) -> None:
        """Sync: the dispatcher told the pending step's global norm (squared)."""
        if self.pending is not None:
            (clock, gradient), self.pending = self.pending, None
            self.step(clock, gradient, global_sq)

    def step(self, clock: int, gradient: torch.Tensor, global_sq: float) -> None:
        clipped = clip_factor(self.job.train.grad_clip, math.sqrt(global_sq))
        if clipped != 1.0:
            gradient.mul_(clipped)
        self.optimizer.param_groups[0]["lr"] = scheduled_lr(self.base_lr, clock, self.job.train)
        self.param.grad = gradient
        self.optimizer.step()
        self.param.grad = None
