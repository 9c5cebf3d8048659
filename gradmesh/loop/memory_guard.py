"""The memory guard of `--balance`: no rank gets a larger share than its memory holds.

What grows with a rank's share is the activations autograd keeps for the backward pass. The
guard measures them where they are made: during the first micro-batch's forward pass of each
balancing window, a `saved_tensors_hooks` pair adds up the bytes of every tensor saved for
backward, each storage once and parameters left out (they do not grow with samples: the
model's own storages and any leaf that requires grad or view of one, which catches fsdp's gathered
parameters), and divides by the micro-batch's samples. That works alike on CPU, where no allocator reports a
per-step peak, and on GPU. Only one micro-batch's activations are alive at a time, so a rank
holds `grad_accum` times what fits at once. The memory free for them is the GPU's free memory or
the machine's available memory split among its ranks (`--inject memory:rank=R,free_mb=M` tells a
rank it has less), of which `HEADROOM` is used.
"""

from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn

HEADROOM = 0.9


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage (a DTensor's local shard); None without one."""
    local = getattr(tensor, "_local_tensor", tensor)
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _parameter_like(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (linear layers save their weight transposed)."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


class ActivationMeter:
    """Bytes saved for backward per sample, measured in one forward pass when `due`."""

    def __init__(self, model: Callable[[], nn.Module]):
        """model: the engine's current module (in-place recovery and bucket tuning re-wrap it)."""
        self.model = model
        self.per_sample: float | None = None
        self.due = True

    def around_forward(self, samples: int):
        """The context for a micro-batch's forward pass of `samples` (0: not the first one)."""
        return self._measure(samples) if self.due and samples else nullcontext()

    @contextmanager
    def _measure(self, samples: int):
        own = {place[0] for place in map(_storage, self.model().parameters()) if place}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            place = _storage(tensor)
            if place:
                saved[place[0]] = place[1]
                if _parameter_like(tensor):  # fsdp's gathered parameters are not among model.parameters()
                    own.add(place[0])
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.per_sample, self.due = sum(b for place, b in saved.items() if place not in own) / samples, False


def sample_caps(per_sample: list[float], free: list[float], grad_accum: int) -> list[int | None]:
    """Samples each rank's memory holds (None: not measured or not known)."""
    return [int(HEADROOM * f // p) * grad_accum if p > 0 and f > 0 else None for p, f in zip(per_sample, free)]


def capped(shares: tuple[float, ...], caps: list[int | None], batch: int) -> tuple[tuple[float, ...], set[int]]:
    """`shares` with no rank above its cap (as a fraction of `batch`), the excess handed to the
    uncapped ranks in proportion to their shares; and the ranks whose cap binds. When the caps
    together hold less than the batch, the shares follow the caps (every rank equally over)."""
    limits = [1.0 if c is None else c / batch for c in caps]
    if sum(limits) < 1:
        return tuple(x / sum(limits) for x in limits), {r for r, c in enumerate(caps) if c is not None}
    moved, bound = list(shares), set()
    while over := [r for r, s in enumerate(moved) if r not in bound and s > limits[r] + 1e-12]:
        bound.update(over)
        for r in over:
            moved[r] = limits[r]
        free = [r for r in range(len(moved)) if r not in bound]
        rest, weight = 1 - sum(moved[r] for r in bound), sum(moved[r] for r in free)
        for r in free:
            moved[r] = rest * moved[r] / weight if weight > 0 else rest / len(free)
    return tuple(moved), bound
