"""The end of a run: the last checkpoint, the final weights and summary.json."""

import json
import sys

import torch
import torch.distributed as dist

from gradmesh.engine import peak_memory_bytes
from gradmesh.files import atomic_write, replacing
from gradmesh.loop.nonfinite import NonFiniteError
from gradmesh.loop.reporting import evaluate


def _peak_memory(topology) -> list[int]:
    peaks = torch.tensor([peak_memory_bytes(topology.device)], dtype=torch.int64, device=topology.device)
    gathered = [torch.zeros_like(peaks) for _ in range(topology.world_size)]
    dist.all_gather(gathered, peaks, group=topology.group("world"))
    return [int(t.item()) for t in gathered]


def _last_loss(rows) -> float | None:
    """The last step's loss that was finite (a skipped step has none)."""
    return next((row["loss"] for row in reversed(rows) if row.get("loss") is not None), None)


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


def finish_run(trainer, start_step: int, wall: float) -> dict:
    """Collective: evaluate, checkpoint the last step, gather the final weights; rank 0 writes
    model.safetensors and summary.json. Returns the summary."""
    topo, train, reporting = trainer.topo, trainer.train, trainer.services.reporting
    eval_metrics = evaluate(trainer.ctx, trainer.eval_fn)
    steps = train.max_steps - start_step
    trainer.services.checkpointing.finish_run(train.max_steps, steps)
    weights = trainer.engine.full_state()
    last, train_time = reporting.totals.last, reporting.train_time
    summary = {
        "steps": train.max_steps,
        "steps_this_run": steps,
        "samples": reporting.samples,
        "wall_s": wall,
        "train_s": train_time,
        "samples_per_s": (reporting.samples - trainer.samples_before(start_step)) / train_time if train_time else 0.0,
        "final_loss": _last_loss(reporting.totals.recent),
        "eval": eval_metrics,
        "world_size": topo.world_size,
        "strategy": trainer.plan.label,
        "peak_memory_bytes": _peak_memory(topo),
        "model_state_bytes": last["model_state_bytes"] if last else [],
        "run_dir": str(trainer.run_dir) if trainer.run_dir else "",
        **trainer.run_info,
        **(trainer.monitor.summary(reporting.totals) if topo.is_main else {}),
        **reporting.totals.staleness(),
    }
    trainer.final_weights = weights if topo.is_main else None
    if trainer.services.nonfinite.skipped:
        summary["nonfinite_skipped_steps"] = trainer.services.nonfinite.skipped
    if topo.is_main and trainer.run_dir:
        from safetensors.torch import save_file

        _refuse_nonfinite(weights, train.max_steps)

        with replacing(trainer.run_dir / "model.safetensors") as tmp:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
        atomic_write(trainer.run_dir / "summary.json", json.dumps(summary, indent=1))
    trainer.monitor.close()
    return summary
