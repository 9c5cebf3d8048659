"""The sparse tables whole, for the moments that need them: evaluation, checkpoints and the
final weights, which read the model as data parallelism holds it (every table whole, under its
parameter name) so that they reshard to any strategy.

While training no rank holds a whole table: servers hold their row ranges
(`gradmesh.engine.ps.tables.TableShard`), workers the rows of the share they compute
(`gradmesh.engine.ps.lookup`), and each table's weight in the model is a placeholder on the
meta device. `gather` puts the whole tables in every rank's model from the servers' ranges
(collective); `release` puts the placeholders back once training goes on.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.parallel.ps import Roles, table_rows


class WholeTables:
    def __init__(self, tables: list[tuple[str, nn.Embedding]], roles: Roles, device: torch.device):
        self.tables, self.roles, self.device = tables, roles, device
        self.placeholders = [nn.Parameter(torch.empty(table.weight.shape, device="meta")) for _, table in tables]

    def release(self) -> None:
        for (_, table), placeholder in zip(self.tables, self.placeholders):
            table.weight = placeholder

    def make_room(self) -> None:
        """Every table whole (uninitialised) in this rank's model, for a gather or a load."""
        for _, table in self.tables:
            if table.weight.is_meta or table.weight.shape[0] != table.num_embeddings:
                table.weight = nn.Parameter(torch.empty(table.num_embeddings, table.embedding_dim, device=self.device))

    def gather(self, shards: list | None, group) -> None:
        """Collective: every table whole in every rank's model (`shards`: a server's own ranges)."""
        self.make_room()
        for index, (_, table) in enumerate(self.tables):
            with torch.no_grad():
                if shards:
                    table.weight[shards[index].low:shards[index].high] = shards[index].weight
                for s in range(self.roles.servers):
                    low, high = table_rows(table.num_embeddings, self.roles.servers, s)
                    dist.broadcast(table.weight.data[low:high], src=self.roles.server_rank(s), group=group)

    def state(self, shards: list | None, group) -> dict:
        """Collective: each table's row accumulators and update count, whole, on every rank."""
        found = {}
        for index, (name, table) in enumerate(self.tables):
            whole, step = torch.zeros(table.num_embeddings), torch.zeros((), dtype=torch.float64)
            if shards:
                whole[shards[index].low:shards[index].high] = shards[index].accumulator
                step.fill_(float(shards[index].updates))
            for s in range(self.roles.servers):
                low, high = table_rows(table.num_embeddings, self.roles.servers, s)
                dist.broadcast(whole[low:high], src=self.roles.server_rank(s), group=group)
            dist.broadcast(step, src=self.roles.server_rank(0), group=group)
            if step.item():
                found[f"{name}.weight"] = {"sum": whole, "step": step.float()}
        return found

    def template(self) -> dict:
        """Zeros shaped as the tables' optimizer state to be loaded."""
        return {f"{name}.weight": {"sum": torch.zeros(table.num_embeddings), "step": torch.tensor(0.0)}
                for name, table in self.tables}

    def install(self, shards: list, saved: dict) -> None:
        """A server's ranges from the loaded whole tables and their saved state."""
        for shard, (name, table) in zip(shards, self.tables):
            shard.weight.copy_(table.weight.detach()[shard.low:shard.high])
            state = saved.get(f"{name}.weight", {})
            if "sum" in state:
                shard.accumulator.copy_(state["sum"][shard.low:shard.high])
                shard.updates = int(state["step"].item())
