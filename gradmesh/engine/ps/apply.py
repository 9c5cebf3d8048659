"""How a parameter server applies what workers push, by mode: its update rule (`UpdateRule`),
an object the server holds; the server answers messages and hands it each share that counts.

sync (ssp:0): a step's shares are summed in share order and applied as one optimizer step once
all have arrived, steps in order. async and ssp:K >= 1: each share is applied as it arrives, at
its share of the learning rate. The global gradient norm that clipping uses is the whole
model's: every server's part, the tables' rows, and, under the hybrid strategy, the dense part
the workers all-reduced among themselves (its square arrives with their commits), and hybrid
workers hear a step's norm from the dispatcher (`UpdateRule.norms`) to clip their own part by.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.comm.ps_records import Commit
from gradmesh.comm.ps_wire import Wire
from gradmesh.engine.ps.mode import Mode
from gradmesh.engine.ps.segment import Segment
from gradmesh.engine.ps.tables import ServerTables
from gradmesh.engine.ps.timing import RoleClock
from gradmesh.engine.records import lr_factor, scheduled_lr


class UpdateRule:
    """A server's shard of the parameters, its optimizer, and what has been applied to it."""

    def __init__(
        self,
        param: nn.Parameter,
        tables: ServerTables,
        mode: Mode,
        job,
        wire: Wire,
        servers_group,
        clock: RoleClock,
        spare: list[torch.Tensor],
        failed: set[int],
        dense_on_workers: bool,
    ):
        self.param, self.tables, self.mode, self.job, self.clock = param, tables, mode, job, clock
        self.wire, self.servers_group, self.dense_on_workers = wire, servers_group, dense_on_workers
        self.optimizer = job.optimizer_class([param], **job.optimizer_kwargs)
        self.base_lr: float = self.optimizer.param_groups[0]["lr"]
        self.spare = spare
        """The server's receive buffers: an applied gradient's buffer goes back there."""
        self.failed = failed
        """The server's workers a send failed with (they died), handled between messages."""
        self.version = 0
        """Updates applied (async: shares; sync: steps since step 0)."""
        self.stats: dict[int, list[float]] = {}
        self.segment: Segment | None = None

    @property
    def serving(self) -> Segment:
        """The segment being served (`begin`)."""
        assert self.segment is not None, "a share applied outside a segment"
        return self.segment

    def start_at(self, step: int) -> None:
        """Versions count from the step the run starts at (0, or a checkpoint's)."""
        self.version = step

    def norm_sq(self, clock: int) -> float:
        """The square of step `clock`'s global gradient norm, once applied (lockstep; else 0)."""
        return self.norms.get(clock, 0.0) ** 2

    def rewire(self, wire: Wire, servers_group) -> None:
        self.wire, self.servers_group = wire, servers_group

    def begin(self, segment: Segment, probe) -> None:
        """A segment's bookkeeping, fresh (a segment starts with nothing in flight)."""
        self.segment, self.probe = segment, probe
        self.done: dict[int, dict[int, torch.Tensor]] = {}
        self.pulled: dict[int, list[int]] = {}
        self.applied = 0
        self.dense_sq: dict[int, float] = {}
        """Hybrid, sync: clock -> the square of the workers' all-reduced dense gradient norm."""
        self.norms: dict[int, float] = {}
        """Sync: clock -> the global gradient norm the step was clipped by (0 with clipping off)."""
        self.frontier = segment.first
        """Every step before it wholly applied."""
        self.left = {clock: len(segment.chunks[clock]) for clock in segment.clocks}
        self.stats = {clock: [0.0, 0.0, 0.0, segment.started, 0.0, 0.0] for clock in segment.clocks}
        self.refused: set[int] = set()
        """Steps with a push that was not finite: nothing of them is applied here."""

    def count(self, identity: int, gradient: torch.Tensor, rows: list, share: Commit) -> None:
        """A share that counts (its first commit), from the worker started as rank `identity`."""
        clock = share.clock
        if not self._finite(gradient, rows, share.norm_sq):
            self.refused.add(clock)
            entry = self.stats[clock]
            entry[4], entry[5] = entry[4] + 1, max(entry[5], identity + 1)
        if not self.mode.lockstep:
            self.apply_share(gradient, rows, share)
            self.spare.append(gradient)
        else:
            self.done.setdefault(clock, {})[share.chunk] = gradient
            self.tables.stash(clock, share.chunk, rows)
            self.pulled.setdefault(clock, []).append(share.pulled)
            if self.dense_on_workers:  # every worker's commit carries the same all-reduced square
                self.dense_sq[clock] = share.norm_sq
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
        while len(self.done.get(self.version, {})) == len(self.serving.chunks.get(self.version, [None])):
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

    def apply_share(self, gradient: torch.Tensor, rows: list, share: Commit) -> None:
        batch = self.serving.batch(share.clock).size
        scale = batch / share.samples  # the share's own mean gradient
        gradient.mul_(scale)
        staleness = self.mode.staleness(share.clock, share.pulled, self.version)
        clipped = self.step(gradient, share.clock, math.sqrt(share.norm_sq) * scale, share.samples / batch)
        if clipped:
            self.tables.apply(
                self.tables.summed(rows),
                lr_factor(share.clock, self.job.train) * share.samples / batch,
                scale * clipped,
            )
        self.record(share.clock, staleness)
        self.applied += 1
        self._advance(share.clock, 1)

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
            self.optimizer.param_groups[0]["lr"] = scheduled_lr(self.base_lr, clock, self.job.train) * lr_share
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
