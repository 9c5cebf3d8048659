"""DDP's gradient all-reduce, run through gradmesh's reducer.

DDP's built-in all-reduce cannot be interrupted, timed or counted from Python. A comm hook
hands each gradient bucket to the job's reducer (`gradmesh.comm.reducer`), which does the same
arithmetic as torch's default hook and adds the wrappers around it. DDP still buckets the
gradients and overlaps the all-reduces with the backward pass.

The hook also carries the step's non-finite verdict (`gradmesh.engine.nonfinite`): the engine
hands it `loss × 0` — 0 when this rank's loss is finite, NaN when not — and bucket 0's first
element gets it added before the all-reduce, so a non-finite loss on any rank makes every
rank's reduced gradients non-finite. With a reducer that `carries_nonfinite`, every rank then
reaches the same verdict from its own gradients, with no collective of its own.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradmesh.comm.reducer import Reducer


class Rider(Protocol):
    """A few values that travel summed with the step's last gradient bucket, where they would
    otherwise need an all-reduce of their own (the sharded tables' squared gradient norm)."""

    def ask(self) -> torch.Tensor | None:
        """This rank's values, or None (every rank alike) when they are not ready."""
        ...

    def take(self, summed: torch.Tensor) -> None:
        """Their sum over the ranks."""
        ...


@dataclass
class HookState:
    reducer: Reducer
    group: dist.ProcessGroup
    names: dict[int, str]
    """id(parameter) -> its name in the plain model: a bucket's parts, for per-parameter state."""
    poison: torch.Tensor | None = None
    """This step's loss × 0 (see above); None: nothing to carry."""
    rider: Rider | None = None
    """Values summed with the last bucket (a plain reducer only: a compressed one would not keep them)."""


def _reduce_bucket(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    parts = [(state.names[id(p)], p.shape) for p in bucket.parameters()]
    buffer = bucket.buffer()
    if bucket.index() == 0 and state.poison is not None and buffer.numel():
        buffer[:1].add_(state.poison.to(buffer.dtype))  # x + 0 == x; NaN where the loss was not finite
    extra = state.rider.ask() if state.rider is not None and bucket.is_last() else None
    if extra is None:
        return state.reducer.reduce(buffer, state.group, parts)
    return _with_rider(state, buffer, parts, extra)


def _with_rider(state: HookState, buffer: torch.Tensor, parts: list, extra: torch.Tensor):
    size, ranks = buffer.numel(), state.group.size()
    rider = state.rider
    assert rider is not None  # asked above
    combined = torch.cat([buffer, extra.to(buffer.dtype)])
    future = state.reducer.reduce(combined, state.group, [*parts, ("rider", tuple(extra.shape))])

    def split(done) -> torch.Tensor:
        value = done.value()
        rider.take(value[size:] * ranks)  # the reducer averages; the rider's values are sums
        return value[:size]

    return future.then(split)


def register(model: DistributedDataParallel, reducer: Reducer) -> DistributedDataParallel:
    names = {id(p): name for name, p in model.module.named_parameters()}
    state = HookState(reducer, model.process_group, names)
    model.register_comm_hook(state, _reduce_bucket)
    setattr(model, "gradmesh_hook", state)  # noqa: B010 (nn.Module types attributes as tensors or modules)
    return model


def state_of(model) -> HookState | None:
    """The hook's state where `register` wrapped `model`, else None."""
    return model.__dict__.get("gradmesh_hook")


def take_verdict(model) -> bool:
    """Whether this step handed the hook its verdict; taken once, so a step that never set it
    runs the non-finite collective instead of trusting the last one's."""
    state = state_of(model)
    if state is None or state.poison is None:
        return False
    state.poison = None
    return True
