"""Benchmark: parameter servers against all-reduce, and the three ps modes under a straggler.

    .venv/bin/python benchmarks/bench_ps.py             # prints two tables, writes benchmarks/results/ps.json

(a) ps sync (1 server + 2 workers) against ddp (2 workers) on gpt-char and mlp-digits, run
    alternately in one invocation: steady step time (median of the steps after the first
    `--warmup`) and bytes on the wire per step summed over every rank, beside each formula:
    ddp's ring all-reduce sends 2(n-1)/n x 4P per rank; a ps worker pushes 4P and pulls 4P.
(b) sync, async and ssp:2 on gpt-char with worker 1 slowed 2x (`--inject slow:rank=1,factor=2`):
    the training time each needs to reach the loss sync reaches at its step N (losses smoothed
    over 10 steps; async and ssp run 1.5 N steps to get there), and each loss at step N (the same
    number of samples); medians of `--mode-rounds` alternating rounds.
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
GPT = ["--set", "model.n_layer=2", "--set", "model.n_embd=64", "--set", "model.n_head=4", "--set", "model.block_size=64",
       "--set", "train.sample_chars=0", "--set", "train.eval_batches=1", "--set", "data.max_chars=400000"]
MODELS = {"gpt-char": ["--model", "gpt-char", *GPT], "mlp-digits": ["--model", "mlp-digits"]}


def train(nproc: int, steps: int, batch: int, *extra: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(nproc), "--max-steps", str(steps),
               "--global-batch-size", str(batch), "--run-dir", run_dir, "--quiet", *extra]
        subprocess.run(cmd, check=True)
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def params(model: str) -> int:
    from gradmesh.cli.options import resolve_config
    from gradmesh.cli import build_parser
    from gradmesh import workloads

    cfg = resolve_config(build_parser().parse_args(["train", *MODELS[model]]))
    return sum(p.numel() for p in workloads.meta_model(cfg).parameters())


def wire_bytes(rows: list[dict], strategy: str, nproc: int) -> float:
    """Bytes every rank sent per step: ps counts them; ddp's reducer counts the buffer it all-reduces."""
    if strategy == "ps":
        return statistics.median(r["wire_bytes"] for r in rows)
    reduced = statistics.median(sum(r["breakdown"]["comm_bytes"]) for r in rows)  # over every rank
    return reduced * 2 * (nproc - 1) / nproc


def compare(args) -> list[dict]:
    found = []
    for model in MODELS:
        p = params(model)
        ways = {"ddp": (2, ["--strategy", "ddp"], 2 * (2 - 1) * 4 * p),
                "ps sync": (3, ["--strategy", "ps"], 2 * 2 * 4 * p)}
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, (nproc, extra, formula) in ways.items():
                rows = train(nproc, args.steps, 32, *MODELS[model], *extra)
                times[name].append((statistics.median(r["step_time_s"] for r in rows[args.warmup:]),
                                    wire_bytes(rows[args.warmup:], extra[1], nproc)))
        for name, (nproc, extra, formula) in ways.items():
            found.append({"model": model, "strategy": name, "workers": 2, "params": p,
                          "step_s": statistics.median(t for t, _ in times[name]),
                          "wire_bytes": statistics.median(b for _, b in times[name]), "formula_bytes": formula})
    return found


def smoothed(rows: list[dict], width: int = 10) -> list[float]:
    losses = [r["loss"] for r in rows]
    return [statistics.fmean(losses[max(0, i - width + 1):i + 1]) for i in range(len(losses))]


def reached(rows: list[dict], target: float) -> tuple[float, int] | None:
    """(training time, step) where the smoothed loss first reaches `target`; None if never."""
    elapsed = 0.0
    for row, loss in zip(rows, smoothed(rows)):
        elapsed += row["step_time_s"]
        if loss <= target:
            return elapsed, row["step"]
    return None


