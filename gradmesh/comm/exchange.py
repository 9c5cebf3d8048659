"""Rows of row-sharded tables fetched from their owners and their gradients sent back: the
all-to-all exchange behind the `tables` strategy (`gradmesh.parallel.tables`).

Each rank asks for the rows its share of a batch looks up, every table at once: the ids are
grouped by the rank that owns their row (even row ranges, torch.chunk's split), the counts go
first (all-to-all of one integer per peer) so that both sides know every split, then the
(table, row) pairs (all-to-all), and the owners answer with the rows (all-to-all back). In
backward the rows' gradients take the reverse way to their owners (all-to-all), which keep
them, unsummed, until the optimizer step (`RowGradients`). Four collectives a step whatever
the number of tables; the bytes are those of the rows a share touches, not of the tables.

torch has no sharded embedding; TorchRec has one, but it pins its own torch and FBGEMM build.
The exchange is plain `torch.distributed.all_to_all_single` (gloo and NCCL), kept here, apart
from the strategy, as every other collective of gradmesh is.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Routed:
    """One forward's exchange: who asked whom for what."""

    order: torch.Tensor
    """Permutation of this rank's flattened [tables x samples] lookups into owner order."""
    sent: list[int]
    """Lookups sent to each owner."""
    received: list[int]
    """Lookups received from each rank."""
    keys: torch.Tensor
    """Every lookup this rank serves, in arrival order, as table x `span` + row of its range."""


class RowGradients:
    """A rank's pending table gradients: (keys, rows' gradients) per backward, summed per distinct
    row when the step asks (`summed`), dropped by `clear`."""

    def __init__(self, tables: int, span: int):
        self.tables, self.span = tables, span
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cached: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def add(self, keys: torch.Tensor, grads: torch.Tensor) -> None:
        self.parts.append((keys, grads))
        self.cached = None

    def clear(self) -> None:
        self.parts = []
        self.cached = None

    def summed(self, scale: float, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per table: (distinct rows of its range, their gradients summed, times `scale`); the same
        tensors until `add` or `clear` (a clip scales them in place before the step reads them)."""
        if self.cached is None:
            if self.parts:
                keys, grads = torch.cat([k for k, _ in self.parts]), torch.cat([g for _, g in self.parts])
            else:
                keys, grads = torch.zeros(0, dtype=torch.long), torch.zeros(0, dim)
            distinct, inverse = torch.unique(keys, return_inverse=True)  # sorted: by table, then row
            total = grads.new_zeros(len(distinct), grads.shape[1]).index_add_(0, inverse, grads).mul_(scale)
            counts = torch.bincount(distinct // self.span, minlength=self.tables).tolist()
            self.cached = list(zip((distinct % self.span).split(counts), total.split(counts)))
        return self.cached


def serve(keys: torch.Tensor, span: int, tables: list[torch.Tensor]) -> torch.Tensor:
    """The rows `keys` ask for (table x span + row), from each table's local rows."""
    table = keys // span
    order = torch.argsort(table, stable=True)
    counts = torch.bincount(table, minlength=len(tables)).tolist()
    parts = [rows.index_select(0, wanted) for rows, wanted in zip(tables, (keys[order] % span).split(counts))]
    served = torch.empty(len(keys), tables[0].shape[1], dtype=tables[0].dtype, device=keys.device)
    served[order] = torch.cat(parts)
    return served


def route(ids: torch.Tensor, chunks: torch.Tensor, span: int, world: int, group) -> Routed:
    """Collective: send each lookup of `ids` [tables, samples] to the rank owning its row (row r of
    table t lives on rank r // chunks[t]); each as one key, table x `span` + row of the range."""
    tables = ids.shape[0]
    owner = ids // chunks.unsqueeze(1)
    table = torch.arange(tables, device=ids.device).unsqueeze(1)
    keys = (table * span + ids - owner * chunks.unsqueeze(1)).reshape(-1)
    flat_owner = owner.reshape(-1)
    order = torch.argsort(flat_owner, stable=True)
    sent = torch.bincount(flat_owner, minlength=world)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    sent_list, received_list = sent.tolist(), received.tolist()
    served = keys.new_empty(sum(received_list))
    dist.all_to_all_single(served, keys[order], received_list, sent_list, group=group)
    return Routed(order, sent_list, received_list, served)


def _answer(values: torch.Tensor, routed: Routed, group, backward: bool) -> torch.Tensor:
    """Rows (forward: owners -> askers) or their gradients (backward: askers -> owners)."""
    out_splits, in_splits = (routed.received, routed.sent) if backward else (routed.sent, routed.received)
    out = values.new_empty(sum(out_splits), values.shape[1])
    dist.all_to_all_single(out, values.contiguous(), out_splits, in_splits, group=group)
    return out


class Fetch(torch.autograd.Function):
    """Forward: the rows of `routed`'s lookups, [tables x samples, dim] in the asker's order.
    Backward: their gradients to the owners' `RowGradients`. `anchor` (a leaf that requires
    grad) only makes autograd call the backward; it gets no gradient."""

    @staticmethod
    def forward(ctx, anchor, served_rows, routed, group, pending):
        ctx.routed, ctx.group, ctx.pending = routed, group, pending
        arrived = _answer(served_rows, routed, group, backward=False)
        rows = torch.empty_like(arrived)
        rows[routed.order] = arrived
        return rows

    @staticmethod
    def backward(ctx, grad):
        routed = ctx.routed
        grads = _answer(grad[routed.order], routed, ctx.group, backward=True)
        ctx.pending.add(routed.keys, grads)
        return None, None, None, None, None


def all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(value, group=group)
    return value
