"""Benchmark: gradient compression across two hosts joined by a 200 Mbit/s link.

    .venv/bin/python benchmarks/bench_compression.py     # needs root and iproute2; writes benchmarks/results/compression.json

Two network namespaces joined through a bridge (`gradmesh.netns.Hosts`), each host's egress
limited to 200 Mbit/s by a token bucket, run `gradmesh train --nnodes 2 --nproc 1` (one worker
per host, so every byte of the all-reduce crosses the link). For gpt-char at its default size and
4x wider, each `--compression` setting trains the same steps; the table gives the median step
time after the first `--warmup` steps, the final loss (mean of the last 5 steps) against none's,
the bytes each rank hands to the all-reduce per step, and the theoretical communication time of
the uncompressed all-reduce, 2(N-1)/N x S/B (N = 2 ranks, S = 4 bytes x parameters, B = the
link). The limit: the same model with no compression on an unshaped link, where communication
is nearly free; `auto` runs there too (it should choose none and cost nothing), the two
alternating for `--rounds` rounds (default 3; the median counts), since a few percent is the
noise between two runs (auto's cost: the median of each round's auto over that round's none).

Convergence (`--convergence-steps`, default 150; 0 skips it): the loss does not depend on the
link, so the default model trains longer on the unshaped link under AdamW and under SGD with
none, PowerSGD and top-k (under AdamW also top-k after a dense warm-up); the table gives each
setting's bytes per step (mean over the run) and loss (mean of 5 steps) against none's at
steps 30, 60, 100 and the last (warm-up lasts 20 steps: 30 steps say little about convergence).
Written to benchmarks/results/compression-convergence.json.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gradmesh.netns import Hosts

HERE = Path(__file__).parent
RATE_MBIT = 200
SIZES = {"gpt-char": [], "gpt-char 4x wide": ["--set", "model.n_embd=512", "--set", "model.n_head=8"]}
SETTINGS = ["none", "fp16", "bf16", "powersgd:rank=4", "topk:ratio=0.1", "topk:ratio=0.01", "auto"]


def two_hosts(rate: str, steps: int, compression: str, extra: list[str]) -> list[dict]:
    """One run on 2 namespace hosts; its metrics rows."""
    with tempfile.TemporaryDirectory() as run_dir, Hosts(2, rate) as hosts:
        endpoint = f"{hosts.addresses[0]}:29400"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # 2 hosts share 2 cores
        nodes = [hosts.start(node, [sys.executable, "-m", "gradmesh", "train", "--nnodes", "2", "--nproc", "1",
                                    "--rdzv-endpoint", endpoint, "--rdzv-id", "bench", "--run-dir", run_dir, "--quiet",
                                    "--max-steps", str(steps), "--global-batch-size", "16", "--set", "train.sample_chars=0",
                                    "--set", "train.eval_batches=1", "--compression", compression, *extra], env=env)
                 for node in range(2)]
        for node in nodes:
            _, err = node.communicate(timeout=1800)
            if node.returncode:
                raise SystemExit(f"a node failed ({compression}):\n{err[-3000:]}")
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def params(extra: list[str]) -> int:
    from gradmesh import workloads
    from gradmesh.cli import build_parser
    from gradmesh.cli.options import resolve_config

    return sum(p.numel() for p in workloads.meta_model(resolve_config(build_parser().parse_args(["train", *extra]))).parameters())


def summarise(rows: list[dict], warmup: int) -> dict:
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[warmup:]),
            "loss": statistics.fmean(r["loss"] for r in rows[-5:]),
            "bytes": statistics.median(r["breakdown"]["comm_bytes"][0] for r in rows[warmup:])}


def paired(times: list[float], references: list[float]) -> float:
    """The median over rounds of each run's step time over its round's reference run's: the
    machine's drift between rounds cancels."""
    return statistics.median(t / r for t, r in zip(times, references))


