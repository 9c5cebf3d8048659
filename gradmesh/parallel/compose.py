"""Strategies applied to a plain model in one place, in the registry's fixed order.

Tensor parallel first (it rewrites modules into DTensor shards), then the pipeline split (it
cuts the rewritten model into stage views), then data parallelism or sharding over whatever
each rank holds (`registry.COMPOSITION_ORDER`). A data-parallel row beside a model-parallel one
uses its `beside_model_parallel` functions: DDP wraps neither DTensors nor pipeline stages.
"""

import contextlib

import torch.nn as nn

from gradmesh.parallel.batchnorm import bind
from gradmesh.parallel.options import ApplyOptions
from gradmesh.parallel.registry import Plan, Strategy, load
from gradmesh.topology import Topology


def _functions(plan: Plan, row: Strategy) -> tuple[str, str | None]:
    if plan.splits_model and not row.splits_model and row.beside_model_parallel:
        return row.beside_model_parallel
    return row.apply, row.sync


def apply_plan(model: nn.Module, topology: Topology, plan: Plan, options: ApplyOptions) -> nn.Module:
    """The plain model with every row of the plan applied, in order."""
    # Synchronised batch norm first, on the plain model's own layers (every wrapper keeps them):
    # its statistics span the ranks that hold different samples.
    bind(model, topology)
    for row in plan.rows:
        model = load(_functions(plan, row)[0])(model, topology, options)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, topology: Topology, plan: Plan, options: ApplyOptions, last_micro_batch: bool):
    """Around one micro-batch's backward: each row's gradient synchronisation."""
    with contextlib.ExitStack() as stack:
        for row in plan.rows:
            stack.enter_context(load(_functions(plan, row)[1])(model, topology, options, last_micro_batch))
        yield
