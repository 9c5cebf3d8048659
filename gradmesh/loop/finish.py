"""The end of a run: the last checkpoint, the final weights and summary.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gradmesh.engine import peak_memory_bytes
from gradmesh.files import atomic_write, replacing
from gradmesh.loop.build import RunParts, Services
from gradmesh.loop.nonfinite import NonFiniteError
from gradmesh.loop.reporting import evaluate
from gradmesh.plan.steady import steady_step_s


def _peak_memory(topology) -> list[int]:
    peaks = torch.tensor([peak_memory_bytes(topology.device)], dtype=torch.int64, device=topology.device)
    gathered = [torch.zeros_like(peaks) for _ in range(topology.world_size)]
    dist.all_gather(gathered, peaks, group=topology.group("world"))
    return [int(t.item()) for t in gathered]


def _last_loss(rows) -> float | None:
    """The last step's loss that was finite (a skipped step has none)."""
    return next((row["loss"] for row in reversed(rows) if row.get("loss") is not None), None)


def against_prediction(run_dir: Path | None, rows) -> dict:
    """The launch's prediction (RUN_DIR/prediction.json, gradmesh's own) beside what this run
    measured: the steady step time of its latest steps (`gradmesh.plan.steady`)."""
    if not run_dir:
        return {}
    try:
        predicted = json.loads((Path(run_dir) / "prediction.json").read_text())
        found = {
            "plan": str(predicted["plan"]),
            "step_s": float(predicted["step_s"]),
            "peak_bytes": float(predicted["peak_bytes"]),
        }
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    times = [row["step_time_s"] for row in rows if row.get("step_time_s")]
    return {"predicted": found, "measured_step_s": steady_step_s(times) if times else None}


def _refuse_nonfinite(weights: dict[str, torch.Tensor], step: int) -> None:
    """The final weights file never holds a NaN or infinity written by training (the last
    update is the one no later step's check could catch)."""
    bad = [name for name, tensor in weights.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        message = (
            f"gradmesh: the weights after step {step} hold NaN or infinite values (first in {bad[0]!r}, "
            f"{len(bad)} tensor(s)); model.safetensors was not written: try a lower --lr or gradient clipping"
        )
        print(message, file=sys.stderr, flush=True)
        raise NonFiniteError(message)


def _write(run_dir: Path, weights: dict[str, torch.Tensor], summary: dict, step: int) -> None:
    """Rank 0: model.safetensors (refused where the weights are not finite), then summary.json."""
    from safetensors.torch import save_file

    _refuse_nonfinite(weights, step)

    with replacing(run_dir / "model.safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=1))


write_results = _write
"""Rank 0's model.safetensors and summary.json (also the actor-learner loop's)."""


def finish_run(
    parts: RunParts, services: Services, start_step: int, samples_at_start: int, wall: float
) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Collective: evaluate, checkpoint the last step, gather the final weights; rank 0 writes
    model.safetensors and summary.json. Returns the summary and, on rank 0, the final weights.
    samples_at_start: the samples consumed by the steps before `start_step`."""
    ctx, train, reporting = parts.ctx, parts.train, services.reporting
    topo, run_dir = ctx.topology, ctx.run_dir
    eval_metrics = evaluate(ctx, parts.eval_fn)
    steps = train.max_steps - start_step
    services.checkpointing.finish_run(train.max_steps, steps)
    weights = ctx.engine.full_state()
    last, train_time = reporting.totals.last, reporting.train_time
    summary = {
        "steps": train.max_steps,
        "steps_this_run": steps,
        "samples": reporting.samples,
        "wall_s": wall,
        "train_s": train_time,
        "samples_per_s": (reporting.samples - samples_at_start) / train_time if train_time else 0.0,
        "final_loss": _last_loss(reporting.totals.recent),
        "eval": eval_metrics,
        "world_size": topo.world_size,
        "strategy": parts.plan.label,
        "peak_memory_bytes": _peak_memory(topo),
        "model_state_bytes": last["model_state_bytes"] if last else [],
        "run_dir": str(run_dir) if run_dir else "",
        **parts.run_info,
        **(parts.monitor.summary(reporting.totals) if topo.is_main else {}),
        **reporting.totals.staleness(),
        **(against_prediction(run_dir, reporting.totals.recent) if topo.is_main else {}),
    }
    if services.nonfinite.skipped:
        summary["nonfinite_skipped_steps"] = services.nonfinite.skipped
    if topo.is_main and run_dir:
        _write(run_dir, weights, summary, train.max_steps)
    parts.monitor.close()
    return summary, weights if topo.is_main else None
