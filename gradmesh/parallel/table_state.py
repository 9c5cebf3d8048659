"""Checkpoints and the export of table-wise sparse tables (`--table-sharding table`): the state
dict shows each table, and its accumulator in the optimizer's state, as the row-wise DTensor a
row-wise run holds (`gradmesh.parallel.table_layout.to_rows`), so that DCP saves the same
checkpoint and reshards it to and from every strategy, world size and sharding, and the export
gathers it as every other sharded weight. Made only when a state dict is asked for (every rank
asks at once: a checkpoint, the export), and dropped after; a loaded one goes back to the
table's owner (`from_rows`) into the rows that train.

Each table module's own state-dict methods are replaced on the instance (`install`), as its
forward is: whatever asks the model for its state (DCP's helpers, `state_dict()`) gets the
row-wise tensor, and a load puts it back in place.
"""

import functools

import torch
import torch.nn as nn

from gradmesh.parallel.table_layout import Layout, from_rows, to_rows
from gradmesh.parallel.table_rows import TableRows


class TableWiseState:
    def __init__(self, tables: list[nn.Embedding], names: list[str], storage: TableRows, layout: Layout, group, mesh):
        """`names`: each table weight's name in the model (the optimizer state's keys)."""
        self.tables, self.names, self.storage, self.layout = tables, names, storage, layout
        self.group, self.mesh = group, mesh

    def install(self) -> None:
        for index, table in enumerate(self.tables):
            table._save_to_state_dict = functools.partial(self._save, index)  # type: ignore[method-assign]
            table._load_from_state_dict = functools.partial(self._load, index)  # type: ignore[method-assign]

    def _save(self, index: int, destination: dict, prefix: str, keep_vars: bool) -> None:
        held = self.tables[index].weight.detach()
        destination[prefix + "weight"] = to_rows(held, self.layout, index, self.group, self.mesh)

    def _load(self, index: int, state: dict, prefix: str, metadata, strict: bool, missing: list, *rest) -> None:
        key = prefix + "weight"
        if key not in state:
            missing.append(key)
            return
        with torch.no_grad():
            self.storage.load(index, from_rows(state[key], self.layout, index, self.group))

    def saved_sums(self, states: dict) -> None:
        """The optimizer state by parameter name (`gradmesh.parallel.state.named_optimizer_state`):
        each table's accumulator made row-wise, in a dict of its own (the optimizer keeps its own)."""
        for index, name in enumerate(self.names):
            if "sum" in states.get(name, {}):
                held = states[name]["sum"].detach()
                states[name] = dict(states[name], sum=to_rows(held, self.layout, index, self.group, self.mesh))

    def loaded_sums(self, states: dict) -> None:
        """A loaded optimizer state's accumulators back to their tables' owners (a step copies
        them into the rows that train: `TableRows._adopt_state`)."""
        for index, name in enumerate(self.names):
            if "sum" in states.get(name, {}):
                states[name]["sum"] = from_rows(states[name]["sum"], self.layout, index, self.group).clone()
