"""`gradmesh report`: one static HTML page with PNG plots of a run, to attach to an issue or a
paper, or to read where no browser can reach the dashboard.

matplotlib figures are drawn on the Agg canvas directly (no pyplot): no display is needed and
no global backend state is touched in a process that may be plotting something else.
matplotlib is imported only once there is something to plot. The page and the plots are
recorded in the run's manifest and written atomically; a `report/` that is a symlink is refused,
and only plots the manifest lists are ever removed (contract 9).
"""

import html
import math
import time
from pathlib import Path

from gradmesh import manifest
from gradmesh.errors import UsageError
from gradmesh.files import atomic_write, read_jsonl, replacing
from gradmesh.monitor import runfiles

COLORS = {
    "data": "#8c6bb1",
    "forward": "#4c78a8",
    "backward": "#72b7b2",
    "comm": "#f58518",
    "optimizer": "#54a24b",
    "idle": "#c7c2bd",
}
MiB = 1024 * 1024


def _figure(title: str, ylabel: str, xlabel: str = "step"):
    # Imported here, not at the top: matplotlib's first import in a fresh environment builds its
    # font cache by running fc-list, and a bad run dir must be refused before anything starts.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, color="#e6e8ec", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def _save(fig, path: Path) -> None:
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png")


def plot_loss(rows: list[dict], path: Path) -> None:
    fig, ax = _figure("Loss", "loss")
    ax.plot([r["step"] for r in rows], [_number(r.get("loss")) for r in rows], color="#4c78a8", linewidth=1.6)
    _save(fig, path)


def plot_throughput(rows: list[dict], path: Path) -> None:
    fig, ax = _figure("Throughput", "samples/s")
    ax.plot([r["step"] for r in rows], [_number(r.get("samples_per_s")) for r in rows], color="#54a24b", linewidth=1.6)
    flagged = [r for r in rows if r.get("stragglers")]
    if flagged:
        ax.scatter(
            [r["step"] for r in flagged],
            [_number(r.get("samples_per_s")) for r in flagged],
            color="#d62728",
            s=16,
            zorder=3,
            label="straggler flagged",
        )
        ax.legend(frameon=False)
    ax.set_ylim(bottom=0)
    _save(fig, path)


def plot_staleness(rows: list[dict], path: Path) -> None:
    """Parameter servers: versions between the parameters a gradient was computed from and its update."""
    fig, ax = _figure("Staleness", "versions")
    steps = [r["step"] for r in rows]
    ax.plot(steps, [_number(r.get("staleness_max")) for r in rows], color="#e45756", linewidth=1.6, label="max")
    ax.plot(steps, [_number(r.get("staleness_mean")) for r in rows], color="#4c78a8", linewidth=1.6, label="mean")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False)
    _save(fig, path)


def plot_breakdown(means: dict[str, list[float]], path: Path) -> None:
    fig, ax = _figure("Step time per rank (mean over the run)", "ms", xlabel="")
    ranks = [f"rank {i}" for i in range(len(means["data"]))]
    bottom = [0.0] * len(ranks)
    for phase in runfiles.PHASES:
        heights = [s * 1000 for s in means[phase]]
        ax.bar(ranks, heights, bottom=bottom, color=COLORS[phase], label=phase, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1, 1))
    _save(fig, path)


def plot_memory(peak: list[int], state: list[int], path: Path) -> None:
    fig, ax = _figure("Memory per rank", "MiB", xlabel="")
    series = [
        (name, values, color)
        for name, values, color in (("peak memory", peak, "#4c78a8"), ("model state", state, "#9ecae9"))
        if values
    ]
    width = 0.8 / max(1, len(series))
    for k, (name, values, color) in enumerate(series):
        ax.bar(
            [i + (k - (len(series) - 1) / 2) * width for i in range(len(values))],
            [v / MiB for v in values],
            width=width,
            color=color,
            label=name,
        )
    ranks = max((len(values) for _, values, _ in series), default=0)
    ax.set_xticks(range(ranks), [f"rank {i}" for i in range(ranks)])
    if series:
        ax.legend(frameon=False)
    _save(fig, path)


def _number(value) -> float:
    return value if isinstance(value, (int, float)) else math.nan


def _sortable(value) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _summary_rows(rows: list[dict], summary: dict | None) -> list[tuple[str, str]]:
    summary = summary or {}
    last = rows[-1]
    imbalance = runfiles.finite(r.get("imbalance") for r in rows)
    rates = runfiles.finite(r.get("samples_per_s") for r in rows)
    wall = summary.get("wall_s", last.get("time", 0) - rows[0].get("time", 0))
    world = summary.get("world_size") or len(last.get("peak_memory_bytes") or []) or "–"
    return [
        ("status", "finished" if summary else "running (no summary.json yet)"),
        ("steps", str(summary.get("steps", last.get("step")))),
        ("final loss", _fmt(summary.get("final_loss", last.get("loss")), 4)),
        ("samples/s", _fmt(summary.get("samples_per_s", sum(rates) / len(rates) if rates else None), 4)),
        ("world size", str(world)),
        ("strategy", str(summary.get("strategy", "–"))),
        ("wall time", f"{wall:.1f} s" if isinstance(wall, (int, float)) else "–"),
        (
            "imbalance mean / max",
            f"{sum(imbalance) / len(imbalance):.1%} / {max(imbalance):.1%}" if imbalance else "no breakdown recorded",
        ),
    ]


