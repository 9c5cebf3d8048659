"""What an engine is built from and what a step hands back (`Job`, `StepProbe`, `StepOutcome`),
and the small functions of a step every family shares (the lr schedule, peak memory, device moves)."""

import math
import resource
from collections.abc import Callable, Sized
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gradmesh.comm import CommCounter, Reducer
from gradmesh.config import PSConfig, TrainConfig
from gradmesh.data import GlobalBatch
from gradmesh.engine.nonfinite import Finding
from gradmesh.monitor.breakdown import NullClock, StepClock

Forward = Callable[[int], AbstractContextManager[object]]
"""The context a micro-batch's forward pass of N samples runs in (`StepProbe.around_forward`)."""


def _nothing(*args) -> None:
    return None


def _unmeasured(samples: int) -> AbstractContextManager[object]:
    return nullcontext()


def _unchanged(losses, step=None):
    return losses


@dataclass
class StepProbe:
    """What a step reports to while it runs: the phase clock, the watchdog's heartbeat
    (phase 1 after forward, 2 after backward, 3 after the optimizer) and injected delays."""

    clock: StepClock | NullClock = field(default_factory=NullClock)
    beat: Callable[..., None] = _nothing
    in_forward: Callable[[], None] = _nothing
    """Called inside the first micro-batch's forward phase (an injected straggler sleeps here)."""
    straggle: Callable[[float], None] = _nothing
    """Called before a piece of work like one that took this many seconds (an injected straggler
    sleeps in proportion): engines whose ranks do not step together."""
    reached: Callable[[int], None] = _nothing
    """Called as work on a step starts (an injected kill or hang at that step fires here):
    engines whose ranks do not step together, inside a segment rather than before it."""
    around_forward: Forward = _unmeasured
    """The context a micro-batch's forward pass of N samples runs in (0 after the first
    micro-batch): --balance's memory guard measures the activations saved for backward there."""
    spoil: Callable = _unchanged
    """Applied to the first micro-batch's per-sample losses (--inject nan makes them NaN there)."""


@dataclass
class StepOutcome:
    """One step as this rank saw it, for the services."""

    batch: GlobalBatch
    lr: float
    indices: list[int]
    """The samples this rank consumed."""
    figures: torch.Tensor
    """loss sum, samples counted, model-state bytes, peak memory (float64): the reporter's BASE."""
    row: dict = field(default_factory=dict)
    """More columns for the step's metrics row (rank 0's are written), e.g. staleness."""
    detail: dict = field(default_factory=dict)
    """More about what this rank did, for its per-rank records (--record-samples)."""
    nonfinite: Finding | None = None
    """Set when the step's loss or gradients were not finite: its update was not applied."""

    @property
    def step(self) -> int:
        """The optimizer step this was, counted from 1."""
        return self.batch.step + 1


class GroupMembership(Protocol):
    """What an engine asks of in-place recovery's membership (`gradmesh.fault.inplace.Membership`,
    which engine/ may not import): who is in the group, who left, a wait that fails on a loss."""

    members: list[int]
    departed: set[int]

    def wait(self, work: torch.distributed.Work) -> None: ...
    def evict(self, identity: int) -> None: ...


@dataclass(kw_only=True)
class Job:
    """What every engine is built from besides the plan and the model."""

    loss_fn: Callable
    dataset: Sized
    """Indexable by sample (`gradmesh.data.fetch`) with a length."""
    train: TrainConfig
    optimizer_class: type[torch.optim.Optimizer]
    optimizer_kwargs: dict
    criterion: Callable | None = None
    reducer: Reducer | None = None
    """The job's gradient-averaging chain."""
    counter: CommCounter | None = None
    ps: PSConfig | None = None
    """Servers and mode under the parameter-server strategy."""
    membership: GroupMembership | None = None
    """Under in-place recovery, else None."""
    step_timeout: float = 0.0
    """--step-timeout: engines whose ranks do not step together apply it to each share of work."""
    on_nonfinite: str = "stop"
    """--on-nonfinite: under stop a parameter server applies nothing more once a push was not finite."""
    groups: list[tuple[list[str], dict]] | None = None
    """Parameter groups (parameter names in the plain model, the group's settings) of an optimizer
    a user built (`gradmesh.Loop.prepare`); None: one group of every parameter."""


def lr_factor(step: int, train: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr over decay_steps (a function of step only)."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.decay_steps - train.warmup_steps))
    floor = train.min_lr / train.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def scheduled_lr(base_lr: float, step: int, train: TrainConfig) -> float:
    """The learning rate of (0-based) `step` for a parameter group whose configured rate is `base_lr`."""
    return base_lr * lr_factor(step, train)


def clipped_step(optimizer: torch.optim.Optimizer, clip: Callable[[float], None], max_norm: float) -> None:
    """The optimizer's step on gradients first clipped to `max_norm` by `clip` (0: no clipping)."""
    if max_norm:
        clip(max_norm)
    optimizer.step()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def to_device(data, device: torch.device):
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, (tuple, list)):
        return type(data)(to_device(d, device) for d in data)
    if isinstance(data, dict):
        return {k: to_device(v, device) for k, v in data.items()}
    return data
