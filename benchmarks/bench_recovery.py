"""Benchmark: recovery from a killed worker under `--recovery restart` and `--recovery inplace`.

    .venv/bin/python benchmarks/bench_recovery.py     # prints a table, writes benchmarks/results/recovery.json

A gpt-char run (the default model) on 2 or 4 workers is killed at rank 1 mid-run by `--inject`.
Recovery time = from the kill (its timestamp in faults.jsonl) to the end of the first step
completed after the restart (its timestamp in metrics.jsonl): detection by torch elastic,
restart of every worker, process group, data and model set-up, checkpoint load, one step.
Work lost = steps finished after the checkpoint that was resumed, done again (an async
checkpoint is published once its write is known complete, at the next checkpoint); in place,
only the interrupted step is redone, by the survivors. Each
configuration also runs without a fault, to compare the final weights and the cost of the
checkpoints themselves.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file

HERE = Path(__file__).parent
STEPS, KILL_STEP = 60, 26
CONFIGS = {  # name: (workers, flags)
    "restart, checkpoint every 10 steps": (2, ["--recovery", "restart", "--checkpoint-every", "10"]),
    "restart, checkpoint every 2 steps, async": (2, ["--recovery", "restart", "--checkpoint-every", "2",
                                                     "--async-checkpoint"]),
    "in place": (2, ["--recovery", "inplace", "--max-restarts", "0"]),
    "in place, 4 workers": (4, ["--recovery", "inplace", "--max-restarts", "0"]),
    "in place + replacement, 4 workers": (4, ["--recovery", "inplace", "--max-restarts", "1"]),
}
FLOOR_WORKERS = 2  # the fault-free run at another world size: the summation-order noise floor


def train(run_dir: Path, nproc: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(nproc), "--max-steps", str(STEPS),
           # --overwrite: the fault-free run of each width is trained again for every recovery mode
           "--run-dir", str(run_dir), "--overwrite", "--quiet", "--set", "train.sample_chars=0",
           "--set", "train.eval_batches=1",
           "--set", "train.log_every=1", "--record-samples", *extra]
    subprocess.run(cmd, check=True, capture_output=True)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "model.safetensors"))


def rel_l2(a: dict, b: dict) -> float:
    diff = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)
    return (diff / sum(float((b[k].double() ** 2).sum()) for k in b)) ** 0.5


def measure(name: str, nproc: int, flags: list[str], tmp: Path) -> dict:
    clean, faulty = tmp / f"clean-{nproc}", tmp / name.replace(" ", "-").replace(",", "")
    checkpoints = flags[flags.index("--checkpoint-every"):] if "--checkpoint-every" in flags else []
    train(clean, nproc, *checkpoints)
    train(faulty, nproc, *flags, "--inject", f"kill:rank=1,step={KILL_STEP}")
    kill = lines(faulty / "faults.jsonl")[0]["time"]
    rows = lines(faulty / "metrics.jsonl")
    after = [row for row in rows if row["time"] > kill]
    if "inplace" in flags:  # the survivors redo the interrupted step
        first = next(row for row in after if row["step"] == KILL_STEP)
    else:  # the restarted workers begin after the checkpoint they resumed
        first = min(after, key=lambda row: row["step"])
    resumed = first["step"] - 1
    result = {"recovery": name, "workers": nproc, "kill_step": KILL_STEP, "resumed_from": resumed,
              "steps_lost": KILL_STEP - 1 - resumed, "recovery_s": first["time"] - kill,
              "final_rel_l2_vs_fault_free": rel_l2(weights(faulty), weights(clean)),
              "fault_free_wall_s": json.loads((clean / "summary.json").read_text())["wall_s"]}
    joined = sorted(faulty.glob(f"samples-rank{nproc}.jsonl"))
    if joined:  # a replacement: when it ran its first step, back at full width
        step = lines(joined[0])[0]["step"]
        result["full_width_again_at_step"] = step
        result["full_width_again_s"] = next(row["time"] for row in rows if row["step"] == step) - kill
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "recovery.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, nproc, flags, Path(tmp)) for name, (nproc, flags) in CONFIGS.items()]
        # Noise floor: the same fault-free training at 2 and at 4 workers differs only in
        # floating-point summation order; in-place recovery changes the width mid-run, no more.
        floor = rel_l2(weights(Path(tmp) / f"clean-{FLOOR_WORKERS}"), weights(Path(tmp) / "clean-4"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "floor_rel_l2_2_vs_4_workers": floor}, indent=1))
    table = Table(title=f"recovery: rank 1 killed before step {KILL_STEP} of {STEPS}")
    for col in ("recovery", "workers", "resumed after step", "steps lost", "kill -> first step done",
                "back to full width", "final weights vs fault-free (rel. L2)"):
        table.add_column(col, justify="left" if col == "recovery" else "right")
    for row in rows:
        back = (f"{row['full_width_again_s']:.2f} s (step {row['full_width_again_at_step']})"
                if "full_width_again_s" in row else "-")
        table.add_row(row["recovery"], str(row["workers"]), str(row["resumed_from"]), str(row["steps_lost"]),
                      f"{row['recovery_s']:.2f} s", back, f"{row['final_rel_l2_vs_fault_free']:.1e}")
    Console(width=200).print(table)
    print(f"noise floor: fault-free at 2 vs 4 workers, rel. L2 {floor:.1e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
