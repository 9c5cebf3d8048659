"""Tensor parallelism (Megatron-style) through DTensor's `parallelize_module`.

The plan is data: for each model class, which submodules are split by output columns and
which by input rows. Attention's q/k/v projections and the MLP's first layer are column-split
(each rank computes a share of the heads / hidden units), the projections back to the residual
stream are row-split (partial sums, all-reduced). Embeddings, layer norms and the head stay
replicated; their gradients agree across tensor-parallel ranks because their inputs do.
"""

from typing import cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gradmesh.errors import UsageError
from gradmesh.mesh import TP_AXIS
from gradmesh.parallel.tp_plans import TP_PLANS, check_tp_degree, tp_parameter_count
from gradmesh.topology import Topology

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tp(model: nn.Module, topology: Topology, options=None) -> nn.Module:
    name = type(model).__name__
    if name not in TP_PLANS:
        raise UsageError(f"no tensor-parallel plan for {name}; known: {', '.join(TP_PLANS)}")
    blocks_attr, block_plan = TP_PLANS[name]
    model.to(topology.device)
    assert topology.mesh is not None  # a session's topology has its mesh once started
    mesh = topology.mesh[TP_AXIS]
    for block in cast(nn.ModuleList, model.get_submodule(blocks_attr)):
        parallelize_module(block, mesh, {path: STYLES[style]() for path, style in block_plan.items()})
    return model


def clip_grad_norm(parameters, max_norm: float, held_apart=()) -> torch.Tensor:
    """Global gradient-norm clipping over a mix of DTensor and plain gradients.

    torch's clip_grad_norm_ stacks per-parameter norms and cannot mix the two kinds; here a
    DTensor's norm is reduced over its mesh (whatever its placements) and plain tensors count
    once, as replicated values do. `held_apart`: gradients kept outside `.grad` (the sharded
    tables' rows, `gradmesh.parallel.tables.ShardedTables`), counted and scaled alike.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    plain = [grad for grad in grads if not isinstance(grad, DTensor)]
    sharded = [grad for grad in grads if isinstance(grad, DTensor)]
    squares = [torch.stack(torch._foreach_norm(plain)).pow(2).sum()] if plain else []
    for grad in sharded:
        squares.append(torch.linalg.vector_norm(grad).full_tensor() ** 2)
    squares += [holder.grad_norm_sq().to(torch.float32) for holder in held_apart]
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if plain:
        torch._foreach_mul_(plain, coef)
    for grad in sharded:
        grad.mul_(coef.item())
    for holder in held_apart:
        holder.scale_grads(coef.item())
    return total


def _needs_own_clip(model: nn.Module) -> bool:
    """DTensor and plain parameters mixed, or DTensors on several meshes: torch's clip cannot."""
    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    meshes = {id(p.device_mesh) for p in model.parameters() if isinstance(p, DTensor)}
    return len(kinds) > 1 or len(meshes) > 1


def clip_gradients(model: nn.Module, max_norm: float) -> None:
    """Global gradient-norm clipping of a model whatever its strategy left it holding."""
    from gradmesh.parallel.tables import holders

    held_apart = holders(model)
    if held_apart or _needs_own_clip(model):
        clip_grad_norm(list(model.parameters()), max_norm, held_apart)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


__all__ = ["TP_PLANS", "apply_tp", "check_tp_degree", "clip_grad_norm", "clip_gradients", "tp_parameter_count"]
