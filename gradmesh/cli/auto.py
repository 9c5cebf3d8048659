"""The planner at launch: `--strategy auto` plans and runs the best plan; any other run gets the
prediction of its own configuration (when this machine has a cached calibration for the model),
written to RUN_DIR/prediction.json for the summary's predicted-vs-measured rows, and a note when
a clearly better plan exists."""

import json
import sys
from pathlib import Path

from gradmesh import config as configuration
from gradmesh.errors import UsageError
from gradmesh.files import atomic_write

AUTO = "auto"
BETTER_BY = 1.5
"""A plan predicted this much faster than the user's own choice earns a note before launch."""
PREDICTION = "prediction.json"


def _say(text: str) -> None:
    print(f"gradmesh: {text}", file=sys.stderr, flush=True)


def _machine(cfg: configuration.Config, nproc: int, device: str):
    from gradmesh.cli.plan_table import machine_for

    return machine_for(cfg, nproc, device, None)


def placeholder(cfg: configuration.Config) -> configuration.Config:
    """`cfg` as the registry's first strategy alone, with the default --ps options: what
    `--strategy auto` is checked as before it plans (every plan it may pick is checked again)."""
    from gradmesh.parallel import registry
    from gradmesh.plan.candidates import Candidate

    return Candidate(registry.ROWS[0].name).configured(cfg)


def choose(cfg: configuration.Config, nproc: int, device: str) -> tuple[configuration.Config, dict]:
    """`cfg` with the best plan's settings, and the prediction for it."""
    from gradmesh.plan.planner import plan

    machine = _machine(cfg, nproc, device)
    _say(f"--strategy auto: planning {cfg.model.name} on {machine.world} worker(s) (calibration cached after once)")
    ranked = [p for p in plan(cfg, machine, cfg.train.max_steps * cfg.train.global_batch_size).ranked if p.fits]
    if not ranked:
        raise UsageError("--strategy auto: no plan fits in memory; see `gradmesh plan` with the same options")
    best = ranked[0]
    runner = f"; runner-up {ranked[1].candidate.label} ({ranked[1].step_s * 1000:.1f} ms)" if len(ranked) > 1 else ""
    _say(f"--strategy auto chose {best.candidate.label} (predicted {best.step_s * 1000:.1f} ms per step){runner}")
    return best.candidate.configured(cfg), _record(best)


def _record(prediction) -> dict:
    return {
        "plan": prediction.candidate.label,
        "step_s": prediction.step_s,
        "parts": prediction.parts,
        "peak_bytes": prediction.peak_bytes,
    }


def predict_own(cfg: configuration.Config, nproc: int, device: str) -> dict | None:
    """The prediction of the configured plan from a cached calibration (None without one: a
    launch never calibrates unasked); a note when a plan predicted `BETTER_BY` faster exists."""
    from gradmesh.plan import has_calibration

    if not has_calibration(cfg.model.name):  # the usual case: nothing to predict from, and no time spent
        return None
    from gradmesh.plan.candidates import Candidate
    from gradmesh.plan.planner import cached_plan

    planned = cached_plan(cfg, _machine(cfg, nproc, device))
    if planned is None:
        return None
    mine = Candidate.of(cfg)
    own = next((p for p in planned.ranked if p.candidate == mine), None)
    if own is None:
        return None
    best = next((p for p in planned.ranked if p.fits), own)
    if own.step_s >= BETTER_BY * best.step_s:
        _say(
            f"note: {best.candidate.label} is predicted {own.step_s / best.step_s:.1f}x faster than this plan "
            f"({best.step_s * 1000:.1f} against {own.step_s * 1000:.1f} ms per step; `gradmesh plan` shows why)"
        )
    return _record(own)


def write_prediction(run_dir: Path, prediction: dict | None) -> None:
    """RUN_DIR/prediction.json, restated by every launch: an earlier launch's is removed when this
    one has none (the run directory is gradmesh's by now, and so is the file's name in it)."""
    path = run_dir / PREDICTION
    if prediction is not None:
        atomic_write(path, json.dumps(prediction, indent=1))
    elif path.is_file() and not path.is_symlink():
        path.unlink()


__all__ = ["AUTO", "PREDICTION", "choose", "predict_own", "write_prediction"]
