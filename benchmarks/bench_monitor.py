"""Benchmark: the cost of monitoring — gradmesh ddp with monitoring off, on (the default), and
with everything on (trace, TensorBoard, Prometheus, replica check every 10 steps).

    .venv/bin/python benchmarks/bench_monitor.py        # prints a table, writes benchmarks/results/monitor.json

Runs alternate (off, on, everything, off, ...) inside one invocation so machine noise hits all
three alike; throughput is each run's steady state (bench_ddp's method), the figure the median
over rounds. Goal: monitoring on keeps >= 0.97 of the throughput with it off.
"""

import argparse
import json
import socket
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_ddp import run_gradmesh

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def modes() -> dict[str, list[str]]:
    return {"off": ["--no-monitor"], "on": [],
            "everything": ["--trace-steps", "20:22", "--tensorboard", "--prometheus-port", str(free_port()),
                           "--check-every", "10"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--out", default=str(HERE / "results" / "monitor.json"))
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in modes()}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", flush=True)
        for name, extra in modes().items():
            rates[name].append(run_gradmesh(2, args.steps, args.global_batch_size, args.warmup, 1, *extra))
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"workers": 2, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "global_batch_size": args.global_batch_size, "samples_per_s": rates, "median_samples_per_s": med,
              "on_over_off": med["on"] / med["off"], "everything_over_off": med["everything"] / med["off"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    table = Table(title=f"monitoring overhead, gradmesh ddp on 2 workers, median of {args.rounds} rounds")
    for col in ("monitoring", "samples/s", "vs off", "goal"):
        table.add_column(col, justify="left" if col == "monitoring" else "right")
    table.add_row("off (--no-monitor)", f"{med['off']:.1f}", "1.000", "")
    table.add_row("on (default)", f"{med['on']:.1f}", f"{result['on_over_off']:.3f}", ">= 0.97")
    table.add_row("everything", f"{med['everything']:.1f}", f"{result['everything_over_off']:.3f}", "")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
