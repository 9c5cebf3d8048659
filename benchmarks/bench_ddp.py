"""Benchmark: gradmesh `ddp` against a plain torch DDP script, and 1 -> 2 worker scaling.

    .venv/bin/python benchmarks/bench_ddp.py            # prints a table, writes benchmarks/results/ddp.json
    .venv/bin/python benchmarks/bench_ddp.py --sharded  # zero1 and fsdp in the same rounds
    .venv/bin/python benchmarks/bench_ddp.py --own-loop # and gradmesh.Loop (own_loop_gpt.py) against plain DDP

Runs alternate (gradmesh, plain, gradmesh, plain, ...) inside one invocation so that machine
noise hits both sides alike; each run's throughput is measured over its steady state (the
steps after the first `--warmup`, from per-step wall-clock stamps), and the reported figure is
the median over rounds. Ratios, not absolute times, are the result.
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
SIZE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
SHARDED = ("zero1", "fsdp")
"""--sharded: gradmesh's sharded strategies, on the same model and batch as ddp."""


def steady_rate(stamps: list[float], batch: int, warmup: int) -> float:
    return batch * (len(stamps) - 1 - warmup) / (stamps[-1] - stamps[warmup])


def run_gradmesh(nproc: int, steps: int, batch: int, warmup: int, threads: int | None, *extra: str) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        sets = [f"model.{k}={v}" for k, v in SIZE.items()] + ["train.sample_chars=0", "train.eval_batches=1"]
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(nproc), "--max-steps", str(steps),
               "--global-batch-size", str(batch), "--run-dir", run_dir, "--quiet", *extra]
        for item in sets:
            cmd += ["--set", item]
        subprocess.run(cmd, check=True, env=_env(threads))
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        return steady_rate([r["time"] for r in rows], batch, warmup)


def run_plain(nproc: int, steps: int, batch: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(HERE / "plain_ddp.py"), "--steps", str(steps), "--global-batch-size", str(batch),
               "--out", str(out)] + [f"--{k.replace('_', '-')}={v}" for k, v in SIZE.items()]
        subprocess.run(cmd, check=True, env=_env(1), capture_output=True)
        return steady_rate(json.loads(out.read_text())["time"], batch, warmup)


def run_own_loop(nproc: int, steps: int, batch: int, warmup: int) -> float:
    """The same training through the own-loop API, launched as a user would: `gradmesh run`."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "run", "--nproc", str(nproc), str(HERE / "own_loop_gpt.py"),
               "--steps", str(steps), "--global-batch-size", str(batch), "--run-dir", run_dir]
        subprocess.run(cmd + [f"--{k.replace('_', '-')}={v}" for k, v in SIZE.items()], check=True, env=_env(1))
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        return steady_rate([r["time"] for r in rows], batch, warmup)


def _env(threads: int | None) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--sharded", action="store_true", help="also zero1 and fsdp on 2 workers, each round")
    parser.add_argument("--own-loop", action="store_true", help="also the own-loop API (gradmesh.Loop) on 2 workers")
    parser.add_argument("--out", default=str(HERE / "results" / "ddp.json"))
    args = parser.parse_args()
    common = (args.steps, args.global_batch_size, args.warmup)
    sharded = SHARDED if args.sharded else ()
    own = ("own@2",) if args.own_loop else ()
    rates: dict[str, list[float]] = {
        k: [] for k in ("gradmesh@2", "plain@2", "gradmesh@1x1", "gradmesh@1x2", *(f"{s}@2" for s in sharded), *own)
    }
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", flush=True)
        rates["gradmesh@2"].append(run_gradmesh(2, *common, threads=1))
        rates["plain@2"].append(run_plain(2, *common))
        if own:
            rates["own@2"].append(run_own_loop(2, *common))
        for strategy in sharded:
            rates[f"{strategy}@2"].append(run_gradmesh(2, *common, 1, "--strategy", strategy))
        rates["gradmesh@1x1"].append(run_gradmesh(1, *common, threads=1))
        rates["gradmesh@1x2"].append(run_gradmesh(1, *common, threads=2))
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "model": SIZE, "global_batch_size": args.global_batch_size, "steps": args.steps,
        "warmup": args.warmup, "rounds": args.rounds, "cpu_count": os.cpu_count(),
        "samples_per_s": rates, "median_samples_per_s": med,
        "gradmesh_over_plain_ddp": med["gradmesh@2"] / med["plain@2"],
        "scaling_1_to_2_one_thread_each": med["gradmesh@2"] / med["gradmesh@1x1"],
        "scaling_1_to_2_same_cores": med["gradmesh@2"] / med["gradmesh@1x2"],
        **{f"{s}_over_plain_ddp": med[f"{s}@2"] / med["plain@2"] for s in sharded},
        **({"own_loop_over_plain_ddp": med["own@2"] / med["plain@2"]} if own else {}),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    table = Table(title=f"ddp throughput, median of {args.rounds} alternating rounds (samples/s)")
    for col in ("measure", "value", "goal / limit"):
        table.add_column(col, justify="right" if col != "measure" else "left")
    table.add_row("plain torch DDP, 2 workers", f"{med['plain@2']:.1f}", "")
    table.add_row("gradmesh ddp, 2 workers", f"{med['gradmesh@2']:.1f}", "")
    table.add_row("gradmesh / plain DDP", f"{result['gradmesh_over_plain_ddp']:.3f}", ">= 0.98")
    if own:
        table.add_row("gradmesh.Loop (own loop), 2 workers", f"{med['own@2']:.1f}", "")
        table.add_row("gradmesh.Loop / plain DDP", f"{result['own_loop_over_plain_ddp']:.3f}", ">= 0.98")
    for strategy in sharded:
        table.add_row(f"gradmesh {strategy}, 2 workers", f"{med[f'{strategy}@2']:.1f}", "")
        table.add_row(f"{strategy} / plain DDP", f"{result[f'{strategy}_over_plain_ddp']:.3f}", "")
    table.add_row("gradmesh, 1 worker x 1 thread", f"{med['gradmesh@1x1']:.1f}", "")
    table.add_row("scaling 1 -> 2 workers (1 thread each)", f"{result['scaling_1_to_2_one_thread_each']:.2f}x", "2.0x")
    table.add_row("gradmesh, 1 worker x 2 threads", f"{med['gradmesh@1x2']:.1f}", "")
    table.add_row("2 workers vs 1 worker on the same 2 cores", f"{result['scaling_1_to_2_same_cores']:.2f}x", "")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
