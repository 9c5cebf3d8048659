"""Benchmark: recovery from a killed worker under `--recovery restart` and `--recovery inplace`.

    .venv/bin/python benchmarks/bench_recovery.py     # prints a table, writes benchmarks/results/recovery.json

A 2-worker gpt-char run (the default model) is killed at one rank mid-run by `--inject`.
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
STEPS, KILL_STEP = 40, 26
CONFIGS = {  # name: (workers, flags)
    "restart, checkpoint every 10 steps": (2, ["--recovery", "restart", "--checkpoint-every", "10"]),
    "restart, checkpoint every 2 steps, async": (2, ["--recovery", "restart", "--checkpoint-every", "2",
                                                     "--async-checkpoint"]),
    "inplace": (2, ["--recovery", "inplace"]),
    "inplace, 4 workers": (4, ["--recovery", "inplace"]),
}


def train(run_dir: Path, nproc: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(nproc), "--max-steps", str(STEPS),
           "--run-dir", str(run_dir), "--quiet", "--set", "train.sample_chars=0", "--set", "train.eval_batches=1",
           "--set", "train.log_every=1", *extra]
    subprocess.run(cmd, check=True, capture_output=True)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rel_l2(a: dict, b: dict) -> float:
    diff = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)
    return (diff / sum(float((b[k].double() ** 2).sum()) for k in b)) ** 0.5


def measure(name: str, nproc: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        clean, faulty = Path(tmp) / "clean", Path(tmp) / "faulty"
        checkpoints = [f for f in flags if f != "--recovery" and f not in ("restart", "inplace")]
        train(clean, nproc, *checkpoints)
        train(faulty, nproc, *flags, "--inject", f"kill:rank=1,step={KILL_STEP}")
        kill = lines(faulty / "faults.jsonl")[0]["time"]
        after = [row for row in lines(faulty / "metrics.jsonl") if row["time"] > kill]
        if "inplace" in flags:  # the survivors redo the interrupted step
            first = next(row for row in after if row["step"] == KILL_STEP)
        else:  # the restarted workers begin after the checkpoint they resumed
            first = min(after, key=lambda row: row["step"])
        resumed = first["step"] - 1
        a, b = load_file(str(faulty / "model.safetensors")), load_file(str(clean / "model.safetensors"))
        clean_time = json.loads((clean / "summary.json").read_text())["wall_s"]
        return {"recovery": name, "workers": nproc, "kill_step": KILL_STEP, "resumed_from": resumed,
                "steps_lost": KILL_STEP - 1 - resumed, "recovery_s": first["time"] - kill,
                "final_rel_l2_vs_fault_free": rel_l2(a, b), "fault_free_wall_s": clean_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "recovery.json"))
    args = parser.parse_args()
    rows = [measure(name, nproc, flags) for name, (nproc, flags) in CONFIGS.items()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    table = Table(title=f"recovery: rank 1 killed before step {KILL_STEP} of {STEPS}")
    for col in ("recovery", "workers", "resumed after step", "steps lost", "kill -> first step done",
                "final weights vs fault-free (rel. L2)"):
        table.add_column(col, justify="left" if col == "recovery" else "right")
    for row in rows:
        table.add_row(row["recovery"], str(row["workers"]), str(row["resumed_from"]), str(row["steps_lost"]),
                      f"{row['recovery_s']:.2f} s", f"{row['final_rel_l2_vs_fault_free']:.1e}")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
