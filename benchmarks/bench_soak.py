"""Benchmark: a chaos soak — 50 random faults in one run, under each recovery mode.

    .venv/bin/python benchmarks/bench_soak.py     # prints a table, writes benchmarks/results/soak.json

Each run trains the small gpt-char model (2 workers, 16 samples a step, a checkpoint every 5
steps, every rank's sample indices recorded) under `--inject chaos:faults=50,seed=S`: seeded
kills (those at checkpoint steps in the middle of the checkpoint write), hangs (caught by
`--step-timeout 2`) and slow-downs of 1-3 steps, aimed at any rank, rank 0 included.
In place, replacement workers are started for the lost ones (`--max-restarts 60`) and the steps
are paced (`pace=1`: a second of simulated compute a step) so replacements, which take seconds to
start, join mid-run; a kill or hang while one worker is left waits until one has joined.

Per mode: faults injected and survived; time lost per fault — for a kill or hang, from the fault
(its time in faults.jsonl) to the end of the first step completed after it, less a normal step;
for a slow-down, the excess of the steps it slowed —; samples lost or repeated against the
fault-free run (every step's indices over all ranks); and the final weights' distance from the
fault-free run beside twice the summation-order floor (fault-free at 1 vs 2 workers).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_recovery import lines, rel_l2, weights

HERE = Path(__file__).parent
COMMON = ["--global-batch-size", "16", "--checkpoint-every", "5", "--record-samples", "--quiet",
          "--set", "train.sample_chars=0", "--set", "train.eval_batches=1", "--set", "train.log_every=1",
          "--set", "model.n_layer=2", "--set", "model.n_head=2", "--set", "model.n_embd=32",
          "--set", "model.block_size=32", "--set", "data.max_chars=60000"]
MODES = {  # name: (steps per planned fault, flags, chaos extras); in place, faults wait for replacements
    "restart": (2, ["--recovery", "restart", "--max-restarts", "100"], ""),
    "in place + replacements": (4, ["--recovery", "inplace", "--max-restarts", "100"], ",pace=1"),
}


def train(run_dir: Path, nproc: int, steps: int, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(nproc), "--max-steps", str(steps),
           "--run-dir", str(run_dir), "--overwrite", *COMMON, *extra]
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def batches(run_dir: Path) -> dict[int, Counter]:
    found: dict[int, Counter] = {}
    for path in run_dir.glob("samples-rank*.jsonl"):
        for record in lines(path):
            found.setdefault(record["step"], Counter()).update(record["indices"])
    return found


def samples_off(run_dir: Path, reference: Path) -> int:
    """Indices missing or repeated at some step, against the fault-free run."""
    got, want = batches(run_dir), batches(reference)
    return sum(sum(((got.get(s, Counter()) - want[s]) + (want[s] - got.get(s, Counter()))).values())
               for s in set(got) | set(want))


def time_lost(run_dir: Path, fired: list[dict]) -> list[float]:
    rows = {row["step"]: row for row in lines(run_dir / "metrics.jsonl")}
    normal = statistics.median(row["step_time_s"] for row in rows.values())
    lost = []
    for fault in fired:
        if ":slow@" in fault["fault"]:
            window = int(fault["fault"].split("steps=")[1].split(",")[0])
            slowed = [rows[s]["step_time_s"] - normal for s in range(fault["step"], fault["step"] + window) if s in rows]
            lost.append(max(0.0, sum(slowed)))
        else:
            done = rows[fault["step"]]["time"]  # the step the fault hit, as finally completed
            lost.append(max(0.0, done - fault["time"] - normal))
    return lost


def soak(root: Path, name: str, seed: int, faults: int) -> dict:
    per_fault, flags, extra = MODES[name]
    steps = per_fault * faults + 20
    clean2, clean1 = root / f"{steps}-clean-2", root / f"{steps}-clean-1"
    for run_dir, nproc in ((clean2, 2), (clean1, 1)):
        if not (run_dir / "model.safetensors").exists():
            train(run_dir, nproc, steps, "--step-timeout", "2")
    run_dir = root / name.split()[0]
    done = train(run_dir, 2, steps, *flags, "--step-timeout", "2", "--inject", f"chaos:faults={faults},seed={seed}{extra}",
                 check=False)
    (run_dir / "launcher.log").write_text(done.stdout + done.stderr)
    fired = [e for e in lines(run_dir / "faults.jsonl") if e.get("fault", "").startswith("chaos#")]
    if done.returncode != 0:
        print(f"{name}: the run failed (exit {done.returncode}) after {len(fired)} faults; last lines:\n"
              + "\n".join(done.stderr.strip().splitlines()[-8:]), file=sys.stderr)
        return {"mode": name, "steps": steps, "faults_planned": faults, "faults_injected": len(fired), "kinds": {},
                "at_checkpoint": 0, "rank0_hit": 0, "survived": False, "lost_mean_s": 0.0, "lost_worst_s": 0.0,
                "samples_lost": -1, "rel_l2": float("nan"), "floor": float("nan"), "exit": done.returncode}
    lost = time_lost(run_dir, fired)
    kinds = Counter(e["fault"].split(":")[1].split("@")[0] for e in fired)
    return {"mode": name, "steps": steps, "faults_planned": faults, "faults_injected": len(fired),
            "kinds": dict(kinds), "at_checkpoint": sum(",at=checkpoint" in e["fault"] for e in fired),
            "rank0_hit": sum(e["rank"] == 0 for e in fired),
            "survived": (run_dir / "summary.json").exists(), "lost_mean_s": statistics.mean(lost) if lost else 0.0,
            "lost_worst_s": max(lost, default=0.0), "samples_lost": samples_off(run_dir, clean2),
            "rel_l2": rel_l2(weights(run_dir), weights(clean2)), "floor": rel_l2(weights(clean1), weights(clean2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--mode", choices=tuple(MODES), action="append", help="only these (default: all)")
    parser.add_argument("--keep", metavar="DIR", help="keep the run directories in DIR (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        results = [soak(root, name, args.seed, args.faults) for name in args.mode or MODES]
    table = Table(title=f"chaos soak: {args.faults} planned faults, seed {args.seed}, 2 workers")
    for column in ("recovery", "steps", "injected (kill/hang/slow)", "mid-checkpoint", "rank 0 hit", "survived",
                   "time lost / fault, mean", "worst", "samples lost", "rel. L2 vs fault-free", "2 x floor"):
        table.add_column(column)
    for r in results:
        kinds = "/".join(str(r["kinds"].get(k, 0)) for k in ("kill", "hang", "slow"))
        table.add_row(r["mode"], str(r["steps"]), f"{r['faults_injected']} ({kinds})", str(r["at_checkpoint"]),
                      str(r["rank0_hit"]), "yes" if r["survived"] else "NO", f"{r['lost_mean_s']:.2f} s",
                      f"{r['lost_worst_s']:.2f} s", str(r["samples_lost"]), f"{r['rel_l2']:.2e}", f"{2 * r['floor']:.2e}")
    Console().print(table)
    out = HERE / "results" / "soak.json"
    out.write_text(json.dumps({"command": "benchmarks/bench_soak.py", "faults": args.faults, "seed": args.seed,
                               "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
