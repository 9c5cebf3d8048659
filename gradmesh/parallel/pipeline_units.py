"""A pipeline's units (a table per model: GPT's embedding, each block, the head) and the shallow
views that hold only some of them, so parameter names stay those of the plain model.

A model can be cut into stages when its class name has a row in `PIPELINE_UNITS` (the explicit
registration: a `UnitLister` naming its units in forward order) and it has the shape that row
reads: `BlockStack` for GPT (embeddings, blocks `h`, head), `LayerStack` for the MLP (its
`layers`), any nn.Sequential itself. Models meet these by shape; they import nothing of gradmesh.
"""

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch.nn as nn

from gradmesh.errors import UsageError

UnitLister = Callable[[nn.Module], list[list[str]]]
"""A model -> the units a stage is made of, in forward order (each a list of submodule names)."""


class BlockStack(Protocol):
    """GPT's shape: embeddings `wte`, `wpe`, `drop`, the blocks `h`, then `ln_f` and `lm_head`."""

    h: nn.ModuleList


class LayerStack(Protocol):
    """A model whose forward runs its `layers` in order."""

    layers: nn.Sequential


def _gpt_units(model: nn.Module) -> list[list[str]]:
    blocks = cast(BlockStack, model).h
    return [["wte", "wpe", "drop"], *[[f"h.{key}"] for key in blocks._modules], ["ln_f", "lm_head"]]


def _layer_units(model: nn.Module) -> list[list[str]]:
    return [[f"layers.{key}"] for key in cast(LayerStack, model).layers._modules]


def _sequential_units(model: nn.Module) -> list[list[str]]:
    return [[key] for key in model._modules]


PIPELINE_UNITS: dict[str, UnitLister] = {"GPT": _gpt_units, "MLP": _layer_units, "Sequential": _sequential_units}
"""Model class name -> its units: the models a pipeline can cut."""

if TYPE_CHECKING:
    from gradmesh.models.gpt import GPT
    from gradmesh.models.mlp import MLP

    def _shapes(gpt: GPT, mlp: MLP) -> tuple[BlockStack, LayerStack]:
        return gpt, mlp


def pipeline_units(model: nn.Module) -> list[list[str]]:
    name = type(model).__name__
    if name not in PIPELINE_UNITS:
        raise UsageError(
            f"no pipeline unit table for {name}; known: {', '.join(PIPELINE_UNITS)} "
            "(any nn.Sequential is cut between its children)"
        )
    return PIPELINE_UNITS[name](model)


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def keep_only(module: nn.Module, keep: set[str], prefix: str = "") -> nn.Module:
    """A shallow copy of `module` holding only the named submodules (the same module objects).

    Children of containers (Sequential, ModuleList, ModuleDict) that are not kept disappear, so
    iteration skips them while the kept ones keep their names ("h.3"); other children not kept
    become None, which the model's forward skips.
    """
    view = copy.copy(module)
    children: dict[str, nn.Module | None] = {}
    for name, child in module._modules.items():
        full = prefix + name
        if full in keep:
            children[name] = child
        elif isinstance(child, CONTAINERS) or any(k.startswith(full + ".") for k in keep):
            children[name] = keep_only(
                cast(nn.Module, child), keep, full + "."
            )  # an empty container iterates as nothing
        elif not isinstance(module, CONTAINERS):
            children[name] = None
    view.__dict__["_modules"] = children
    return view
