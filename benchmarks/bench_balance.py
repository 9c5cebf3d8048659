"""Benchmark: --balance auto against equal shares with one rank slowed 2x, then recovered.

    .venv/bin/python benchmarks/bench_balance.py      # prints a table, writes benchmarks/results/balance.json

gpt-char at its default size on 2 ranks (a core each), global batch 32, rank 1 slowed 2x
(`--inject slow:rank=1,factor=2`, its own work takes twice as long). (a) The whole run slowed:
the median step time after the shares settle (steps 31-60), `--balance auto` against `off`,
beside the theory: with W the fast rank's time for the whole batch, equal shares take
2 x W/2 = W (the slow rank's half), shares of 2/3 and 1/3 take 2/3 W on both ranks: 0.67x. (b) The slow-down
ends after step 40 of 80: the steps until rank 0's share is back within 10% of equal (0.55).
Both runs alternate `--rounds` times; medians. Exactness is the test suite's (tests/test_balance.py).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
COMMON = ["--model", "gpt-char", "--global-batch-size", "32", "--set", "train.sample_chars=0",
          "--set", "train.eval_batches=1", "--set", "data.max_chars=400000"]


def train(steps: int, *extra: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", "2", "--max-steps", str(steps),
               "--run-dir", run_dir, "--quiet", *COMMON, *extra]
        subprocess.run(cmd, check=True)
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def steady(rows: list[dict], first: int) -> float:
    return statistics.median(r["step_time_s"] for r in rows[first:])


def recovery_steps(rows: list[dict], ended: int) -> int | None:
    """Steps after the slow-down ended until rank 0's share is within 10% of equal."""
    for row in rows[ended:]:
        if row.get("shares", [0.5])[0] <= 0.55:
            return row["step"] - ended
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    slowed, recovering = {"off": [], "auto": []}, []
    for _ in range(args.rounds):
        for how in ("off", "auto"):
            slowed[how].append(steady(train(60, "--balance", how, "--inject", "slow:rank=1,factor=2"), 30))
        rows = train(80, "--balance", "auto", "--inject", "slow:rank=1,factor=2,step=1,steps=40")
        recovering.append({"steps": recovery_steps(rows, 40), "peak_share": max(r.get("shares", [0.5])[0] for r in rows)})
    result = {"off_step_s": statistics.median(slowed["off"]), "auto_step_s": statistics.median(slowed["auto"]),
              "rounds": {"off": slowed["off"], "auto": slowed["auto"]}, "recovery": recovering}
    result["ratio"] = result["auto_step_s"] / result["off_step_s"]
    table = Table(title="gpt-char, 2 ranks, rank 1 slowed 2x (median step time, steps 31-60)")
    for column in ("balance", "step time", "vs off", "theory"):
        table.add_column(column, justify="right")
    table.add_row("off", f"{result['off_step_s'] * 1e3:.1f} ms", "1.00x", "1.00x")
    table.add_row("auto", f"{result['auto_step_s'] * 1e3:.1f} ms", f"{result['ratio']:.2f}x", "0.67x")
    Console().print(table)
    for entry in recovering:
        print(f"slow-down ended after step 40: rank 0's share peaked at {entry['peak_share']:.0%} and was back within "
              f"10% of equal after {entry['steps']} steps")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "balance.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
