"""Metrics out to the tools users already read: TensorBoard event files and a Prometheus endpoint.

Both run on rank 0 only, from the rows the step reporter has gathered from every rank.
"""

import os
from pathlib import Path

from gradmesh import manifest


class TensorBoardExporter:
    """RUN_DIR/tensorboard: loss, lr, throughput, imbalance, and each rank's phase seconds."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir, self.folder = run_dir, run_dir / "tensorboard"
        manifest.record_new(self.folder, kind="dir")
        self.seen = self._present()  # a user's files already there stay theirs
        self.writer = SummaryWriter(log_dir=str(self.folder))
        self.series: set[str] = set()
        self._record_made()

    def _present(self) -> set[Path]:
        return {Path(top, name) for top, dirs, files in os.walk(self.folder) for name in dirs + files}

    def _record_made(self) -> None:
        """The writers name their event files (time, host, pid) as they create them, and
        add_scalars makes a folder and writer per series on its first value: recorded just after."""
        made = sorted(self._present() - self.seen, key=lambda p: len(p.parts))
        for path in made:
            manifest.record(self.run_dir, path, kind="dir" if path.is_dir() else "file")
        self.seen |= set(made)

    def write(self, row: dict) -> None:
        step = row["step"]
        for key in ("loss", "lr", "samples_per_s", "step_time_s", "imbalance"):
            if row.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", row[key], step)
        series = {f"{phase}/{len(per_rank)}" for phase, per_rank in row.get("breakdown", {}).items()}
        for phase, per_rank in row.get("breakdown", {}).items():
            self.writer.add_scalars(f"breakdown/{phase}", {f"rank{r}": v for r, v in enumerate(per_rank)}, step)
        for r, peak in enumerate(row.get("peak_memory_bytes", [])):
            self.writer.add_scalar(f"memory/peak_bytes_rank{r}", peak, step)
        if not series <= self.series:
            self.series |= series
            self._record_made()

    def close(self) -> None:
        self.writer.close()


class PrometheusExporter:
    """http://127.0.0.1:PORT/metrics: prometheus-client's WSGI app, served by listener.py (loopback
    only, Host checked, threads capped) rather than its start_http_server, which does neither."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

        from gradmesh.monitor import listener

        self.registry = CollectorRegistry()
        gauge = lambda name, doc, labels=(): Gauge(name, doc, labels, registry=self.registry)  # noqa: E731
        self.step = gauge("gradmesh_step", "last optimizer step gathered")
        self.loss = gauge("gradmesh_loss", "training loss of the last step")
        self.throughput = gauge("gradmesh_samples_per_second", "samples per second of the last step")
        self.imbalance = gauge("gradmesh_imbalance", "max/mean - 1 of the ranks' busy time, last step")
        self.phase = gauge("gradmesh_phase_seconds", "seconds of the last step in each phase", ("rank", "phase"))
        self.memory = gauge("gradmesh_peak_memory_bytes", "peak memory of each rank", ("rank",))
        self.alerts = Counter("gradmesh_alerts", "straggler and divergence alerts", ("kind",), registry=self.registry)
        self.server, self.thread = listener.serve_wsgi(make_wsgi_app(self.registry), host, port)

    def write(self, row: dict) -> None:
        self.step.set(row["step"])
        if row["loss"] is not None:  # a step without a finite loss keeps the last one shown
            self.loss.set(row["loss"])
        self.throughput.set(row["samples_per_s"])
        self.imbalance.set(row.get("imbalance", 0.0))
        for phase, per_rank in row.get("breakdown", {}).items():
            for r, value in enumerate(per_rank):
                self.phase.labels(rank=str(r), phase=phase).set(value)
        for r, peak in enumerate(row.get("peak_memory_bytes", [])):
            self.memory.labels(rank=str(r)).set(peak)

    def alert(self, kind: str) -> None:
        self.alerts.labels(kind=kind).inc()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
