"""Rows of row-sharded tables fetched from their owners and their gradients sent back: the
all-to-all exchange behind the `tables` strategy (`gradmesh.parallel.tables`).

Each rank asks for the rows its share of a batch looks up, every table at once: each lookup
becomes one key (the row's place among its owner's rows), and its distinct keys are grouped by
the rank that owns the row (`Placement`: even row ranges of every table over every rank,
torch.chunk's split, or each table whole on one rank). Where every rank's share is known
(training: the global order) each side of every exchange is computed locally (`Router.known`, no
collective); elsewhere the keys go to their owners first (`Router.route`: one all-to-all in the
steady state). The owners answer with the rows (all-to-all back). In backward the rows'
gradients, summed per distinct key, take the reverse way to their owners (all-to-all), which
keep them until the optimizer step sums them per row (`RowGradients`). Two collectives a
micro-batch in training whatever the number of tables; the bytes are those of the rows a share
touches, not of the tables. Both answers are sent without waiting (`answer`, an `InFlight`):
the rows while the layers before the tables run, their gradients while backward goes on below
them — on 2 CPU processes that took the 10^5-row recsys run from 80k to 87k samples/s.

torch has no sharded embedding; TorchRec has one, but it pins its own torch and FBGEMM build.
The exchange is plain `torch.distributed.all_to_all_single` (gloo and NCCL), kept here, apart
from the strategy, as every other collective of gradmesh is.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.comm.reducer import CommCounter


@dataclass
class Routed:
    """One forward's exchange: who asked whom for what."""

    inverse: torch.Tensor
    """For each of this rank's flattened [tables x samples] lookups, its place among the distinct
    keys it sent (by owner, then key): a row asked for twice crosses once."""
    sent: list[int]
    """Distinct keys sent to each owner."""
    received: list[int]
    """Distinct keys received from each rank."""
    keys: torch.Tensor
    """Every key this rank serves, in arrival order: its place among this rank's rows (`Placement`)."""


@dataclass
class Link:
    """Where an exchange runs: the group, this rank's place in it, and the step's count of bytes
    sent (`gradmesh.comm.reducer.CommCounter`; what crosses to other ranks), if one is kept."""

    group: Any
    me: int
    counter: CommCounter | None = None

    def count(self, splits: list[int], row_bytes: int) -> None:
        if self.counter is not None:
            self.counter.add((sum(splits) - splits[self.me]) * row_bytes)


class InFlight:
    """An all-to-all's result, perhaps still arriving: `wait` returns it once it is complete."""

    def __init__(self, out: torch.Tensor, work: Any = None):
        self.out, self.work = out, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


class RowGradients:
    """A rank's pending table gradients: (keys, rows' gradients) per backward, summed per distinct
    row when the step asks (`summed`), dropped by `clear`."""

    def __init__(self, dim: int):
        self.dim = dim
        self.parts: list[tuple[torch.Tensor, InFlight]] = []
        self.cached: tuple[torch.Tensor, torch.Tensor] | None = None
        self.expected = 0

    def add(self, keys: torch.Tensor, grads: InFlight) -> None:
        """`grads` may still be on their way (the step waits for them, backward does not)."""
        self.parts.append((keys, grads))
        self.cached = None

    def expect(self) -> None:
        """A forward that will have a backward fetched rows."""
        self.expected += 1

    def complete(self) -> bool:
        """Every expected backward has added its gradients."""
        return self.expected == len(self.parts)

    def clear(self) -> None:
        self.parts = []
        self.cached = None
        self.expected = 0

    def summed(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct keys, their gradients summed, times `scale`); the same tensors until `add` or
        `clear` (a clip scales them in place before the step reads them)."""
        if self.cached is None:
            if self.parts:
                keys, grads = torch.cat([k for k, _ in self.parts]), torch.cat([g.wait() for _, g in self.parts])
            else:
                keys, grads = torch.zeros(0, dtype=torch.long), torch.zeros(0, self.dim)
            distinct, inverse = torch.unique(keys, return_inverse=True)
            total = grads.new_zeros(len(distinct), grads.shape[1]).index_add_(0, inverse, grads).mul_(scale)
            self.cached = distinct, total
        return self.cached


@dataclass
class Placement:
    """Where every table's rows live: row i of table t on rank base[t] + i // chunk[t], at key
    start[t] + i mod chunk[t] of its owner's rows; every key below `size`. Row-wise sharding
    (even ranges over every rank): base 0, chunk ceil(rows / ranks), start t x span; table-wise
    (each table whole on one rank): base its owner, chunk its rows, start its place among its
    owner's tables. Tensors [tables, 1], alike on every rank."""

    base: torch.Tensor
    chunk: torch.Tensor
    start: torch.Tensor
    size: int


