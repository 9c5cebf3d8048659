"""Sharded data parallelism: ZeRO-1 (ZeroRedundancyOptimizer) and FSDP2 (`fully_shard`).

Both come from torch; gradmesh supplies the sharding plan (which submodules become FSDP
units: a table per model, not branches in forward), the data axis of the mesh, and an
optimizer-state view in fully qualified parameter names for ZeRO-1 — DCP's state-dict helpers
do not know ZeroRedundancyOptimizer, and checkpoints must stay reshardable across strategies.
"""

import contextlib
from typing import cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from gradmesh.comm.compress import cast_dtype
from gradmesh.comm.scatter import CountedReduceScatter
from gradmesh.mesh import DP_AXIS, FSDP_AXIS
from gradmesh.parallel.options import DEFAULT_BUCKET_MB, ApplyOptions
from gradmesh.topology import Topology

# Sharding plan: class name -> the submodule (a dotted path) holding the blocks that become FSDP
# units (each one all-gathers its parameters just before use and frees them after). The root is
# always a unit. Hugging Face's models name their block lists as transformers builds them.
FSDP_UNITS = {"GPT": "h", "MLP": None, "GPT2LMHeadModel": "transformer.h", "LlamaForCausalLM": "model.layers"}
UNIT_BYTES = DEFAULT_BUCKET_MB * 2**20
"""Blocks that hold less than this together stay in the root unit: each unit costs an all-gather
in forward and in backward and a reduce-scatter, and below DDP's bucket size the calls cost more
than the memory a unit frees (docs/benchmarks.md#peers)."""


def data_axis(topology: Topology) -> str:
    return FSDP_AXIS if FSDP_AXIS in topology.mesh_shape else DP_AXIS


def _blocks(model: nn.Module) -> list[nn.Module]:
    name = type(model).__name__
    if name in FSDP_UNITS:
        attr = FSDP_UNITS[name]
        return list(cast(nn.ModuleList, model.get_submodule(attr))) if attr else []
    # A model gradmesh does not know: shard each block of its first ModuleList, as torchtitan
    # does for transformer layers.
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            return list(module)
    return []


def _units(model: nn.Module) -> list[nn.Module]:
    blocks = _blocks(model)
    held = sum(p.numel() * p.element_size() for block in blocks for p in block.parameters())
    return blocks if held >= UNIT_BYTES else []


def fsdp_units(model: nn.Module) -> tuple[int, int]:
    """(FSDP units, parameters in none of the blocks: the root unit's) of `model`'s plan, for the
    planner's count of gathers."""
    blocks = _units(model)
    in_blocks = sum(p.numel() for unit in blocks for p in unit.parameters())
    return len(blocks) + 1, sum(p.numel() for p in model.parameters()) - in_blocks


def apply_fsdp(model: nn.Module, topology: Topology, options: ApplyOptions) -> nn.Module:
    """--compression fp16|bf16: FSDP2 reduce-scatters the gradients at that width (its reduce
    dtype; parameters and the sharded gradients stay fp32). Each unit's reduce-scatter is counted."""
    model.to(topology.device)
    assert topology.mesh is not None  # a session's topology has its mesh once started
    mesh = topology.mesh[data_axis(topology)]
    policy = MixedPrecisionPolicy(reduce_dtype=cast_dtype(options.compression))
    units = [fully_shard(unit, mesh=mesh, mp_policy=policy) for unit in _units(model)]
    root = fully_shard(model, mesh=mesh, mp_policy=policy)
    if options.counter is not None:
        for unit in (*units, root):
            unit.set_custom_reduce_scatter(CountedReduceScatter(options.counter))
    return cast(nn.Module, root)  # fully_shard returns the module it was given, as an FSDPModule too


def fsdp_sync(model: nn.Module, topology: Topology, options: ApplyOptions, last_micro_batch: bool):
    """Reduce-scatter gradients only on a step's last micro-batch."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last_micro_batch)
    return contextlib.nullcontext()


def zero1_optimizer(params, topology: Topology, optimizer_class, **kwargs) -> ZeroRedundancyOptimizer:
    """Each rank's parameters live in one flat bucket (`parameters_as_bucket_view`), so the updated
    shards go out as one broadcast per rank, not one per parameter tensor: on a small model the
    per-tensor calls cost more than the bytes (docs/benchmarks.md#zero1)."""
    return ZeroRedundancyOptimizer(
        params,
        optimizer_class=optimizer_class,
        process_group=topology.group(data_axis(topology)),
        parameters_as_bucket_view=True,
        **kwargs,
    )


def zero1_state(model: nn.Module, zero: ZeroRedundancyOptimizer, for_load: bool = False) -> dict:
    """This rank's share of optimizer state as {"state": {fqn: {name: tensor}}}.

    The same shape DCP's get_optimizer_state_dict gives for DDP and FSDP (restricted to the
    parameters this rank owns), so one checkpoint format serves every strategy. With
    for_load=True, missing state is first made by a zero-gradient, zero-lr step, so DCP has
    tensors to load into.
    """
    if for_load and not zero.optim.state:
        _initialise_state(zero)
    names = {param: name.removeprefix("module.") for name, param in model.named_parameters()}
    return {"state": {names[p]: zero.optim.state[p] for p in zero.optim.state}}


def zero1_loaded(model: nn.Module, zero: ZeroRedundancyOptimizer, state: dict) -> None:
    """Nothing to install: DCP loaded in place into the optimizer's own tensors."""


def _initialise_state(zero: ZeroRedundancyOptimizer) -> None:
    params = [p for group in zero.param_groups for p in group["params"]]
    saved_lrs = [group["lr"] for group in zero.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in zero.param_groups:
        group["lr"] = 0.0
    zero.step()
    for group, lr in zip(zero.param_groups, saved_lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None
