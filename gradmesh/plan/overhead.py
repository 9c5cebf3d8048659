"""What a strategy's machinery costs beyond the model's own arithmetic, measured on one worker.

A forward and backward pass of the plain model (`gradmesh.plan.compute`) is not what a rank runs:
the training loop has its per-step work (the sampler, metrics, the monitor), and a strategy wraps
the model in its own machinery — FSDP2's hooks around every unit, DTensor's dispatch under tensor
parallelism, a pipeline schedule's stage calls. On small models on a CPU that machinery can cost
as much as the arithmetic. So each strategy that can run on one worker trains a few steps there,
for real (`gradmesh train --nproc 1`, with the thread count and the per-rank batch a worker of
the planned job would have), and what its median step takes beyond the plain model's pass and
optimizer step is kept per strategy, per micro-batch pass. One worker moves nothing over the
network, so this overhead and the link's collectives (`gradmesh.plan.link`) do not overlap.
"""

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from gradmesh import config as configuration
from gradmesh.env import environment
from gradmesh.parallel import registry
from gradmesh.plan.compute import ComputeProfile, calibration_config
from gradmesh.plan.steady import steady_step_s, steps_for

STEPS = 24
"""Steps per run at least (more where steps are short: `steps_for`); the steady step of the
second half is kept (the first carry one-off costs)."""
TRIALS = 2
"""Runs per trial of several workers; the faster is kept. A busy neighbour only ever slows a
run, and workers in lockstep feel it most: one slowed calibration run shifts every plan it
feeds (timeit's rule). A one-worker trial runs once."""


def trial_step(
    cfg: configuration.Config,
    strategy: str,
    batch: int,
    threads: int,
    nproc: int = 1,
    estimate_s: float = 1.0,
    grad_accum: int = 1,
    compression: str = "none",
) -> tuple[float, int] | None:
    """(steady step seconds, peak memory bytes) of `strategy` on `nproc` local workers of
    `threads` threads, global batch `batch` in `grad_accum` micro-batches, gradients reduced
    under `compression`, as many steps as a step of about `estimate_s` needs; None where it
    cannot run so."""
    if not runnable(cfg, strategy, batch, nproc):
        return None  # refused by train's own checks: no process to start
    with tempfile.TemporaryDirectory(prefix="gradmesh-overhead-") as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(calibration_config(cfg).to_toml())
        cmd = [
            sys.executable, "-m", "gradmesh", "train", "--config", str(config), "--nproc", str(nproc),
            "--strategy", strategy, "--mesh", "", "--max-steps", str(steps_for(estimate_s, STEPS)),
            "--global-batch-size", str(batch),
            "--grad-accum", str(grad_accum), "--compression", compression, "--quiet",
            "--set", "train.sample_chars=0", "--set", "train.eval_batches=1",
        ]  # fmt: skip
        env = dict(environment(), OMP_NUM_THREADS=str(threads))
        label = f"--strategy {strategy} on {nproc} worker(s), {grad_accum} micro-batch(es)"
        trials = range(TRIALS if nproc > 1 else 1)
        runs = [_run([*cmd, "--run-dir", str(Path(tmp) / f"run{i}")], env, label) for i in trials]
    found = [run for run in runs if run is not None]
    return min(found) if found else None


FAILED_TRIALS: list[str] = []
"""This process's trial runs that failed, a line each: `planner.calibrate` says so and does not
cache a calibration that lacks them (a missing overhead would make its plans look faster)."""


def _run(cmd: list[str], env: dict[str, str], label: str) -> tuple[float, int] | None:
    """(steady step seconds, peak memory bytes) of one trial run; None where it failed."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        FAILED_TRIALS.append(f"{label}: exit {done.returncode}: {last}")
        return None
    run_dir = Path(cmd[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peak = max(json.loads((run_dir / "summary.json").read_text())["peak_memory_bytes"])
    return steady_step_s([row["step_time_s"] for row in rows]), peak


def runnable(cfg: configuration.Config, strategy: str, batch: int, nproc: int) -> bool:
    from gradmesh import workloads
    from gradmesh.errors import UsageError
    from gradmesh.parallel.jobs import job_plan

    train = dataclasses.replace(
        cfg.train, strategy=strategy, mesh="", grad_accum=1, compression="none", global_batch_size=batch
    )
    trial = dataclasses.replace(cfg, train=train)
    try:
        job_plan(trial, nproc, nproc, lambda: workloads.meta_model(trial))
    except UsageError:
        return False
    return True


def measure_overheads(cfg: configuration.Config, profile: ComputeProfile, batch: int, slots: int) -> dict[str, float]:
    """{strategy: seconds per micro-batch pass beyond the plain model's}; "loop": the training
    loop's own per-step seconds (what the first row's one-worker step takes beyond pass and
    optimizer); "base_bytes": a worker's memory beside model state and activations (torch, the
    process group, the data), from that run's peak."""
    modelled = profile.pass_s(batch) + profile.optimizer_s_per_param * profile.params
    first = registry.ROWS[0]
    found: dict[str, float] = {}
    base = float(profile.base_bytes)
    for row in registry.ROWS:
        if row.has_servers:  # servers need a rank of their own: modelled, not measured on one
            continue
        measured = trial_step(cfg, row.name, batch, profile.threads, estimate_s=modelled)
        if measured is None:
            continue
        found[row.name] = measured[0] - modelled
        if row is first:
            held = first.state_bytes(registry.ModelSize(params=profile.params, slots=slots), 1)
            base = max(measured[1] - held - profile.activation_bytes_per_sample * batch, base)
    loop = max(found.get(first.name, 0.0), 0.0)
    overheads = {name: max(extra - loop, 0.0) for name, extra in found.items()}
    # The loop's passes over every gradient grow with the gradients a rank holds; the rest is fixed.
    swept = min(profile.sweep_s_per_param * profile.params, loop)
    return {"loop": loop - swept, "loop_s_per_param": swept / max(profile.params, 1), "base_bytes": base, **overheads}