class Router:
    """Sends each lookup of `ids` [tables, samples] to the rank owning its row (`Placement`), as
    one key: the row's place among its owner's rows.

    One all-to-all where it can: each rank's keys to each owner go in a box of a fixed capacity,
    behind a header of two numbers — how many keys the box holds, and the most this rank sends
    any owner. Every rank gets every rank's header, so all of them know the largest need alike:
    if a box was too small they all send the keys again with the counts now known (a second
    all-to-all), and every rank sets the next capacity from the same number, a little above it."""

    def __init__(self, placement: Placement, world: int, link: Link):
        self.placement, self.world, self.link = placement, world, link
        self.group = link.group
        self.capacity = 0

    def _keys(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner, key) of every lookup of `ids` [tables, samples], flattened."""
        where = self.placement
        part = ids // where.chunk
        return (where.base + part).reshape(-1), (where.start + ids - part * where.chunk).reshape(-1)

    def _distinct(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(distinct keys to send, sorted by owner then key; how many to each owner; each lookup's
        place among them)."""
        owner, keys = self._keys(ids)
        space = self.placement.size
        found, inverse = torch.unique(owner * space + keys, return_inverse=True)
        return found % space, torch.bincount(found // space, minlength=self.world), inverse

    def known(self, everyone: list[torch.Tensor], me: int) -> Routed:
        """No collective: every rank's lookups are known here (`everyone`, this rank's at `me`), so
        each side of every exchange is too: what a rank sends an owner is its distinct keys of
        that owner's rows, in order, which is what is picked out here."""
        _, sent, inverse = self._distinct(everyone[me])
        served = []
        for ids in everyone:
            owner, keys = self._keys(ids)
            served.append(torch.unique(keys[owner == me]))
        return Routed(inverse, sent.tolist(), [len(k) for k in served], torch.cat(served))

    def route(self, ids: torch.Tensor) -> Routed:
        """Collective over the group."""
        keys, sent, inverse = self._distinct(ids)
        most, capacity = int(sent.max()) if len(keys) else 0, self.capacity
        box = keys.new_zeros(self.world, 2 + capacity)
        box[:, 0], box[:, 1] = sent, most
        if most <= capacity:
            starts = torch.cumsum(sent, 0) - sent
            owners = torch.repeat_interleave(torch.arange(self.world, device=keys.device), sent)
            box[owners, 2 + torch.arange(len(keys), device=keys.device) - starts[owners]] = keys
        got = torch.empty_like(box)
        dist.all_to_all_single(got, box, group=self.group)
        self.link.count([box.shape[1]] * self.world, box.element_size())
        received, needed = got[:, 0], int(got[:, 1].max())
        self.capacity = needed + needed // 8 + 8  # the same on every rank: every rank's need is known
        if needed <= capacity:
            served = got[:, 2:][torch.arange(capacity, device=got.device).unsqueeze(0) < received.unsqueeze(1)]
            return Routed(inverse, sent.tolist(), received.tolist(), served)
        sent_list, received_list = sent.tolist(), received.tolist()
        served = keys.new_empty(sum(received_list))
        dist.all_to_all_single(served, keys, received_list, sent_list, group=self.group)
        self.link.count(sent_list, keys.element_size())
        return Routed(inverse, sent_list, received_list, served)


def answer(values: torch.Tensor, routed: Routed, link: Link, backward: bool = False) -> InFlight:
    """Rows (forward: owners -> askers) or their gradients (backward: askers -> owners), sent
    without waiting: the caller goes on with its own work while they travel."""
    out_splits, in_splits = (routed.received, routed.sent) if backward else (routed.sent, routed.received)
    out = values.new_empty(sum(out_splits), values.shape[1])
    work = dist.all_to_all_single(out, values.contiguous(), out_splits, in_splits, group=link.group, async_op=True)
    link.count(in_splits, values.shape[1] * values.element_size())
    return InFlight(out, work)


class Fetch(torch.autograd.Function):
    """Forward: the rows of `routed`'s lookups, [tables x samples, dim] in the asker's order, from
    `arrived` (the owners' answer, `answer(...).wait()`). Backward: their gradients, summed per
    distinct key, sent to the owners' `RowGradients` (arriving while backward goes on through the
    layers below). `anchor` (a leaf that requires grad) only makes autograd call the backward;
    it gets no gradient."""

    @staticmethod
    def forward(ctx, anchor, arrived, routed, link, pending):
        ctx.routed, ctx.link, ctx.pending = routed, link, pending
        return arrived.index_select(0, routed.inverse)

    @staticmethod
    def backward(ctx, grad):
        routed = ctx.routed
        distinct = grad.new_zeros(sum(routed.sent), grad.shape[1]).index_add_(0, routed.inverse, grad)
        ctx.pending.add(routed.keys, answer(distinct, routed, ctx.link, backward=True))
        return None, None, None, None, None


def shuffle(values: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of `values` to every rank (`out_splits`), rows from every rank (`in_splits`): one
    all-to-all, for moving whole tables between shardings (checkpoints and the export)."""
    out = values.new_empty(sum(in_splits), *values.shape[1:])
    dist.all_to_all_single(out, values.contiguous(), in_splits, out_splits, group=group)
    return out


def all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(value, group=group)
    return value