def measure(args) -> list[dict]:
    found = []
    for size, extra in SIZES.items():
        p = params(extra)
        runs = {setting: summarise(two_hosts(f"{RATE_MBIT}mbit", args.steps, setting, extra), args.warmup)
                for setting in args.settings}
        # auto's cost where communication is nearly free is a few percent at most, the size of the
        # noise between two runs: none and auto alternate for --rounds rounds, medians kept
        unshaped = {"none": [], "auto": []}
        for _ in range(args.rounds):
            for setting, found_so_far in unshaped.items():
                found_so_far.append(summarise(two_hosts("", args.steps, setting, extra), args.warmup))
        for setting, rounds in unshaped.items():
            runs[f"{setting}, unshaped link"] = {**rounds[0], "step_s": statistics.median(r["step_s"] for r in rounds),
                                                 "rounds_step_s": [r["step_s"] for r in rounds]}
        runs["auto, unshaped link"]["paired_vs_none"] = paired(*(runs[f"{s}, unshaped link"]["rounds_step_s"]
                                                                 for s in ("auto", "none")))
        for setting, entry in runs.items():
            found.append({"model": size, "params": p, "setting": setting, **entry,
                          "theory_comm_s": 2 * (2 - 1) / 2 * 4 * p / (RATE_MBIT * 1e6 / 8)})
    return found


CONVERGENCE = {"adamw": ["none", "powersgd:rank=4", "topk:ratio=0.1", "topk:ratio=0.1,start=20", "topk:ratio=0.1,start=50",
                          "topk:ratio=0.01"],
               "sgd": ["none", "powersgd:rank=4", "topk:ratio=0.1", "topk:ratio=0.01"]}
"""Under AdamW also top-k after a dense warm-up (Lin et al. 2018): the first N steps uncompressed."""


def convergence(steps: int) -> list[dict]:
    marks = sorted({m for m in (30, 60, 100, steps) if m <= steps})
    found = []
    for optimizer, settings in CONVERGENCE.items():
        for setting in settings:
            rows = two_hosts("", steps, setting, ["--optimizer", optimizer])
            found.append({"optimizer": optimizer, "setting": setting,
                          "mean_bytes": statistics.fmean(r["breakdown"]["comm_bytes"][0] for r in rows),
                          "loss": {m: statistics.fmean(r["loss"] for r in rows[m - 5:m]) for m in marks}})
    return found


def show_convergence(found: list[dict]) -> None:
    marks = list(found[0]["loss"])
    table = Table(title="Convergence: loss against none's (default gpt-char, 2 hosts, unshaped link)")
    for column in ("optimizer", "setting", "bytes/step/rank (run mean)", *(f"step {m}" for m in marks)):
        table.add_column(column, justify="right")
    for row in found:
        none = next(r for r in found if r["optimizer"] == row["optimizer"] and r["setting"] == "none")
        table.add_row(row["optimizer"], row["setting"], f"{row['mean_bytes'] / 1e6:.2f} MB",
                      *(f"{row['loss'][m]:.3f} ({row['loss'][m] / none['loss'][m]:.3f}x)" for m in marks))
    Console(width=200).print(table)


def show(found: list[dict]) -> None:
    table = Table(title=f"2 hosts x 1 worker, {RATE_MBIT} Mbit/s link (median step time, final loss)")
    for column in ("model", "setting", "step time", "vs none", "vs unshaped", "bytes/step/rank", "final loss",
                   "vs none", "theory comm (none)"):
        table.add_column(column, justify="right")
    for row in found:
        none = next(r for r in found if r["model"] == row["model"] and r["setting"] == "none")
        free = next(r for r in found if r["model"] == row["model"] and r["setting"] == "none, unshaped link")
        table.add_row(row["model"], row["setting"], f"{row['step_s'] * 1e3:.0f} ms", f"{row['step_s'] / none['step_s']:.2f}x",
                      f"{row.get('paired_vs_none', row['step_s'] / free['step_s']):.2f}x", f"{row['bytes'] / 1e6:.2f} MB",
                      f"{row['loss']:.4f}",
                      f"{row['loss'] / none['loss']:.3f}x", f"{row['theory_comm_s'] * 1e3:.0f} ms")
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of none and auto on the unshaped link")
    parser.add_argument("--settings", nargs="*", default=SETTINGS, help="none given: the convergence table only")
    parser.add_argument("--convergence-steps", type=int, default=150)
    args = parser.parse_args()
    reason = Hosts.unavailable()
    if reason:
        raise SystemExit(f"bench_compression needs network namespaces: {reason}")
    (HERE / "results").mkdir(exist_ok=True)
    if args.settings:
        found = measure(args)
        show(found)
        (HERE / "results" / "compression.json").write_text(json.dumps(found, indent=1))
    if args.convergence_steps:
        converged = convergence(args.convergence_steps)
        show_convergence(converged)
        (HERE / "results" / "compression-convergence.json").write_text(json.dumps(converged, indent=1))


if __name__ == "__main__":
    main()