def _fmt(value, digits: int) -> str:
    return f"{value:.{digits}g}" if isinstance(value, (int, float)) and math.isfinite(value) else "–"


def write_report(run_dir: str | Path) -> Path:
    """Write RUN_DIR/report.html and its PNGs in RUN_DIR/report/; returns the HTML's path."""
    run_dir = Path(run_dir)
    runfiles.check_inputs(run_dir)  # a FIFO or /dev/zero as metrics.jsonl: one line, not a read forever
    if not (run_dir / "metrics.jsonl").is_file():
        raise UsageError(f"{str(run_dir)!r} has no metrics.jsonl; is it a gradmesh run dir?")
    rows = [row for row in map(runfiles.well_typed, read_jsonl(run_dir / "metrics.jsonl")) if "step" in row]
    if not rows:
        raise UsageError(
            f"{str(run_dir / 'metrics.jsonl')!r} has no steps yet; report again once training has logged one"
        )
    summary = runfiles.well_typed(runfiles.read_summary(run_dir) or {}) or None
    out = run_dir / "report"
    _refuse_links(out, run_dir / "report.html")
    if not out.is_dir():
        manifest.record_new(out, kind="dir")
        out.mkdir()
    plot_loss(rows, out / "loss.png")
    plot_throughput(rows, out / "throughput.png")
    means = runfiles.mean_breakdown(rows)
    if means:
        plot_breakdown(means, out / "breakdown.png")
    else:
        manifest.remove(run_dir, under="report/breakdown.png")  # an older run's plot would mislead
    peak = (summary or {}).get("peak_memory_bytes") or rows[-1].get("peak_memory_bytes") or []
    plot_memory(peak, rows[-1].get("model_state_bytes") or [], out / "memory.png")
    stale = "staleness_max" in rows[-1]
    if stale:
        plot_staleness(rows, out / "staleness.png")
    plots = ["loss", "throughput"] + (["breakdown"] if means else []) + ["memory"] + (["staleness"] if stale else [])
    page = run_dir / "report.html"
    atomic_write(page, _html(run_dir, rows, summary, plots, read_jsonl(run_dir / "alerts.jsonl")))
    return page


def _refuse_links(*paths: Path) -> None:
    for path in paths:
        if path.is_symlink():
            raise UsageError(
                f"{str(path)!r} is a symbolic link; gradmesh report never writes or deletes through a "
                "link: remove it and report again"
            )


def _html(run_dir: Path, rows, summary, plots: list[str], alerts: list[dict]) -> str:
    esc = html.escape
    table = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary_rows(rows, summary))
    figures = "".join(f'<img src="report/{name}.png" alt="{name}">' for name in plots)
    if "breakdown" not in plots:
        figures += '<p class="muted">no breakdown recorded</p>'
    newest = sorted(alerts, key=lambda a: (_sortable(a.get("time")), _sortable(a.get("step"))), reverse=True)
    items = "".join(
        f'<li class="alert {esc(str(a.get("kind", "")))}"><b>{esc(str(a.get("kind", "alert")))}</b> '
        f"step {esc(str(a.get('step', '?')))}: {esc(str(a.get('message', '')))}</li>"
        for a in newest
    )
    name = esc(run_dir.resolve().name)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{name} · gradmesh report</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; color: #1f2430; max-width: 1100px; margin: 24px auto; padding: 0 20px; }}
h1 {{ font-size: 20px; margin-bottom: 2px; }} .muted {{ color: #6b7280; }}
table {{ border-collapse: collapse; margin: 14px 0 20px; }}
th, td {{ text-align: left; padding: 4px 14px 4px 0; border-bottom: 1px solid #e3e5ea; }}
th {{ font-weight: 500; color: #6b7280; }}
.plots {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr)); gap: 12px; }}
.plots img {{ width: 100%; border: 1px solid #e3e5ea; border-radius: 6px; }}
li.alert {{ padding: 3px 0; }} li.divergence b {{ color: #b91c1c; }} li.straggler b {{ color: #b45309; }}
</style></head><body>
<h1>{name}</h1><div class="muted">{esc(str(run_dir))} · report written {esc(time.strftime("%Y-%m-%d %H:%M:%S"))}</div>
<table>{table}</table>
<div class="plots">{figures}</div>
<h2>Alerts ({len(alerts)})</h2>
{f"<ul>{items}</ul>" if alerts else '<p class="muted">no alerts</p>'}
</body></html>
"""
