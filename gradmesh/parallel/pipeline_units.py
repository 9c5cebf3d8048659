"""A pipeline's units (a table per model: GPT's embedding, each block, the head) and the shallow
views that hold only some of them, so parameter names stay those of the plain model."""

import copy
from collections.abc import Callable

import torch.nn as nn

from gradmesh.errors import UsageError


def _gpt_units(model: nn.Module) -> list[list[str]]:
    return [["wte", "wpe", "drop"], *[[f"h.{key}"] for key in model.h._modules], ["ln_f", "lm_head"]]


def _sequential_units(attr: str) -> Callable[[nn.Module], list[list[str]]]:
    def units(model: nn.Module) -> list[list[str]]:
        container = getattr(model, attr) if attr else model
        prefix = f"{attr}." if attr else ""
        return [[f"{prefix}{key}"] for key in container._modules]

    return units


# model class -> the units a stage is made of, in forward order (each a list of submodule names).
PIPELINE_UNITS = {"GPT": _gpt_units, "MLP": _sequential_units("layers"), "Sequential": _sequential_units("")}


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
    children = {}
    for name, child in module._modules.items():
        full = prefix + name
        if full in keep:
            children[name] = child
        elif isinstance(child, CONTAINERS) or any(k.startswith(full + ".") for k in keep):
            children[name] = keep_only(child, keep, full + ".")  # an empty container iterates as nothing
        elif not isinstance(module, CONTAINERS):
            children[name] = None
    view.__dict__["_modules"] = children
    return view
