"""Benchmark: pipeline bubbles, activation memory and cost-balanced cuts.

    .venv/bin/python benchmarks/bench_pipeline.py     # prints tables, writes benchmarks/results/pipeline.json

1. Bubble fraction of gpipe and 1f1b at p = 2 and 4 stages over several micro-batch counts M,
   beside the theory (p-1)/(M+p-1). Stage compute is a fixed-time stand-in (sleep in forward
   and backward: 20 ms and 40 ms per micro-batch) so that 4 ranks on 2 cores do not contend
   for cores; the schedules, the transfers between stages and autograd are torch's, as in
   training. Bubble = 1 - (time inside each layer's forward and backward) / (step time),
   averaged over ranks: what is left is waiting, transfers and the schedule's own work.
2. Peak activation bytes a stage holds for backward (counted by autograd hooks), gpipe vs 1f1b;
   1F1B keeps at most p - s micro-batches in flight on stage s, GPipe all M.
3. An unbalanced model (four linear layers, then four cheap norm/activation layers) with real
   compute at p = 2: step time with the cut gradmesh balances from measured costs vs the
   equal-layer cut (which puts every linear layer on stage 0).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent


def run(nproc: int, *args: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
        subprocess.run([sys.executable, "-m", "gradmesh", "run", "--nproc", str(nproc),
                        str(HERE / "pipeline_worker.py"), *args, "--out", str(out)], check=True, env=env)
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(nproc)]


def schedules(steps: int) -> list[dict]:
    rows = []
    for p in (2, 4):
        for m in (p, 2 * p, 4 * p):
            for schedule in ("gpipe", "1f1b"):
                ranks = run(p, "--mode", "schedule", "--schedule", schedule, "--microbatches", str(m),
                            "--steps", str(steps))
                bubble = mean(1 - r["busy_s"] / r["step_s"] for r in ranks)
                theory = (p - 1) / (m + p - 1)
                rows.append({"p": p, "m": m, "schedule": schedule, "bubble": bubble, "theory": theory,
                             "relative_error": bubble / theory - 1, "step_s": mean(r["step_s"] for r in ranks),
                             "activation_peak_bytes": [r["activation_peak_bytes"] for r in ranks]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--out", default=str(HERE / "results" / "pipeline.json"))
    args = parser.parse_args()
    rows = schedules(args.steps)
    cut = run(2, "--mode", "cut", "--schedule", "1f1b", "--microbatches", "8", "--steps", str(2 * args.steps))
    cut_result = {split: {"step_s": mean(r[split]["step_s"] for r in cut), "stages": cut[0][split]["stages"],
                          "bottleneck": cut[0][split]["bottleneck"]} for split in ("balanced", "equal")}
    cut_result["speedup"] = cut_result["equal"]["step_s"] / cut_result["balanced"]["step_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"schedules": rows, "cut": cut_result}, indent=1))

    console = Console()
    table = Table(title="pipeline bubble: measured vs (p-1)/(m+p-1); activation bytes held (stage 0)")
    for col in ("p", "M", "schedule", "bubble", "theory", "off by", "stage-0 activations", "1f1b / gpipe", "p/M"):
        table.add_column(col, justify="right")
    gpipe_peak = {}
    for row in rows:
        peak = row["activation_peak_bytes"][0]
        key = (row["p"], row["m"])
        if row["schedule"] == "gpipe":
            gpipe_peak[key] = peak
        ratio = f"{peak / gpipe_peak[key]:.3f}" if row["schedule"] == "1f1b" else ""
        table.add_row(str(row["p"]), str(row["m"]), row["schedule"], f"{row['bubble']:.3f}", f"{row['theory']:.3f}",
                      f"{row['relative_error']:+.1%}", f"{peak / 1024:.0f} KiB", ratio,
                      f"{row['p'] / row['m']:.3f}" if row["schedule"] == "1f1b" else "")
    console.print(table)
    for split in ("balanced", "equal"):
        r = cut_result[split]
        console.print(f"{split:>8} cut {r['stages']}: {r['step_s'] * 1e3:.1f} ms/step (bottleneck load {r['bottleneck']:.2f})")
    console.print(f"balanced cut is {cut_result['speedup']:.2f}x faster than the equal-layer cut")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
