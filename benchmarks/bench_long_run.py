"""Benchmark: resident memory of each worker over a long run — does it stay flat?

    .venv/bin/python benchmarks/bench_long_run.py     # prints a table, writes benchmarks/results/long_run.json

Runs `gradmesh train --model mlp-digits` for 20,000 steps (a few ms each, so the per-step
bookkeeping, not the model, is what could grow) with the defaults a long run has: monitoring on,
metrics gathered every 10 steps, evaluation and the checkpoint at the end. Every `--interval`
seconds it reads VmRSS of each worker (the launcher's descendants that carry a RANK) from
/proc; afterwards each sample gets the step it was taken at from metrics.jsonl's per-step
times. Growth = the slope of a least-squares line through RSS against step over the steps after
`--warmup`, per 10,000 steps. Goal: under 1 MB (10^6 bytes) per 10,000 steps on every rank.
"""

import argparse
import bisect
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
MB = 1e6
GOAL_MB = 1.0


def descendants(root: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since the listing
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


def rss_bytes(pid: int) -> int | None:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:")), None)


def sample_workers(process: subprocess.Popen, interval: float) -> list[tuple[float, int, int]]:
    """(wall time, rank, RSS bytes) every `interval` seconds until the launcher exits."""
    samples, workers = [], {}
    while process.poll() is None:
        for pid in descendants(process.pid):
            if pid not in workers:
                workers[pid] = rank_of(pid)
        for pid, rank in workers.items():
            rss = rss_bytes(pid) if rank is not None else None
            if rss is not None:
                samples.append((time.time(), rank, rss))
        time.sleep(interval)
    return samples


def run(nproc: int, steps: int, interval: float, extra: list[str]) -> tuple[list, list[float]]:
    """One long run: its RSS samples and the wall time each step finished."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "gradmesh", "train", "--model", "mlp-digits", "--nproc", str(nproc),
               "--max-steps", str(steps), "--run-dir", str(run_dir), "--quiet", *extra]
        process = subprocess.Popen(cmd)
        samples = sample_workers(process, interval)
        if process.wait():
            raise SystemExit(f"gradmesh train failed (exit {process.returncode}): {' '.join(cmd)}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return samples, [row["time"] for row in rows]


def slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def growth(samples: list, step_times: list[float], warmup: int) -> dict[int, dict]:
    """Per rank: RSS after warm-up and at the end (MB), and the fitted growth per 10,000 steps."""
    last = len(step_times)
    per_rank: dict[int, list[tuple[int, int]]] = {}
    for when, rank, rss in samples:
        step = bisect.bisect_right(step_times, when)  # steps finished by then
        if warmup <= step < last:  # the end (evaluation, checkpoint, final weights) is not a step
            per_rank.setdefault(rank, []).append((step, rss))
    return {rank: {"samples": len(points), "rss_after_warmup_mb": points[0][1] / MB,
                   "rss_at_end_mb": points[-1][1] / MB,
                   "growth_mb_per_10k_steps": slope(points) * 10_000 / MB}
            for rank, points in sorted(per_rank.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--nproc", default="1,2", help="comma-separated worker counts, one run each")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between RSS samples")
    parser.add_argument("--label", default="", help="a name for this code version in the JSON (e.g. before)")
    parser.add_argument("--out", default=str(HERE / "results" / "long_run.json"))
    parser.add_argument("extra", nargs="*", help="more `gradmesh train` arguments (after --)")
    args = parser.parse_args()
    results = {}
    for nproc in map(int, args.nproc.split(",")):
        print(f"{nproc} worker(s), {args.steps} steps", flush=True)
        started = time.perf_counter()
        samples, step_times = run(nproc, args.steps, args.interval, args.extra)
        results[nproc] = {"wall_s": time.perf_counter() - started, "ranks": growth(samples, step_times, args.warmup)}
    report = {"label": args.label, "model": "mlp-digits", "steps": args.steps, "warmup": args.warmup,
              "interval_s": args.interval, "extra": args.extra, "goal_mb_per_10k_steps": GOAL_MB, "runs": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    show(report)
    print(f"wrote {args.out}")


def show(report: dict) -> None:
    title = f"resident memory over {report['steps']:,} steps of mlp-digits (after step {report['warmup']:,})"
    table = Table(title=title + (f" — {report['label']}" if report["label"] else ""))
    for col in ("workers", "rank", "samples", "RSS after warm-up", "RSS at end", "growth / 10k steps", "goal"):
        table.add_column(col, justify="right")
    for nproc, result in report["runs"].items():
        for rank, figures in result["ranks"].items():
            table.add_row(str(nproc), str(rank), str(figures["samples"]), f"{figures['rss_after_warmup_mb']:.1f} MB",
                          f"{figures['rss_at_end_mb']:.1f} MB", f"{figures['growth_mb_per_10k_steps']:.2f} MB",
                          f"< {GOAL_MB:g} MB")
    Console().print(table)


if __name__ == "__main__":
    main()
