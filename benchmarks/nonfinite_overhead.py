"""Benchmark: what the per-step non-finite check costs (issue 25, item 1).

    .venv/bin/python benchmarks/nonfinite_overhead.py [--device cpu|cuda] [--rounds 3] [--nproc 2]

The built-in gpt-char model at the benchmarks page's size (docs/benchmarks.md), under ddp: rounds alternate the check
on and off (off: the engine's check replaced by one that finds nothing), each timing `--steps`
steps after a warm-up, in the same processes so that noise hits both alike. `--nproc 1` (the
default) times the check's own work (one fused norm pass); `--nproc N` relaunches this script on
N workers with `gradmesh run`, so the check's all-reduce and its wait for the other ranks are
timed too (every rank switches the check together; rank 0 reports). Prints the median step times
and their ratio; writes benchmarks/results/nonfinite.json under "DEVICE" or "DEVICE@N".
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import gradmesh
from gradmesh import config as configuration
from gradmesh import workloads
from gradmesh.engine.base import Engine

SIZE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}


def build(device: str, batch: int) -> gradmesh.Trainer:
    sets = [f"model.{k}={v}" for k, v in SIZE.items()] + ["train.sample_chars=0", f"launch.device={device}"]
    cfg = configuration.build([configuration.parse_sets(sets)])
    session = gradmesh.init(device=device)
    workload = workloads.build(cfg, session.device)
    train = gradmesh.TrainConfig(global_batch_size=batch, max_steps=10**6)
    return gradmesh.Trainer(session, workload.model, workload.loss_fn, workload.train_data, train=train, quiet=True)


def time_steps(trainer: gradmesh.Trainer, steps: int) -> float:
    """Median seconds per step over `steps` optimizer steps."""
    times = []
    for _ in range(steps):
        batch = trainer.sampler.next_global()
        if trainer.topo.device.type == "cuda":
            torch.cuda.synchronize()
        tic = time.perf_counter()
        trainer.engine.step(batch, trainer.probe)
        if trainer.topo.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    if args.nproc > 1 and "RANK" not in os.environ:  # relaunched on N workers; they come back here
        command = [sys.executable, "-m", "gradmesh", "run", "--nproc", str(args.nproc), "--device", args.device,
                   __file__, *sys.argv[1:]]
        raise SystemExit(subprocess.run(command).returncode)
    trainer = build(args.device, args.batch)
    checked = Engine.find_nonfinite
    time_steps(trainer, 5)  # warm-up
    on, off = [], []
    for _ in range(args.rounds):
        Engine.find_nonfinite = checked
        on.append(time_steps(trainer, args.steps))
        Engine.find_nonfinite = lambda self, loss_sum, step: None
        off.append(time_steps(trainer, args.steps))
    if trainer.topo.rank != 0:
        return
    result = {"device": args.device, "nproc": args.nproc, "batch": args.batch, "model": SIZE, "rounds": args.rounds,
              "step_ms_check_on": round(statistics.median(on) * 1e3, 3),
              "step_ms_check_off": round(statistics.median(off) * 1e3, 3),
              "ratio_on_to_off": round(statistics.median(a / b for a, b in zip(on, off)), 4),
              "ratio_per_round": [round(a / b, 3) for a, b in zip(on, off)]}
    print(json.dumps(result))
    out = Path(__file__).parent / "results" / "nonfinite.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    key = args.device if args.nproc == 1 else f"{args.device}@{args.nproc}"
    out.write_text(json.dumps({**previous, key: result}, indent=1))


if __name__ == "__main__":
    main()
