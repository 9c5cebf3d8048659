"""Checkpoints through torch.distributed.checkpoint (DCP), published atomically.

Layout: `RUN_DIR/checkpoints/step-N/` holds DCP's shard files and `.metadata`, plus
`trainer_state.json` (step, sampler position, the config that shapes the model and data).
Each rank writes its own shard into `.tmp-step-N/`; only when every rank has finished does
rank 0 add trainer_state.json and rename the folder to `step-N`. A rename is atomic on one
file system, so a crash mid-write leaves a `.tmp-*` folder that is ignored and cleaned up later,
never a latest checkpoint that fails to load. State dicts come from DCP's
`get_state_dict`, which speaks in fully qualified parameter names whatever the strategy, so a
checkpoint is not tied to the world size that wrote it.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STATE_FILE = "trainer_state.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Finished checkpoints, newest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        p for p in root.glob("step-*")
        if p.name[5:].isdigit() and (p / STATE_FILE).is_file() and (p / ".metadata").is_file()
    ]
    return sorted(found, key=_step_of, reverse=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[0] if found else None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: str | Path, step: int, model, optimizer, state: dict, keep: int = 0) -> Path:
    """Collective: every rank calls it. Returns the published folder."""
    root = checkpoint_root(run_dir)
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    is_main = dist.get_rank() == 0
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if is_main:
        with open(tmp / STATE_FILE, "w") as handle:
            json.dump(state, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    dist.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep > 0:
        for old in complete_checkpoints(root.parent)[keep:]:
            shutil.rmtree(old, ignore_errors=True)


def load(path: Path, model, optimizer) -> dict:
    """Collective: load model and optimizer state in place; returns trainer_state.json."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return read_state(path)


def full_model_state(model) -> dict[str, torch.Tensor]:
    """Collective: the whole unsharded model state on CPU, named as in the plain model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
