"""Launch settings from a cluster scheduler's environment: `gradmesh train` in a Kubeflow Trainer
pod (or a v1 PyTorchJob's, or anywhere torchrun's PET_* variables are set) needs no launch flags.

The variables fill a config layer under the command line's flags (a flag given wins) and over a
resumed run's saved config.toml (a pod restarted on another node gets the new addresses)."""

from gradmesh import env
from gradmesh.errors import UsageError


def _whole(name: str, text: str, low: int) -> int:
    if not text.strip().isdigit() or int(text) < low:
        raise UsageError(f"PET_{name}={text!r} in the environment: expected a whole number >= {low}")
    return int(text)


def scheduler_layer() -> dict[str, dict[str, int | str]]:
    """The `launch` section the PET_* variables describe ({} where none is set)."""
    found, launch = env.scheduler_launch(), dict[str, int | str]()
    if "NNODES" in found:
        if ":" in found["NNODES"]:
            raise UsageError(
                f"PET_NNODES={found['NNODES']!r} in the environment: gradmesh trains on a fixed number of "
                "nodes; give one number (elastic node ranges are not taken)"
            )
        launch["nnodes"] = _whole("NNODES", found["NNODES"], 1)
    per_node = found.get("NPROC_PER_NODE", "auto").strip()
    if per_node not in ("auto", "cpu", "gpu"):  # torchrun's words for 'as many as this node has'
        launch["nproc"] = _whole("NPROC_PER_NODE", per_node, 1)
    if "NODE_RANK" in found:
        launch["node_rank"] = _whole("NODE_RANK", found["NODE_RANK"], 0)
    if "RDZV_ENDPOINT" in found:
        launch["rdzv_endpoint"] = found["RDZV_ENDPOINT"].strip()
    elif "MASTER_ADDR" in found:
        port = _whole("MASTER_PORT", found.get("MASTER_PORT", "29500"), 1)
        launch["rdzv_endpoint"] = f"{found['MASTER_ADDR'].strip()}:{port}"
    if "RDZV_ID" in found:
        launch["rdzv_id"] = found["RDZV_ID"].strip()
    return {"launch": launch} if launch else {}
