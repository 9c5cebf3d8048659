"""Strategies: functions applied to a plain model, composed in one place (`apply_strategy`)."""

import torch.nn as nn

from gradmesh.config import STRATEGIES
from gradmesh.errors import UsageError
from gradmesh.parallel.data import apply_ddp, ddp_sync
from gradmesh.topology import Topology


def apply_strategy(model: nn.Module, topology: Topology, strategy: str) -> nn.Module:
    """Wrap a plain model for `strategy`.

    Composition order, once more strategies exist: tensor parallel first (it rewrites modules),
    then the pipeline split (it cuts the rewritten model), then data parallel / sharding over
    whatever each rank holds.
    """
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    return apply_ddp(model, topology)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's plain module inside a strategy wrapper."""
    return getattr(model, "module", model)


def grad_sync(model: nn.Module, last_micro_batch: bool):
    """Context for one micro-batch's backward: communicate gradients only on the last one."""
    return ddp_sync(model, last_micro_batch)


__all__ = ["STRATEGIES", "apply_strategy", "unwrap", "grad_sync"]
