"""One rank's rows of every sparse table in one tensor, for the `tables` strategy.

Table t's rows held here sit from row start[t] of one [rows held, dim] tensor (row-wise: t x
span, span the longest range; table-wise: after the tables this rank owns before it,
`gradmesh.parallel.table_layout`), and their row-wise Adagrad accumulators likewise in one
vector: a lookup's key (`gradmesh.comm.exchange.Placement`) is its row here, so serving every
table's rows, and stepping every touched row, is one indexed operation each rather than one per
table. Each table's weight (and its accumulator in the optimizer's state) is a view into these
tensors — row-wise a DTensor whose local part it is, table-wise a plain tensor (the whole table
on its owner, no rows elsewhere) — so the optimizer sees the tables by their names as usual; a
load copies into the views in place. A step checks that the views are still the storage it
updates, and says so where they are not.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from gradmesh.optim import rowwise_adagrad
from gradmesh.parallel.table_layout import Layout


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor without the autograd function `to_local` runs (a step
    reads it for every table)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class TableRows:
    def __init__(self, tables: list[nn.Embedding], layout: Layout, mesh, device):
        """`layout`: where this rank's rows of each table go; `mesh`: the data axis's."""
        self.tables, self.mesh, self.starts = tables, mesh, layout.starts
        self.sharded = layout.owners is None  # row-wise: the weights are DTensors
        self.counts = [high - low for low, high in layout.ranges]
        self.weights = torch.zeros(layout.held, tables[0].embedding_dim, device=device)
        self.sums = torch.zeros(layout.held, device=device)

    def place(self, index: int, rows: torch.Tensor) -> None:
        """Table `index`'s initial rows into their place, its weight a DTensor over them."""
        table, part = self.tables[index], self._part(self.weights, index)
        part.copy_(rows)
        shape = torch.Size((table.num_embeddings, table.embedding_dim))
        if self.sharded:
            part = DTensor.from_local(part, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=(shape[1], 1))
        table.weight = nn.Parameter(part)

    def _part(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Table `index`'s rows here (none: an empty slice)."""
        start = self.starts[index] if self.counts[index] else 0
        return flat[start : start + self.counts[index]]

    def load(self, index: int, rows: torch.Tensor) -> None:
        """Table `index`'s rows here, replaced in place (table-wise: `table_layout.from_rows`)."""
        self._part(self.weights, index).copy_(rows)

    def accumulator(self, index: int) -> torch.Tensor:
        return self._part(self.sums, index)

    def serve(self, keys: torch.Tensor) -> torch.Tensor:
        return self.weights.index_select(0, keys)

    def step(self, optimizer: torch.optim.Optimizer, keys: torch.Tensor, grads: torch.Tensor) -> None:
        """Row-wise Adagrad on the rows `keys` at table_lr times the run's schedule (the group of
        the first table: every table is in it), and a step counted for every table."""
        self._check_views()
        group = next(g for g in optimizer.param_groups if any(p is self.tables[0].weight for p in g["params"]))
        schedule = group["lr"] / group["first_lr"] if group.get("first_lr") else 0.0
        for index in range(len(self.tables)):
            self._adopt_state(optimizer, index)
        values, sums = self.weights[keys], self.sums[keys]
        rowwise_adagrad(values, grads, sums, group.get("table_lr", group["lr"]) * schedule)
        self.weights[keys], self.sums[keys] = values, sums

    def _adopt_state(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """The optimizer's state of table `index`: its accumulator a view of `sums` (one loaded or
        made elsewhere is copied in first), its step count one more."""
        weight = self.tables[index].weight
        state = optimizer.state[weight]
        part = self._part(self.sums, index)
        found = state.get("sum")
        if found is None or local_of(found).data_ptr() != part.data_ptr():
            if found is not None:
                part.copy_(local_of(found))
            shape = torch.Size((self.tables[index].num_embeddings,))
            if self.sharded:
                part = DTensor.from_local(part, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=(1,))
            state["sum"] = part
            state.setdefault("step", torch.tensor(0.0))
        state["step"] += 1

    def _check_views(self) -> None:
        for index, table in enumerate(self.tables):
            if self.counts[index] and local_of(table.weight).data_ptr() != self._part(self.weights, index).data_ptr():
                raise RuntimeError(
                    f"the weight of sparse table {index} no longer views the rows the tables strategy steps "
                    "(was it replaced rather than loaded in place?)"
                )
