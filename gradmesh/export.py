"""`gradmesh export`: one unsharded safetensors file from any checkpoint, in one process.

DCP's metadata lists every model tensor's full shape, so the export builds empty tensors of
those shapes and lets DCP read the shards into them (`no_dist`: no process group needed) —
whatever strategy and world size wrote the checkpoint.
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gradmesh.errors import UsageError
from gradmesh.fault import checkpoint, safeload
from gradmesh.files import replacing


def pick_checkpoint(run_dir: Path, step: int | None, warn=print) -> Path:
    """The checkpoint of `step`; without one, the newest intact checkpoint (damaged newer ones noted)."""
    found = checkpoint.complete_checkpoints(run_dir)
    if not found:
        raise UsageError(f"no complete checkpoint in {str(checkpoint.checkpoint_root(run_dir))!r}")
    if step is None:
        latest = checkpoint.latest_good_checkpoint(run_dir, warn=warn)
        if latest is None:
            raise UsageError(f"every checkpoint in {str(checkpoint.checkpoint_root(run_dir))!r} is damaged")
        return latest
    for path in found:
        if path.name == f"step-{step}":
            return path
    steps = ", ".join(p.name.split("-")[1] for p in reversed(found))
    raise UsageError(f"no checkpoint for step {step} in {str(run_dir)!r}; available steps: {steps}")


def export(run_dir: str | Path, out: str | Path, step: int | None = None, warn=print) -> tuple[Path, int]:
    """Write the model weights of a checkpoint to `out`; returns (checkpoint used, tensor count)."""
    path = pick_checkpoint(Path(run_dir), step, warn)
    problem = checkpoint.verify(path)
    if problem:
        raise UsageError(f"checkpoint {path} is damaged ({problem}); choose another with --step")
    metadata = safeload.read_metadata(path).state_dict_metadata
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    safeload.load(state, path, no_dist=True)
    weights = {key.removeprefix("model."): tensor.contiguous() for key, tensor in state.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        save_file(weights, str(tmp), metadata={"gradmesh_checkpoint": str(path)})
    return path, len(weights)
