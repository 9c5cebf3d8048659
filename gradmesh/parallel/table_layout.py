"""Where the `tables` strategy keeps each sparse table's rows (`--table-sharding`), and the moves
between its two shardings that checkpoints and the export make.

row (the default): every table split in even row ranges over every rank (torch.chunk's split:
rank r holds rows [r c, (r + 1) c), c = ceil(rows / ranks)), as DLRM's and TorchRec's row-wise
sharding. table: every table whole on one rank (TorchRec's table-wise), placed greedily by size —
the largest first, each to the rank holding the fewest rows so far (ties to the lower rank) — the
same on every rank, as it reads only the tables' sizes.

Either way a checkpoint holds each table, and its row-wise accumulator, as a DTensor sharded on
its rows over the data axis, as FSDP2 keeps a parameter: DCP then reshards it to and from every
other strategy, world size and sharding. Under table-wise sharding that DTensor is made when a
checkpoint or the export asks for it (`to_rows`: one all-to-all per table, from its owner to
every rank), and a loaded one goes back to the owner (`from_rows`); training never holds it.
"""

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

from gradmesh.comm.exchange import Placement, shuffle
from gradmesh.parallel.placement import greedy_owners


@dataclass
class Layout:
    """One rank's view of where every table's rows live."""

    rows: list[int]
    ranks: int
    me: int
    owners: list[int] | None
    """Each table's rank under table-wise sharding; None: row-wise."""
    ranges: list[tuple[int, int]]
    """This rank's [low, high) of each table."""
    starts: list[int]
    """Where table t's rows start among its owner's (every owner's, row-wise)."""
    size: int
    """Rows the largest rank holds (row-wise: tables x the longest range)."""
    held: int
    """Rows this rank holds."""

    def placement(self, device) -> Placement:
        """The exchange's `Placement` of these tables."""

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, device=device).unsqueeze(1)

        if self.owners is None:
            chunks = [_chunk(rows, self.ranks) for rows in self.rows]
            return Placement(column([0] * len(self.rows)), column(chunks), column(self.starts), self.size)
        return Placement(column(self.owners), column(self.rows), column(self.starts), self.size)


def _chunk(rows: int, ranks: int) -> int:
    """The rows of a full range under row-wise sharding (torch.chunk's split)."""
    return -(-rows // ranks)


def row_layout(rows: list[int], ranks: int, me: int) -> Layout:
    chunks = [_chunk(count, ranks) for count in rows]
    span = max(chunks)
    ranges = [(min(me * c, count), min((me + 1) * c, count)) for c, count in zip(chunks, rows)]
    starts = [t * span for t in range(len(rows))]
    return Layout(rows, ranks, me, None, ranges, starts, len(rows) * span, len(rows) * span)


def table_layout(rows: list[int], ranks: int, me: int) -> Layout:
    owners = greedy_owners(rows, ranks)
    held, starts = [0] * ranks, []
    for count, owner in zip(rows, owners):
        starts.append(held[owner])
        held[owner] += count
    ranges = [(0, count if owner == me else 0) for count, owner in zip(rows, owners)]
    return Layout(rows, ranks, me, owners, ranges, starts, max(held), held[me])


def layout_for(sharding: str, rows: list[int], ranks: int, me: int) -> Layout:
    """`--table-sharding` row or table (checked by the config)."""
    return table_layout(rows, ranks, me) if sharding == "table" else row_layout(rows, ranks, me)


def _row_counts(rows: int, ranks: int) -> list[int]:
    """Rows of each rank's range under row-wise sharding."""
    chunk = _chunk(rows, ranks)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(ranks)]


def to_rows(held: torch.Tensor, layout: Layout, table: int, group, mesh) -> DTensor:
    """Table `table` (or its accumulator), which its owner holds whole (`held`; empty elsewhere),
    as a DTensor sharded on its rows over `mesh` (the data axis, `group`). Collective."""
    owner, counts = _owner(layout, table), _row_counts(layout.rows[table], layout.ranks)
    sent = counts if layout.me == owner else [0] * layout.ranks
    received = [counts[layout.me] if r == owner else 0 for r in range(layout.ranks)]
    local = shuffle(held, sent, received, group)
    shape = torch.Size((layout.rows[table], *held.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def from_rows(loaded: torch.Tensor, layout: Layout, table: int, group) -> torch.Tensor:
    """What `to_rows` made, back: the whole table on its owner, empty elsewhere (a plain tensor,
    whole, is cut on the owner alone). Collective for a DTensor."""
    owner, counts = _owner(layout, table), _row_counts(layout.rows[table], layout.ranks)
    if not isinstance(loaded, DTensor):
        return loaded if layout.me == owner else loaded[:0]
    sent = [counts[layout.me] if r == owner else 0 for r in range(layout.ranks)]
    received = counts if layout.me == owner else [0] * layout.ranks
    return shuffle(loaded.to_local(), sent, received, group)


def _owner(layout: Layout, table: int) -> int:
    assert layout.owners is not None, "row-wise tables are DTensors already"
    return layout.owners[table]
