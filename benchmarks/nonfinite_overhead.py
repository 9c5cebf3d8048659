"""Benchmark: what the per-step non-finite check costs (issue 25, item 1).

    .venv/bin/python benchmarks/nonfinite_overhead.py [--device cpu|cuda] [--rounds 3]

One process (world size 1, the same code path as N), the built-in gpt-char model at the README's
benchmark size: rounds alternate the check on and off (off: the engine's check replaced by one
that finds nothing), each timing `--steps` steps after a warm-up, in the same process so that
noise hits both alike. Prints the median step times and their ratio; writes
benchmarks/results/nonfinite.json.
"""

import argparse
import json
import statistics
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
    args = parser.parse_args()
    trainer = build(args.device, args.batch)
    checked = Engine.find_nonfinite
    time_steps(trainer, 5)  # warm-up
    on, off = [], []
    for _ in range(args.rounds):
        Engine.find_nonfinite = checked
        on.append(time_steps(trainer, args.steps))
        Engine.find_nonfinite = lambda self, loss_sum, step: None
        off.append(time_steps(trainer, args.steps))
    result = {"device": args.device, "batch": args.batch, "model": SIZE, "rounds": args.rounds,
              "step_ms_check_on": round(statistics.median(on) * 1e3, 3),
              "step_ms_check_off": round(statistics.median(off) * 1e3, 3),
              "ratio_on_to_off": round(statistics.median(a / b for a, b in zip(on, off)), 4)}
    print(json.dumps(result))
    out = Path(__file__).parent / "results" / "nonfinite.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**previous, args.device: result}, indent=1))


if __name__ == "__main__":
    main()
