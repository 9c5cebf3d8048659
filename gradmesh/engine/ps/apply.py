"""How a parameter server applies what workers push, by mode (the half of `Server` that
changes the parameters; the other half answers messages).

sync (ssp:0): a step's shares are summed in share order and applied as one optimizer step once
all have arrived, steps in order. async and ssp:K >= 1: each share is applied as it arrives, at
its share of the learning rate. The global gradient norm that clipping uses is the whole
model's: every server's part, the tables' rows, and, under the hybrid strategy, the dense part
the workers all-reduced among themselves (its square arrives with their commits), and hybrid
workers hear a step's norm from the dispatcher (`Server.norms`) to clip their own part by.
"""

import math
import time

import torch
import torch.distributed as dist

from gradmesh.comm.ps_wire import Message
from gradmesh.engine.base import lr_factor


class Applying:
    def commit(self, worker: int, message: Message) -> None:
        gradient = self.receiving.pop(worker) if worker in self.receiving else self.param.detach()[:0]
        rows = self.tables.take(worker)
        task = (message.clock, message.chunk)
        if self.dispatcher:
            self.dispatcher.commit(worker, task)
        if task in self.accepted:  # a share redone after its worker died counts once
            self.spare.append(gradient)
        else:
            self.accepted.add(task)
            self._count(worker, gradient, rows, message)
        if self.dispatcher:  # after applying: a worker told DONE may read the last step's norm
            self.serve_parked()
        self.answer_pulls()

    def _count(self, worker: int, gradient: torch.Tensor, rows: list, message: Message) -> None:
        clock = message.clock
        if not self._finite(gradient, rows, message.norm_sq):
            self.refused.add(clock)
            entry = self.stats[clock]
            entry[4], entry[5] = entry[4] + 1, max(entry[5], self.identities[worker] + 1)
        if self.dispatcher:
            self.log[(clock, message.chunk)] = (worker, message.oldest, message.samples, message.loss)
        if self.additive:
            self.apply_share(gradient, rows, message)
            self.spare.append(gradient)
        else:
            self.done.setdefault(clock, {})[message.chunk] = gradient
            self.tables.stash(clock, message.chunk, rows)
            self.pulled.setdefault(clock, []).append(message.version)
            if self.dense_on_workers:  # every worker's commit carries the same all-reduced square
                self.dense_sq[clock] = message.norm_sq
            self.apply_ready_steps()

    @staticmethod
    def _finite(gradient: torch.Tensor, rows: list, norm_sq: float) -> bool:
        """Every push is checked: its dense part, its table rows' gradients and its norm."""
        tensors = [gradient] + [grads for _, _, grads in rows]
        return math.isfinite(norm_sq) and all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())

    def _halted(self, clock: int) -> bool:
        """Nothing of a step with a non-finite push is applied; under --on-nonfinite stop nothing
        after it either (the run ends at the segment's report)."""
        return clock in self.refused or (
            self.job.on_nonfinite == "stop" and bool(self.refused) and clock > min(self.refused)
        )

    def apply_ready_steps(self) -> None:
        while len(self.done.get(self.version, {})) == len(self.segment.chunks.get(self.version, [None])):
            clock = self.version
            shares = self.done.pop(clock)
            total = shares[min(shares)]
            for chunk in sorted(shares)[1:]:  # share order, whatever the arrival order
                total.add_(shares[chunk])
            rows = self.tables.summed(self.tables.step_parts(clock))
            norm = self._global_norm(total, self.tables.norm_sq(rows), self.dense_sq.pop(clock, 0.0))
            self.norms[clock] = norm
            clipped = self.step(total, clock, norm, 1.0)
            if clipped:
                self.tables.apply(rows, lr_factor(clock, self.job.train), clipped)
            for version in self.pulled.pop(clock):
                self.record(clock, clock - version)
            self.applied += len(shares)
            self._advance(clock, len(shares))
            self.spare.extend(shares.values())

    def apply_share(self, gradient: torch.Tensor, rows: list, message: Message) -> None:
        batch = self.segment.batch(message.clock).size
        scale = batch / message.samples  # the share's own mean gradient
        gradient.mul_(scale)
        staleness = self.version - message.version if self.bound is None else message.clock - message.version
        clipped = self.step(gradient, message.clock, math.sqrt(message.norm_sq) * scale, message.samples / batch)
        if clipped:
            self.tables.apply(
                self.tables.summed(rows),
                lr_factor(message.clock, self.job.train) * message.samples / batch,
                scale * clipped,
            )
        self.record(message.clock, staleness)
        self.applied += 1
        self._advance(message.clock, 1)

    def _advance(self, clock: int, shares: int) -> None:
        self.left[clock] -= shares
        while self.left.get(self.frontier, 1) == 0:
            self.frontier += 1

    def _global_norm(self, gradient: torch.Tensor, tables_sq: float, replicated_sq: float) -> float:
        """The norm of the whole model's gradient: every server's part (its dense shard and
        table rows) summed, plus the square of what the workers hold replicated (hybrid)."""
        if not self.job.train.grad_clip:
            return 0.0
        squares = (gradient.double().pow(2).sum() + tables_sq).reshape(1).cpu()
        if dist.get_world_size(self.servers_group) > 1:
            dist.all_reduce(squares, group=self.servers_group)
        return math.sqrt(squares.item() + replicated_sq)

    def step(self, gradient: torch.Tensor, clock: int, norm: float, lr_share: float) -> float:
        """One optimizer step of the dense shard; the factor the gradient was clipped by (0: the
        step was not applied, its push or an earlier one not being finite)."""
        self.probe.reached(clock)
        if self._halted(clock):
            self.version += 1
            return 0.0
        clipped = clip_factor(self.job.train.grad_clip, norm)
        if clipped != 1.0:
            gradient.mul_(clipped)
        with self.clock.phase("send"):  # parameters being sent are not changed under the send
            self.failed |= self.wire.settle(tolerant=True)  # a send to a worker that died fails
        with self.clock.phase("apply"):
            self.optimizer.param_groups[0]["lr"] = self.base_lr * lr_factor(clock, self.job.train) * lr_share
            self.param.grad = gradient
            self.optimizer.step()
            self.param.grad = None
        self.version += 1
        self.clock.updates += 1
        return clipped

    def record(self, clock: int, staleness: int) -> None:
        entry = self.stats[clock]
        entry[:4] = entry[0] + staleness, entry[1] + 1, max(entry[2], staleness), time.time()


def clip_factor(max_norm: float, norm: float) -> float:
    """What a gradient of global norm `norm` is multiplied by when clipped to `max_norm` (0: off),
    as torch's clip_grad_norm_ computes it."""
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm else 1.0
