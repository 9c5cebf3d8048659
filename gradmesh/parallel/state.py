"""Optimizers and their state in parameter names, for strategies whose optimizer is torch's own.

Checkpoints hold optimizer state keyed by fully qualified parameter name whatever the strategy:
DDP and FSDP give every parameter (FSDP as DTensor shards) through DCP's state-dict helpers,
ZeRO-1 the parameters a rank owns (`sharded.zero1_state`). DCP matches keys and reshards, so
any strategy loads what any other wrote.
"""

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict


def plain_optimizer(params, topology, optimizer_class, **kwargs) -> torch.optim.Optimizer:
    return optimizer_class(params, **kwargs)


def named_optimizer_state(model: nn.Module, optimizer, for_load: bool = False) -> dict:
    """{"state": {parameter name: {name: tensor}}}."""
    return {"state": get_optimizer_state_dict(model, optimizer)["state"]}


def install_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    """Install state that DCP loaded into the tensors `named_optimizer_state(for_load=True)` gave."""
    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    set_optimizer_state_dict(model, optimizer, {"state": state["state"], "param_groups": groups})


def model_state_bytes(model: nn.Module, optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held by this rank (local shards only)."""
    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        # a DTensor's local part, read without the autograd function `to_local` runs (every step)
        local = getattr(tensor, "_local_tensor", tensor)
        key = (local.data_ptr(), local.numel())
        if local.numel() and key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()

    for param in model.parameters():
        add(param)
        add(param.grad)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer holds the local one
    for per_param in inner.state.values():
        for value in per_param.values():
            add(value)
    return total
