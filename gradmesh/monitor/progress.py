"""What rank 0 shows a person: a live progress bar (rich) on a terminal, plain lines elsewhere,
and a summary table at the end."""

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class LiveBar:
    """A rich progress bar on a terminal (`_bar`, None elsewhere) with notes printed above it."""

    enabled: bool
    console: Console
    _bar: Progress | None

    def note(self, text: str) -> None:
        if self.enabled:
            (self._bar.console if self._bar else self.console).print(text, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class TrainingProgress(LiveBar):
    """Progress of optimizer steps with loss and samples/s; silent when `enabled` is False."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, console: Console | None = None):
        self.total, self.start, self.enabled = total, start, enabled
        self.console = console or Console()
        self.live = enabled and self.console.is_terminal
        self._every = max(1, (total - start) // 10)
        self._next_line = start + self._every
        self._started = time.perf_counter()
        self._bar = None
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} samples/s"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-", rate="-")
            self._bar.start()

    def update(self, step: int, loss: float | None, samples_per_s: float) -> None:
        if not self.enabled:
            return
        loss = float("nan") if loss is None else loss
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", rate=f"{samples_per_s:,.0f}")
        elif step >= self._next_line or step == self.total:
            self._next_line = step + self._every
            elapsed = time.perf_counter() - self._started
            eta = elapsed / max(1, step - self.start) * (self.total - step)
            print(
                f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s  eta {eta:.0f}s", flush=True
            )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _eval_rows(found: dict) -> list[tuple[str, str]]:
    """One row per held-out metric; a metric with a known ceiling (recsys: `auc_ceiling`) is
    shown beside it, with the gap."""
    rows = []
    for key, value in found.items():
        if key.endswith("_ceiling") and key.removesuffix("_ceiling") in found:
            continue
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        ceiling = found.get(f"{key}_ceiling")
        if isinstance(value, float) and isinstance(ceiling, float):
            text += f" (ceiling {ceiling:.4f}, {value - ceiling:+.4f})"
        rows.append((f"eval {key}", text))
    return rows


def _prediction_rows(summary: dict) -> list[tuple[str, str]]:
    """Predicted (at launch, from the planner's calibration) against measured."""
    predicted, measured = summary.get("predicted"), summary.get("measured_step_s")
    if not predicted or not measured:
        return []
    rows = [
        (
            "step time",
            f"{measured * 1000:,.1f} ms (predicted {predicted['step_s'] * 1000:,.1f} ms, "
            f"{measured / predicted['step_s'] - 1:+.0%})",
        )
    ]
    peaks = summary.get("peak_memory_bytes") or []
    if peaks:
        peak = max(peaks)
        rows.append(
            (
                "peak memory (max)",
                f"{_fmt_bytes(peak)} (predicted {_fmt_bytes(predicted['peak_bytes'])}, "
                f"{peak / predicted['peak_bytes'] - 1:+.0%})",
            )
        )
    return rows


def summary_table(summary: dict) -> Table:
    table = Table(title="gradmesh run summary", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("strategy", summary["strategy"]),
        ("world size", summary["world_size"]),
        ("steps", summary["steps"]),
        ("samples", f"{summary['samples']:,}"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("samples/s", f"{summary['samples_per_s']:,.1f}"),
        ("final train loss", f"{summary['final_loss']:.4f}"),
    ]
    rows += _eval_rows(summary.get("eval", {}))
    for key, label in (("model_state_bytes", "model state / rank"), ("peak_memory_bytes", "peak memory / rank")):
        if summary.get(key):
            rows.append((label, ", ".join(_fmt_bytes(b) for b in summary[key])))
    if summary.get("step_split"):
        split = sorted(summary["step_split"].items(), key=lambda item: -item[1])
        rows.append(("step time split", " · ".join(f"{phase} {share:.0%}" for phase, share in split if share >= 0.005)))
        rows.append(("imbalance (mean)", f"{summary['imbalance_mean']:.1%}"))
        rows.append(("alerts", f"{summary['alerts']} (alerts.jsonl)" if summary["alerts"] else "none"))
    rows += _prediction_rows(summary)
    if summary.get("rl"):
        from gradmesh.monitor.experience import summary_rows

        rows += summary_rows(summary["rl"])
    elif summary.get("staleness"):
        stale = summary["staleness"]
        rows.append(("staleness (max, mean)", f"{stale['max']} versions, {stale['mean']:.2f}"))
    rows.append(("run dir", summary["run_dir"]))
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def print_summary(summary: dict, sample: str | None = None) -> None:
    console = Console(file=sys.stdout)
    console.print(summary_table(summary))
    if sample:
        console.rule("generated sample")
        console.print(sample, markup=False, highlight=False)
        console.rule()


def print_pipeline_plan(plan: dict) -> None:
    """The cut a pipeline runs with: which units each stage holds and its measured share."""
    table = Table(
        title=f"pipeline: {plan['schedule']}, {plan['microbatches']} micro-batches, {plan['cut']} cut",
        header_style="bold",
    )
    for column in ("stage", "rank", "units", "fwd+bwd ms", "memory", "load"):
        table.add_column(column, justify="left" if column == "units" else "right")
    for stage in plan["stages"]:
        units = stage["units"]
        shown = units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)})"
        table.add_row(
            str(stage["stage"]),
            str(stage["rank"]),
            shown,
            f"{stage['seconds'] * 1e3:.2f}",
            _fmt_bytes(stage["bytes"]),
            f"{stage['load']:.2f}",
        )
    Console(file=sys.stdout).print(table)
