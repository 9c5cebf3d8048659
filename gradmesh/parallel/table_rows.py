"""One rank's rows of every sparse table in one tensor, for the `tables` strategy.

Table t's rows of this rank's range sit from row t x span of one [tables x span, dim] tensor
(span: the longest range), and their row-wise Adagrad accumulators likewise in one vector: a
lookup's key (table x span + row of the range, `gradmesh.comm.exchange`) is its row here, so
serving every table's rows, and stepping every touched row, is one indexed operation each
rather than one per table. Each table's weight (and its accumulator in the optimizer's state)
is a DTensor whose local part is a view into these tensors, so checkpoints, the export and the
optimizer see the tables by their names as usual; a load copies into the views in place. A
step checks that the views are still the storage it updates, and says so where they are not.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from gradmesh.optim import rowwise_adagrad


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor without the autograd function `to_local` runs (a step
    reads it for every table)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class TableRows:
    def __init__(self, tables: list[nn.Embedding], ranges: list[tuple[int, int]], span: int, mesh, device):
        """`ranges`: this rank's [low, high) of each table; `mesh`: the data axis's."""
        self.tables, self.span, self.mesh = tables, span, mesh
        self.counts = [high - low for low, high in ranges]
        dim = tables[0].embedding_dim
        self.weights = torch.zeros(len(tables) * span, dim, device=device)
        self.sums = torch.zeros(len(tables) * span, device=device)

    def place(self, index: int, rows: torch.Tensor) -> None:
        """Table `index`'s initial rows into their place, its weight a DTensor over them."""
        table, part = self.tables[index], self._part(self.weights, index)
        part.copy_(rows)
        shape = torch.Size((table.num_embeddings, table.embedding_dim))
        weight = DTensor.from_local(part, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=(shape[1], 1))
        table.weight = nn.Parameter(weight)

    def _part(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        start = index * self.span
        return flat[start : start + self.counts[index]]

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
            shape = torch.Size((weight.shape[0],))
            state["sum"] = DTensor.from_local(part, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=(1,))
            state.setdefault("step", torch.tensor(0.0))
        state["step"] += 1

    def _check_views(self) -> None:
        for index, table in enumerate(self.tables):
            if self.counts[index] and local_of(table.weight).data_ptr() != self._part(self.weights, index).data_ptr():
                raise RuntimeError(
                    f"the weight of sparse table {index} no longer views the rows the tables strategy steps "
                    "(was it replaced rather than loaded in place?)"
                )
