"""Per-step records gathered from every rank in batches, off the critical path.

Each rank keeps its own figures for each step (sum of its samples' losses, model-state bytes,
peak memory). Every `every` steps one asynchronous all_gather moves the whole batch of steps
to all ranks, and it is read `every` steps later, when it has long arrived. A collective every
step, even an async one, costs a measurable share of a DDP step on CPU
(docs/benchmarks.md#reporter); batched, the cost is spread over `every` steps. metrics.jsonl
still gets one object per step, written in groups.
"""

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.engine.nonfinite import finite_number
from gradmesh.files import open_append
from gradmesh.monitor import breakdown

BASE = ("loss_sum", "loss_samples", "model_state_bytes", "peak_memory_bytes")
FIGURES = BASE + breakdown.FIGURES
"""Per-rank figures of a step: the base ones, then the step breakdown (zeros with monitoring off)."""

RECENT_ROWS = 1000
"""Rows a rank keeps (`Trainer.history`); the whole run is in metrics.jsonl."""


class RunTotals:
    """What the summary needs from a run's rows, kept as running totals: a row costs a few KB, so
    keeping every one makes a rank's memory grow with the run (docs/benchmarks.md#long-run)."""

    def __init__(self, recent: int = RECENT_ROWS):
        self.recent: deque[dict] = deque(maxlen=recent)
        self.phase_seconds = dict.fromkeys(breakdown.PHASES, 0.0)
        """Seconds per phase summed over ranks and over the rows that carry a breakdown."""
        self.breakdown_rows = 0
        self.imbalance_sum = 0.0
        self.stale_rows, self.stale_sum, self.stale_max = 0, 0.0, 0

    def add(self, row: dict) -> None:
        self.recent.append(row)
        if "staleness_max" in row:
            self.stale_rows += 1
            self.stale_sum += row["staleness_mean"]
            self.stale_max = max(self.stale_max, row["staleness_max"])
        if "breakdown" not in row:
            return
        self.breakdown_rows += 1
        for phase in breakdown.PHASES:
            self.phase_seconds[phase] += sum(row["breakdown"][phase])
        self.imbalance_sum += row.get("imbalance", 0.0)

    def staleness(self) -> dict:
        """For the summary: the largest staleness of any applied update, and the mean over steps."""
        if not self.stale_rows:
            return {}
        return {"staleness": {"max": self.stale_max, "mean": round(self.stale_sum / self.stale_rows, 4)}}

    @property
    def last(self) -> dict | None:
        return self.recent[-1] if self.recent else None


@dataclass
class StepRecord:
    step: int
    epoch: int
    size: int
    samples: int
    lr: float
    elapsed: float
    figures: torch.Tensor
    """This rank's FIGURES for the step (float64)."""
    finished: float = field(default_factory=time.time)
    partial: bool = False
    """Gathered after in-place recovery from the survivors only (a rank's figures were lost)."""
    row: dict = field(default_factory=dict)
    """More columns for the row (the engine's, e.g. staleness)."""


class StepReporter:
    def __init__(
        self,
        group,
        every: int,
        metrics_path: Path | None,
        on_record=None,
        membership=None,
        on_row=None,
        with_breakdown: bool = True,
        totals: RunTotals | None = None,
    ):
        # A gloo group of its own (the topology's "metrics" side group) keeps monitoring traffic
        # out of training's queue — sharing the default group cost throughput against plain DDP
        # (docs/benchmarks.md#reporter) — and gloo takes CPU tensors even under NCCL.
        self.group, self.world_size, self.every = group, group.size(), max(1, every)
        self.metrics_path, self.on_record = metrics_path, on_record
        self.membership = membership
        self.on_row, self.with_breakdown = on_row, with_breakdown
        """on_row(row) sees (and may add to) each row before it is written: the monitor's hook."""
        """Under in-place recovery: waits on the gather fail at once when a member is lost."""
        self.waiting: list[StepRecord] = []
        # (the records sent, the gather's output buffers, its pending work)
        self.in_flight: tuple[list[StepRecord], list[torch.Tensor], dist.Work] | None = None
        self.totals = totals if totals is not None else RunTotals()

    def add(self, record: StepRecord) -> None:
        self.waiting.append(record)
        if len(self.waiting) >= self.every:
            self._send()

    def _send(self) -> None:
        if not self._receive():
            return  # the group lost a member: the records wait for the regrouped one (abandon/resend)
        local = torch.stack([r.figures for r in self.waiting])
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, local, async_op=True, group=self.group)
        self.in_flight, self.waiting = (self.waiting, gathered, work), []

    def _receive(self) -> bool:
        if self.in_flight is None:
            return True
        records, gathered, work = self.in_flight
        self.in_flight = None
        if self.membership is not None:
            try:
                self.membership.wait(work)
            except RuntimeError:
                self.waiting = records + self.waiting
                return False
        else:
            work.wait()
        per_rank = torch.stack(gathered)  # [rank, step, figure]
        rows = []
        for i, record in enumerate(records):
            row = self._row(record, per_rank[:, i])
            if self.on_row:
                self.on_row(row)
            rows.append(row)
            self.totals.add(row)
        if self.metrics_path:
            with open_append(self.metrics_path) as handle:
                handle.writelines(json.dumps(row) + "\n" for row in rows)
        if self.on_record:
            self.on_record(rows[-1])
        return True

    def _row(self, record: StepRecord, figures: torch.Tensor) -> dict:
        """The metrics row of one step from every rank's figures for it ([rank, figure])."""
        # Loss over the samples counted: ranks holding the same loss (tensor parallel) count
        # its samples as often, and pipeline stages before the last count neither.
        counted = figures[:, 1].sum().item()
        row: dict[str, Any] = {
            "step": record.step,
            "epoch": record.epoch,
            "loss": finite_number(figures[:, 0].sum().item() / counted) if counted else None,
            "lr": record.lr,
            "samples": record.samples,
            "step_time_s": record.elapsed,
            "samples_per_s": record.size / record.elapsed,
            "time": record.finished,
            "model_state_bytes": [int(b) for b in figures[:, 2]],
            "peak_memory_bytes": [int(b) for b in figures[:, 3]],
        }
        if self.with_breakdown:
            row["breakdown"] = {
                name: [round(v, 6) for v in figures[:, len(BASE) + j].tolist()]
                for j, name in enumerate(breakdown.FIGURES)
            }
        row.update(record.row)
        if record.partial:
            row["partial"] = True
        return row

    def abandon(self) -> list[StepRecord]:
        """The records not yet written (the group they were gathered on broke); nothing waited on."""
        pending = (self.in_flight[0] if self.in_flight else []) + self.waiting
        self.in_flight, self.waiting = None, []
        return pending

    def resend(self, records: list[StepRecord]) -> None:
        for record in records:
            record.partial = True
        self.waiting = records + self.waiting
        if len(self.waiting) >= self.every:
            self._send()

    def flush(self) -> None:
        """Collective: send what is waiting and read everything (end of a run, before a checkpoint)."""
        if self.waiting:
            self._send()
        self._receive()
