"""Benchmark: `gradmesh plan`'s predictions against measured runs of the same candidates.

    .venv/bin/python benchmarks/bench_plan.py            # prints tables, writes benchmarks/results/plan.json
    .venv/bin/python benchmarks/bench_plan.py --quick    # gpt-char only, fewer steps

For each scenario (workload, workers), the planner predicts every candidate (its calibration is
measured afresh); then each of up to `--candidates` of them, spread over the ranking, trains
with `gradmesh train` (`--steps` steps, more where steps are short: a steady half of about two
seconds at the predicted step) in `--rounds` alternating rounds; its steady step time (the
planner's own measure, gradmesh.plan.steady: the later half's mean, the slowest tenth left out)
in its faster round (a busy neighbour only ever slows a run) and its peak memory per rank
(summary.json) are set beside the prediction. Reported per scenario: median and largest absolute error of step time,
Kendall's tau between predicted and measured order, whether the predicted best is within 10% of
the measured best, and the memory error.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gradmesh.plan.steady import steady_step_s, steps_for

HERE = Path(__file__).parent
SCENARIOS = {
    "gpt-char": ["--model", "gpt-char", "--set", "model.n_layer=4", "--set", "model.n_embd=128"],
    "mlp-digits": ["--model", "mlp-digits", "--global-batch-size", "256"],
    "recsys": ["--model", "recsys", "--set", "model.samples=60000"],
}


def predicted(flags: list[str], nproc: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "gradmesh", "plan", "--nproc", str(nproc), "--refresh", "--out", str(out), *flags]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def measure(flags: list[str], label: str, nproc: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(nproc), "--max-steps", str(steps),
               "--run-dir", run_dir, "--quiet", "--set", "train.sample_chars=0", "--set", "train.eval_batches=1",
               *flags, *label.split()]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        return {"step_s": steady_step_s([r["step_time_s"] for r in rows]),
                "peak_bytes": max(summary["peak_memory_bytes"])}


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    pairs = list(combinations(range(len(xs)), 2))
    score = sum((1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else -1) for i, j in pairs if xs[i] != xs[j])
    return score / len(pairs) if pairs else 1.0


def spread(ranked: list[dict], count: int) -> list[dict]:
    """`count` fitting candidates spread evenly over the ranking, the best always among them."""
    fitting = [p for p in ranked if p["fits"]]
    if len(fitting) <= count:
        return fitting
    picks = sorted({round(i * (len(fitting) - 1) / (count - 1)) for i in range(count)})
    return [fitting[i] for i in picks]


def scenario(name: str, flags: list[str], nproc: int, args, tmp: Path) -> dict:
    plan = predicted(flags, nproc, tmp / f"{name}.json")
    picked = spread(plan["ranked"], args.candidates)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for p in picked:
            steps = steps_for(p["step_s"], args.steps, seconds=2.0, most=1000)
            runs.setdefault(p["candidate"]["label"], []).append(measure(flags, p["candidate"]["label"], nproc, steps))
    rows = []
    for p in picked:
        label = p["candidate"]["label"]
        got = min(runs[label], key=lambda run: run["step_s"])
        rows.append({"label": label, "predicted_s": p["step_s"], "measured_s": got["step_s"],
                     "predicted_bytes": p["peak_bytes"], "measured_bytes": got["peak_bytes"],
                     "error": p["step_s"] / got["step_s"] - 1, "memory_error": p["peak_bytes"] / got["peak_bytes"] - 1})
        print(f"  {name} {label}: predicted {p['step_s'] * 1000:.1f} ms, measured {got['step_s'] * 1000:.1f} ms",
              file=sys.stderr)
    errors = [abs(r["error"]) for r in rows]
    best_measured = min(r["measured_s"] for r in rows)
    return {
        "scenario": name, "nproc": nproc, "rows": rows,
        "median_error": statistics.median(errors), "max_error": max(errors),
        "tau": kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
        "top_within": rows[0]["measured_s"] / best_measured - 1,
        "median_memory_error": statistics.median(abs(r["memory_error"]) for r in rows),
    }


def show(results: list[dict]) -> None:
    console = Console(width=160)
    for found in results:
        table = Table(title=f"{found['scenario']} on {found['nproc']} workers", header_style="bold")
        for column in ("candidate", "predicted ms", "measured ms", "error", "predicted MiB", "measured MiB"):
            table.add_column(column, justify="left" if column == "candidate" else "right")
        for r in found["rows"]:
            table.add_row(r["label"], f"{r['predicted_s'] * 1000:.1f}", f"{r['measured_s'] * 1000:.1f}",
                          f"{r['error']:+.0%}", f"{r['predicted_bytes'] / 2**20:,.0f}",
                          f"{r['measured_bytes'] / 2**20:,.0f}")
        console.print(table)
        console.print(f"median |error| {found['median_error']:.1%}, largest {found['max_error']:.1%}, Kendall tau "
                      f"{found['tau']:.2f}, predicted best within {found['top_within']:.1%} of the measured best, "
                      f"memory median |error| {found['median_memory_error']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", action="append", choices=list(SCENARIOS), help="only these (repeatable)")
    parser.add_argument("--out", default=str(HERE / "results" / "plan.json"))
    args = parser.parse_args()
    names = ["gpt-char"] if args.quick else args.workload or list(SCENARIOS)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = tmp  # a calibration of its own, measured in this run
        results = [scenario(name, SCENARIOS[name], args.nproc, args, Path(tmp)) for name in names]
    show(results)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))


if __name__ == "__main__":
    main()
