"""Strategies: functions applied to a plain model, chosen from one table (`STRATEGIES`).

Composition order, once strategies combine on a mesh: tensor parallel first (it rewrites
modules), then the pipeline split (it cuts the rewritten model), then data parallel or
sharding over whatever each rank holds.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from gradmesh.errors import UsageError
from gradmesh.parallel.data import apply_ddp, ddp_sync
from gradmesh.parallel.pipeline import PipelineOptions, apply_pipeline
from gradmesh.parallel.sharded import apply_fsdp, fsdp_sync, zero1_optimizer, zero1_state
from gradmesh.parallel.tensor import apply_tp, check_tp_degree, clip_grad_norm, has_mixed_gradients
from gradmesh.topology import Topology


def _plain_optimizer(params, topology, optimizer_class, **kwargs):
    return optimizer_class(params, **kwargs)


@dataclass(frozen=True)
class Strategy:
    name: str
    wrap: Callable[[nn.Module, Topology], nn.Module]
    """Applies the strategy to a plain model."""
    optimizer: Callable = _plain_optimizer
    """(params, topology, optimizer_class, **kwargs) -> optimizer."""
    sync: Callable = ddp_sync
    """(model, last_micro_batch) -> context for one micro-batch's backward."""
    sharded_optimizer: bool = False
    """Optimizer state split across data-parallel ranks by gradmesh (not by DTensor)."""
    axis: str = "dp"
    """The mesh axis the strategy spreads over when it runs alone."""


STRATEGIES = {
    "ddp": Strategy("ddp", apply_ddp),
    "zero1": Strategy("zero1", apply_ddp, optimizer=zero1_optimizer, sharded_optimizer=True),
    "fsdp": Strategy("fsdp", apply_fsdp, sync=fsdp_sync),
    "tp": Strategy("tp", apply_tp, axis="tp"),
    # Needs the criterion and micro-batch options only the Trainer has: see resolve_strategy.
    "pipeline": Strategy("pipeline", lambda model, topo: apply_pipeline(model, topo, None), axis="pp"),
}


def mesh_for(strategy: str, world_size: int, mesh: str = "") -> dict[str, int]:
    """The named mesh: `--mesh` when given, else the strategy's own axis over every rank."""
    if mesh:
        from gradmesh.parallel.compose import parse_mesh

        return parse_mesh(mesh)
    return {get_strategy(strategy).axis: world_size}


def _several_meshes(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    meshes = {id(p.device_mesh) for p in model.parameters() if isinstance(p, DTensor)}
    return len(meshes) > 1


def check_strategy(strategy: str, model_name: str, n_head: int, n_embd: int, world_size: int) -> None:
    """Strategy-specific checks that can run before any worker starts."""
    if strategy == "tp":
        check_tp_degree(model_name, n_head, n_embd, world_size)


def clip_gradients(model: nn.Module, max_norm: float) -> None:
    if hasattr(model, "pipeline"):
        model.pipeline.clip(max_norm)
    elif has_mixed_gradients(model) or _several_meshes(model):
        clip_grad_norm(list(model.parameters()), max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def resolve_strategy(name: str, topology: Topology, pipeline: PipelineOptions | None = None) -> Strategy:
    """The strategy named, or the composition its mesh describes (several axes, or a pipeline)."""
    strategy = get_strategy(name)
    if set(topology.mesh_shape) == {strategy.axis} and strategy.axis != "pp":
        return strategy
    from gradmesh.parallel.compose import composed

    wrap, sync = composed(topology, pipeline)
    label = ",".join(f"{axis}={size}" for axis, size in topology.mesh_shape.items())
    if topology.mesh_shape.keys() == {"pp"}:
        label = "pipeline"
    return Strategy(label, wrap, sync=sync, axis="")


def get_strategy(name: "str | Strategy") -> Strategy:
    if isinstance(name, Strategy):
        return name
    if name not in STRATEGIES:
        raise UsageError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def apply_strategy(model: nn.Module, topology: Topology, strategy: "str | Strategy") -> nn.Module:
    return get_strategy(strategy).wrap(model, topology)


def build_optimizer(model: nn.Module, topology: Topology, strategy: str, optimizer_class, kwargs: dict):
    return get_strategy(strategy).optimizer(list(model.parameters()), topology, optimizer_class, **kwargs)


def grad_sync(model: nn.Module, strategy: str, last_micro_batch: bool):
    return get_strategy(strategy).sync(model, last_micro_batch)


def optimizer_state(model: nn.Module, optimizer, strategy: str, for_load: bool = False) -> dict:
    """Optimizer state keyed by parameter name: {"state": {fqn: {name: tensor}}}.

    DDP and FSDP give every parameter (FSDP as DTensor shards); ZeRO-1 gives the parameters this
    rank owns. DCP matches keys and reshards, so any strategy loads what any other wrote.
    """
    if get_strategy(strategy).sharded_optimizer:
        return zero1_state(model, optimizer, create=for_load)
    return {"state": get_optimizer_state_dict(model, optimizer)["state"]}


def load_optimizer_state(model: nn.Module, optimizer, strategy: str, state: dict) -> None:
    """Install state that DCP loaded into the tensors `optimizer_state(for_load=True)` gave."""
    if get_strategy(strategy).sharded_optimizer:
        return  # loaded in place into the optimizer's own tensors
    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
    set_optimizer_state_dict(model, optimizer, {"state": state["state"], "param_groups": groups})


def model_state_bytes(model: nn.Module, optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held by this rank (local shards only)."""
    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
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


__all__ = ["STRATEGIES", "Strategy", "resolve_strategy", "mesh_for", "check_strategy", "clip_gradients", "apply_strategy", "build_optimizer", "grad_sync",
           "optimizer_state", "load_optimizer_state", "model_state_bytes"]
