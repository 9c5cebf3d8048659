"""Weight prediction for the asynchronous modes: compute a gradient where the parameters will be.

Under async and ssp:K >= 1 a share's gradient is applied to parameters that other workers'
shares moved after this worker pulled them (its staleness). On a small transformer at its
usual learning rate that costs more than the asynchrony saves, and the cost grows with the
delay. Predicting the parameters forward along their recent velocity, as pipelined training
does with weight stashing's alternative (SpecTrain, Chen et al. 2018; linear weight prediction,
Kosson et al. 2021), takes most of that cost away (a one-process simulation of both:
docs/benchmarks.md#weight-prediction).

A worker learns both figures from its own pulls, with no extra message: each server reports the
updates its shard has had, so between two pulls the worker sees how far the shard moved per
update (the velocity) and how many updates besides its own landed meanwhile (the lag its last
share had). The next share is taken to lag by the mean of the last few: a fast worker beside a
slow one sees the slow one's update in every other interval, and the last interval alone would
predict the wrong one of the two each time. The prediction changes only what the
worker computes on; the servers' parameters, the staleness they record and sync (ssp:0) are
untouched.
"""

from collections import deque

import torch

LAGS = 4


class WeightPrediction:
    def __init__(self, flat: torch.Tensor, shards: list[tuple[int, int]]):
        self.flat, self.shards = flat, shards
        self.seen = torch.zeros_like(flat)
        """The parameters as last pulled (before any prediction)."""
        self.velocity = torch.zeros_like(flat)
        """Per update, over the interval between the last two pulls that saw updates."""
        self.updates: list[int | None] = [None] * len(shards)
        self.lags: list[deque[int]] = [deque(maxlen=LAGS) for _ in shards]

    def pulled(self, server: int, updates: int) -> None:
        """Server `server`'s shard has just been pulled into `flat` after `updates` updates:
        remember it, and move it forward by the expected lag."""
        low, high = self.shards[server]
        now, seen, velocity = self.flat[low:high], self.seen[low:high], self.velocity[low:high]
        before = self.updates[server]
        if before is not None and updates > before:
            velocity.copy_(now).sub_(seen).div_(updates - before)
            self.lags[server].append(updates - before - 1)  # the updates besides this worker's own
        seen.copy_(now)
        self.updates[server] = updates
        lag = sum(self.lags[server]) / len(self.lags[server]) if self.lags[server] else 0
        if lag:
            now.add_(velocity, alpha=lag)
