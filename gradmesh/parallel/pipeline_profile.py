"""Measuring a pipeline's units before the cut: each unit's forward and backward seconds on one real
micro-batch, and its parameter, gradient, optimizer-slot and activation bytes (`profile_units`)."""

import statistics
import time

import torch
import torch.nn as nn

from gradmesh.optim import trained_bytes
from gradmesh.parallel.pipeline_units import keep_only
from gradmesh.plan.partition import UnitCost


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for backward (activations; parameters excluded)."""

    def __init__(self, params: set[int]):
        self.bytes = 0

        def pack(tensor):
            if tensor.data_ptr() not in params:
                self.bytes += tensor.numel() * tensor.element_size()
            return tensor

        super().__init__(pack, lambda tensor: tensor)


def _timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def profile_units(
    model: nn.Module,
    units: list[list[str]],
    example: tuple,
    criterion,
    optimizer_slots: int,
    in_flight: int,
    repeats: int = 3,
) -> list[UnitCost]:
    """Forward+backward seconds (median of `repeats` after a warm-up) and bytes of each unit."""
    views = [keep_only(model, set(names)) for names in units]
    params = {p.data_ptr() for p in model.parameters()}
    inputs, targets = example
    seconds: list[list[float]] = [[] for _ in units]
    saved = [0] * len(units)
    for round_ in range(repeats + 1):
        x, record = inputs, []
        for k, view in enumerate(views):
            x_in = x.detach().requires_grad_(x.is_floating_point())
            counter = _SavedBytes(params)
            with counter:
                elapsed = _timed(lambda: record.append(view(x_in)))  # noqa: B023 (called at once)
            saved[k], x = counter.bytes, record[-1]
            record[-1] = (x_in, x, elapsed)
        grad = None
        for k in reversed(range(len(views))):
            x_in, out, forward_s = record[k]
            if grad is None:
                backward_s = _timed(lambda: criterion(out, targets).sum().backward())  # noqa: B023 (called at once)
            else:
                backward_s = _timed(lambda: out.backward(grad))  # noqa: B023 (called at once)
            grad = x_in.grad
            if round_:
                seconds[k].append(forward_s + backward_s)
        model.zero_grad(set_to_none=True)
    return [
        _unit_cost(names[0], view, times, activations, optimizer_slots, in_flight)
        for names, view, times, activations in zip(units, views, seconds, saved)
    ]


def _unit_cost(
    name: str, view: nn.Module, times: list[float], activations: int, slots: int, in_flight: int
) -> UnitCost:
    """A unit's median seconds and bytes: weights, gradients and optimizer slots, plus the activations
    of the micro-batches in flight."""
    weights = sum(p.numel() * p.element_size() for p in view.parameters())
    return UnitCost(name, statistics.median(times), trained_bytes(weights, slots) + activations * in_flight)