def straggler(args) -> list[dict]:
    """Sync runs N steps; async and ssp:2 run 1.5 N, so that a mode needing more steps than sync to
    reach sync's loss is timed to where it gets there. Final losses compare at step N (same samples).
    The asynchronous modes' curves depend on the order their updates happened to arrive in, and
    near step N the curves are flat enough that a small wobble moves the crossing by tens of steps:
    every mode runs `--mode-rounds` times, alternating, each round's times against that round's
    sync, and the table gives the medians (sync's loss is the same every round)."""
    per_round = {mode: [] for mode in ("sync", "async", "ssp:2")}
    for _ in range(args.mode_rounds):
        for mode, found in per_round.items():
            steps = args.modes_steps if mode == "sync" else args.modes_steps * 3 // 2
            found.append(train(3, steps, args.modes_batch, *MODELS["gpt-char"], "--strategy", "ps", "--ps-mode", mode,
                               "--inject", "slow:rank=1,factor=2"))
    result = []
    for mode, runs in per_round.items():
        entry = {"mode": mode, "rounds": []}
        for rows, sync in zip(runs, per_round["sync"]):
            target, sync_time = smoothed(sync)[-1], sum(r["step_time_s"] for r in sync)
            hit = reached(rows, target)
            at_n = rows[:args.modes_steps]
            entry["rounds"].append({
                "time_ratio": hit[0] / sync_time if hit else None, "steps_to_sync_loss": hit[1] if hit else None,
                "step_s": statistics.fmean(r["step_time_s"] for r in at_n), "final_loss": smoothed(rows)[args.modes_steps - 1],
                "loss_ratio": smoothed(rows)[args.modes_steps - 1] / target,
                "staleness_max": max(r["staleness_max"] for r in at_n)})
        for key in ("step_s", "final_loss", "loss_ratio"):
            entry[key] = statistics.median(r[key] for r in entry["rounds"])
        hits = [r for r in entry["rounds"] if r["time_ratio"] is not None]
        entry["time_ratio"] = statistics.median(r["time_ratio"] for r in hits) if len(hits) * 2 > len(entry["rounds"]) else None
        entry["time_ratios"] = [r["time_ratio"] for r in entry["rounds"]]
        entry["steps_to_sync_loss"] = [r["steps_to_sync_loss"] for r in entry["rounds"]]
        entry["staleness_max"] = max(r["staleness_max"] for r in entry["rounds"])
        result.append(entry)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes-steps", type=int, default=50, help="(b)'s N: sync's steps")
    parser.add_argument("--mode-rounds", type=int, default=3)
    parser.add_argument("--modes-batch", type=int, default=128, help="global batch of (b)'s runs")
    parser.add_argument("--only", choices=["compare", "straggler"], help="run one part")
    args = parser.parse_args()
    out = HERE / "results" / "ps.json"
    result = json.loads(out.read_text()) if args.only and out.exists() else {}  # the other part kept
    if args.only != "straggler":
        result["compare"] = compare(args)
        show_compare(result["compare"])
    if args.only != "compare":
        result["straggler"] = straggler(args)
        show_straggler(result["straggler"])
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def show_compare(found: list[dict]) -> None:
    table = Table(title="ps sync vs ddp, 2 workers (median step time, bytes per step over all ranks)")
    for column in ("model", "strategy", "step time", "vs ddp", "bytes/step", "formula"):
        table.add_column(column, justify="right")
    for row in found:
        ddp = next(r for r in found if r["model"] == row["model"] and r["strategy"] == "ddp")
        table.add_row(row["model"], row["strategy"], f"{row['step_s'] * 1e3:.1f} ms", f"{row['step_s'] / ddp['step_s']:.2f}x",
                      f"{row['wire_bytes'] / 1e6:.3f} MB", f"{row['formula_bytes'] / 1e6:.3f} MB")
    Console().print(table)


def show_straggler(found: list[dict]) -> None:
    table = Table(title="gpt-char, 1 server + 2 workers, worker 1 slowed 2x")
    for column in ("mode", "step time", "time to sync's loss (median)", "each round", "steps", "loss at step N",
                   "vs sync", "max staleness"):
        table.add_column(column, justify="right")
    for row in found:
        ratio = f"{row['time_ratio']:.2f}x" if row["time_ratio"] else "not reached"
        rounds = " ".join(f"{r:.2f}" if r else "-" for r in row["time_ratios"])
        steps = " ".join(str(s) if s else "-" for s in row["steps_to_sync_loss"])
        table.add_row(row["mode"], f"{row['step_s'] * 1e3:.1f} ms", ratio, rounds, steps, f"{row['final_loss']:.4f}",
                      f"{row['loss_ratio']:.3f}x", str(row["staleness_max"]))
    Console().print(table)

if __name__ == "__main__":
    main()
