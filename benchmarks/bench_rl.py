"""Benchmark: actor-learner reinforcement learning (IMPALA with V-trace) on CartPole-v1.

    .venv/bin/python benchmarks/bench_rl.py              # prints a table, writes benchmarks/results/rl.json
    .venv/bin/python benchmarks/bench_rl.py --rounds 3   # medians of 3 runs per row

Rows: the same algorithm in one process (`--nproc 1`: the rank acts, then learns, in turn), and
1, 2 and 4 actors beside one learner (`--nproc 2, 3, 5`). Each row is `gradmesh train --model
rl-cartpole` at its defaults: the time until the mean return of the last 100 episodes first
reaches 450 (from the start of training, after the workers are up), the environment steps it took,
and environment steps per second over the whole run, in all and per actor. On a machine with
fewer cores than ranks the actors share cores with the learner and each other: scaling is
sublinear (the published actor-learner scaling is sublinear too), and runs are not
reproducible, so medians of several rounds are the figures to quote, with the machine's load.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
ROWS = [("1 process (actor + learner in turn)", 1), ("1 actor + 1 learner", 2), ("2 actors + 1 learner", 3),
        ("4 actors + 1 learner", 5)]


def run(nproc: int, *extra: str) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "train", "--model", "rl-cartpole", "--nproc", str(nproc),
               "--run-dir", run_dir, "--quiet", *extra]
        subprocess.run(cmd, check=True, timeout=900)
        return json.loads((Path(run_dir) / "summary.json").read_text())


def figures(summary: dict) -> dict:
    rl = summary["rl"]
    return {
        "to_target_s": rl["target_reached_s"],
        "to_target_env_steps": rl["target_reached_env_steps"],
        "env_steps_per_s": rl["env_steps_per_s"],
        "per_actor_env_steps_per_s": statistics.mean(rl["actor_env_steps_per_s"]),
        "learner_samples_per_s": summary["samples_per_s"],
        "policy_lag_mean": rl["policy_lag"]["mean"],
        "wall_s": summary["wall_s"],
    }


def median_of(samples: list[dict]) -> dict:
    keys = samples[0].keys()
    return {k: statistics.median(s[k] for s in samples if s[k] is not None) if any(s[k] is not None for s in samples)
            else None for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs per row (medians reported)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "rl.json")
    args, extra = parser.parse_known_args()
    samples: dict[str, list[dict]] = {label: [] for label, _ in ROWS}
    for _ in range(args.rounds):  # rows alternate within a round: a load change hits every row alike
        for label, nproc in ROWS:
            samples[label].append(figures(run(nproc, *extra)))
    results = {label: {"nproc": nproc, **median_of(samples[label])} for label, nproc in ROWS}
    load = [round(x, 1) for x in os.getloadavg()]
    table = Table(title=f"rl-cartpole to mean return >= 450 ({os.cpu_count()} cores, medians of {args.rounds}; "
                  f"load average at the end {load[0]}, {load[1]}, {load[2]})")
    for column in ("ranks", "time to 450", "env steps to 450", "env steps/s", "per actor", "learner samples/s",
                   "policy lag"):
        table.add_column(column, justify="right")
    for label, row in results.items():
        shown = "not reached" if row["to_target_s"] is None else f"{row['to_target_s']:.1f} s"
        steps = "-" if row["to_target_env_steps"] is None else f"{row['to_target_env_steps']:,.0f}"
        table.add_row(label, shown, steps, f"{row['env_steps_per_s']:,.0f}", f"{row['per_actor_env_steps_per_s']:,.0f}",
                      f"{row['learner_samples_per_s']:,.0f}", f"{row['policy_lag_mean']:.2f}")
    Console(width=150).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"cores": os.cpu_count(), "rounds": args.rounds, "load_average": load, "rows": results}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
