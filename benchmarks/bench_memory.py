"""Benchmark: model-state bytes per rank for ddp, zero1 and fsdp at 1, 2 and 4 ranks, beside
the ZeRO paper's formulas for fp32 Adam with P parameters (ddp 16P; zero1 8P + 8P/N; fsdp 16P/N).

    .venv/bin/python benchmarks/bench_memory.py        # prints a table, writes benchmarks/results/memory.json

Model-state bytes are counted by gradmesh from the tensors each rank holds (parameters,
gradients, optimizer state; local shards only) right after an optimizer step.
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
FORMULAS = {"ddp": lambda p, n: 16 * p, "zero1": lambda p, n: 8 * p + 8 * p / n, "fsdp": lambda p, n: 16 * p / n}
SIZE = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 64}


def measure(strategy: str, nproc: int) -> tuple[int, list[int], list[int]]:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "train", "--strategy", strategy, "--nproc", str(nproc),
               "--max-steps", "3", "--global-batch-size", "8", "--run-dir", run_dir, "--quiet",
               "--set", "train.sample_chars=0", "--set", "train.eval_batches=1"]
        for key, value in SIZE.items():
            cmd += ["--set", f"model.{key}={value}"]
        subprocess.run(cmd, check=True)
        params = sum(t.numel() for t in load_file(str(Path(run_dir) / "model.safetensors")).values())
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        return params, summary["model_state_bytes"], summary["peak_memory_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "memory.json"))
    args = parser.parse_args()
    rows = []
    for strategy in FORMULAS:
        for nproc in (1, 2, 4):
            params, state, peak = measure(strategy, nproc)
            expected = FORMULAS[strategy](params, nproc)
            worst = max(abs(b / expected - 1) for b in state)
            rows.append({"strategy": strategy, "ranks": nproc, "params": params, "model_state_bytes": state,
                         "formula_bytes": expected, "worst_deviation": worst, "peak_memory_bytes": peak})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": SIZE, "rows": rows}, indent=1))
    table = Table(title=f"model-state bytes per rank, fp32 Adam, P = {rows[0]['params']:,} parameters")
    for col in ("strategy", "ranks", "measured per rank (MiB)", "formula (MiB)", "formula", "worst deviation"):
        table.add_column(col, justify="left" if col in ("strategy", "formula") else "right")
    names = {"ddp": "16P", "zero1": "8P + 8P/N", "fsdp": "16P/N"}
    for row in rows:
        measured = ", ".join(f"{b / 2**20:.2f}" for b in row["model_state_bytes"])
        table.add_row(row["strategy"], str(row["ranks"]), measured, f"{row['formula_bytes'] / 2**20:.2f}",
                      names[row["strategy"]], f"{row['worst_deviation']:.1%}")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
