"""The monitor of one rank: step breakdown, per-rank step file, stragglers, alerts, exporters.

Every rank times its phases (`StepClock`) and writes RUN_DIR/steps-rank{R}.jsonl; the step
reporter gathers the same figures from every rank into metrics.jsonl on rank 0, where this
monitor adds the imbalance score and straggler flags, writes alerts.jsonl, prints alerts, and
feeds TensorBoard and Prometheus.
"""

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from gradmesh.config import MonitorConfig
from gradmesh.files import open_append
from gradmesh.monitor.breakdown import FIGURES, StepClock
from gradmesh.monitor.stragglers import StragglerDetector, busy_times, imbalance, worker_breakdown
from gradmesh.parallel.strategy import WORKER_ROLE

if TYPE_CHECKING:
    from gradmesh.monitor.exporters import PrometheusExporter, TensorBoardExporter

MAX_TRACED_STEPS = 200
"""Every event of a traced step stays in each rank's memory until the end, when rank 0 gathers
them all into trace.json: a span without bound would grow a long run's memory with every step."""


def parse_trace_steps(text: str) -> tuple[int, int] | None:
    """'A:B' -> (A, B); '' -> None (no trace). Checked in MonitorConfig."""
    if not text:
        return None
    first, _, last = text.partition(":")
    return int(first), int(last or first)


def traced_steps(text: str, warn) -> tuple[int, int] | None:
    """The steps to trace: --trace-steps A:B, cut to its first MAX_TRACED_STEPS steps with one line to `warn`."""
    span = parse_trace_steps(text)
    if span is None or span[1] - span[0] < MAX_TRACED_STEPS:
        return span
    first, last = span[0], span[0] + MAX_TRACED_STEPS - 1
    warn(
        f"gradmesh: warning: --trace-steps {text} spans {span[1] - span[0] + 1:,} steps; tracing steps {first}:{last} "
        f"only (at most {MAX_TRACED_STEPS}: each traced step's events are held in memory until the end of the run)"
    )
    return first, last


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Monitor:
    def __init__(
        self,
        config: MonitorConfig,
        run_dir: Path | None,
        identity: int,
        is_main: bool,
        same_work: bool = True,
        counter=None,
    ):
        """same_work: every rank does the same work per step (data and tensor parallel), so a slow
        one is a straggler; pipeline stages differ by design and are not compared.
        counter: the job's gradmesh.comm.CommCounter, read at the end of each step."""
        self.config, self.run_dir, self.identity, self.is_main = config, run_dir, identity, is_main
        self.same_work = same_work
        warn = _stderr if is_main else lambda text: None
        self.clock = StepClock(traced_steps(config.trace_steps, warn), counter) if config.enabled else None
        self.detector = StragglerDetector(config.straggler_margin, config.straggler_steps)
        self.steps_file = self.alerts_file = None
        self.exporters: list[TensorBoardExporter | PrometheusExporter] = []
        self.alert_count = 0  # the alerts themselves are in alerts.jsonl

    def start(self) -> None:
        """After the run dir is prepared (a fresh run clears it): open files, start exporters."""
        if self.run_dir is None:
            return
        if self.clock is not None:
            self.steps_file = open_append(self.run_dir / f"steps-rank{self.identity}.jsonl", buffering=1)
        if not self.is_main:
            return
        self.alerts_file = open_append(self.run_dir / "alerts.jsonl", buffering=1)
        if self.config.tensorboard:
            from gradmesh.monitor.exporters import TensorBoardExporter

            self.exporters.append(TensorBoardExporter(self.run_dir))
        if self.config.prometheus_port:
            from gradmesh.monitor.exporters import PrometheusExporter

            self.exporters.append(PrometheusExporter(self.config.prometheus_port))

    def step_figures(self, step: int) -> tuple[float, ...]:
        """End the step on this rank: its breakdown figures (also written to steps-rank{R}.jsonl)."""
        if self.clock is None:
            return (0.0,) * len(FIGURES)
        figures = self.clock.finish()
        if self.steps_file:
            record = {"step": step, "time": time.time(), **dict(zip(FIGURES, figures))}
            self.steps_file.write(json.dumps(record) + "\n")
        return figures

    @contextmanager
    def timed(self, name: str, step: int):
        """Time work outside the step (checkpoint I/O): a line in steps-rank{R}.jsonl, a trace event."""
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        if self.steps_file:
            self.steps_file.write(json.dumps({"step": step, "event": name, "seconds": round(end - start, 6)}) + "\n")
        if self.clock is not None and self.clock.traces(step):
            self.clock.event(name, start, end, "phases")

    def on_row(self, row: dict) -> None:
        """Rank 0, for each gathered metrics row: imbalance, stragglers, alerts, exporters."""
        breakdown, comparable = (row.get("breakdown") if self.clock is not None else None), self.same_work
        per = "step"
        if WORKER_ROLE in row.get("roles", {}):  # parameter-server workers do the same work, compared per sample
            breakdown, comparable, per = worker_breakdown(row["roles"][WORKER_ROLE]), True, "sample"
        if breakdown:
            row["imbalance"] = round(imbalance(busy_times(breakdown)), 4)
            flagged, alerts = self.detector.observe(row["step"], breakdown, per) if comparable else ([], [])
            if flagged:
                row["stragglers"] = flagged
            for alert in alerts:
                self.alert(alert)
        for exporter in self.exporters:
            exporter.write(row)

    def summary(self, totals) -> dict:
        """Rank 0, at the end: where the step time went over the run, mean imbalance, alert count.
        totals: the run's `gradmesh.monitor.reporter.RunTotals`."""
        if self.clock is None or not totals.breakdown_rows:
            return {}
        whole = sum(totals.phase_seconds.values()) or 1.0
        return {
            "step_split": {phase: round(t / whole, 4) for phase, t in totals.phase_seconds.items()},
            "imbalance_mean": round(totals.imbalance_sum / totals.breakdown_rows, 4),
            "alerts": self.alert_count,
        }

    def alert(self, alert: dict) -> None:
        """Rank 0: log an alert (stderr, even under --quiet) and keep it in alerts.jsonl."""
        alert = {"time": time.time(), **alert}
        self.alert_count += 1
        _stderr(f"gradmesh: alert at step {alert['step']}: {alert['message']}")
        if self.alerts_file:
            self.alerts_file.write(json.dumps(alert) + "\n")
        for exporter in self.exporters:
            if hasattr(exporter, "alert"):
                exporter.alert(alert["kind"])

    def close(self) -> None:
        for handle in (self.steps_file, self.alerts_file):
            if handle:
                handle.close()
        for exporter in self.exporters:
            exporter.close()
