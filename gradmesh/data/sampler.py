"""The global-order sampler (contract 1).

The sequence of global batches depends only on (dataset length, seed, epoch, global batch
size). Each rank takes a contiguous share of every global batch and cuts it into micro-batches,
so the union over ranks of one step is exactly the global batch a single process would use —
whatever the world size, strategy or number of restarts. Every sample of an epoch is used
exactly once: the last global batch of an epoch is simply shorter, and the trainer weights each
sample by 1 / (samples in that global batch), so the gradient is still the global mean.

torch's DistributedSampler is not used because its order depends on the world size (it pads and
strides by rank); that breaks parity and resharding.
"""

from dataclasses import dataclass, field

import torch


def split_evenly(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous parts whose sizes differ by at most one (earlier parts larger)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


def split_by(items: list[int], proportions: tuple[float, ...]) -> list[list[int]]:
    """Contiguous parts sized in `proportions` (largest remainders get the rounding), in order."""
    total = sum(proportions)
    exact = [len(items) * p / total for p in proportions]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (sizes[i] - exact[i], i))
    for i in by_remainder[: len(items) - sum(sizes)]:
        sizes[i] += 1
    out, start = [], 0
    for size in sizes:
        out.append(items[start : start + size])
        start += size
    return out


@dataclass
class GlobalBatch:
    """One optimizer step's data as seen by one rank."""

    step: int
    epoch: int
    indices: list[int]
    """All sample indices of the global batch, in global order."""
    micro_batches: list[list[int]] = field(default_factory=list)
    """This rank's share, cut into grad_accum micro-batches (some may be empty at an epoch's end);
    empty in a batch drawn with `next_global`, whose share each engine takes with `share`."""
    proportions: tuple[float, ...] | None = None
    """Each data-parallel rank's part of the batch (--balance); None: equal shares."""

    @property
    def size(self) -> int:
        return len(self.indices)

    def share(self, rank: int, ranks: int, micro_batches: int) -> list[list[int]]:
        """Rank `rank` of `ranks`: its contiguous share, cut into micro-batches."""
        if self.proportions is not None and len(self.proportions) == ranks:
            return split_evenly(split_by(self.indices, self.proportions)[rank], micro_batches)
        return split_evenly(split_evenly(self.indices, ranks)[rank], micro_batches)


class GlobalOrderSampler:
    """Deterministic, resumable stream of global batches; position saved in checkpoints."""

    def __init__(self, dataset_len: int, global_batch_size: int, seed: int = 0):
        if dataset_len < 1:
            raise ValueError("dataset is empty")
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = 0
        self.batch_in_epoch = 0
        self.step = 0
        self._order: list[int] | None = None
        self.proportions: tuple[float, ...] | None = None
        """The shares the next batches are split in (set by --balance); None: equal."""

    @property
    def batches_per_epoch(self) -> int:
        return -(-self.dataset_len // self.global_batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        # Reduced below 2^63 (what a generator takes); the identity for every seed below ~9e12.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def next_batch(self, rank: int, world_size: int, grad_accum: int) -> GlobalBatch:
        """The next global batch with rank `rank`'s share of it cut into micro-batches."""
        batch = self.next_global()
        batch.micro_batches = batch.share(rank, world_size, grad_accum)
        return batch

    def next_global(self) -> GlobalBatch:
        """The next global batch: the same on every rank, whatever the world size."""
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        start = self.batch_in_epoch * self.global_batch_size
        batch = GlobalBatch(
            step=self.step,
            epoch=self.epoch,
            indices=self._order[start : start + self.global_batch_size],
            proportions=self.proportions,
        )
        self.step += 1
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = None
        return batch

    def state_dict(self) -> dict:
        return {
            "dataset_len": self.dataset_len,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "step": self.step,
            "proportions": list(self.proportions) if self.proportions else None,
        }

    def state_before(self, batch: GlobalBatch) -> dict:
        """The state as it was just before `batch`, the newest batch drawn, was drawn."""
        back = self.batch_in_epoch - 1 if self.batch_in_epoch else self.batches_per_epoch - 1
        return dict(self.state_dict(), step=batch.step, epoch=batch.epoch, batch_in_epoch=back)

    def load_state_dict(self, state: dict) -> None:
        for key in ("dataset_len", "global_batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]} but this run has {getattr(self, key)}")
        self.epoch = state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.step = state["step"]
        self._order = None
        saved = state.get("proportions")  # checkpoints from before --balance have none
        self.proportions = tuple(saved) if saved else None
