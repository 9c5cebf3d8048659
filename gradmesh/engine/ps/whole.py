"""The sparse tables whole, for the moments that need them: checkpoints and the final weights,
which hold the model as data parallelism does (every table whole, under its parameter name) so
that they reshard to any strategy.

No rank holds a whole table while training: servers hold their row ranges
(`gradmesh.engine.ps.tables.TableShard`), workers the rows of the share they compute
(`gradmesh.engine.ps.lookup`; also when they evaluate), and each table's weight in the model is
a placeholder on the meta device. A checkpoint collects the whole tables on the first server
alone (its shard of the checkpoint holds them), a resume loads them whole on the servers,
which keep their ranges, and the final export collects them on rank 0, which writes the model
file; `release` puts the placeholders back.
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

    def keys(self) -> set[str]:
        return {f"{name}.weight" for name, _ in self.tables}

    def collect(self, shards: list | None, to: int, me: int, group) -> None:
        """Collective over the servers and rank `to`: every table whole in `to`'s model, from the
        servers' ranges (`shards`: this rank's, if it is a server)."""
        if me == to:
            self.make_room()
        shards = shards or []  # a server's own ranges; a worker has none, and sends none
        for index, (_, table) in enumerate(self.tables):
            for s in range(self.roles.servers):
                low, high = table_rows(table.num_embeddings, self.roles.servers, s)
                source = self.roles.server_rank(s)
                if me == source == to:
                    with torch.no_grad():
                        table.weight[low:high] = shards[index].weight
                elif me == source:
                    dist.send(shards[index].weight.contiguous(), dst=to, group=group)
                elif me == to:
                    dist.recv(table.weight.data[low:high], src=source, group=group)

    def state(self, shards: list | None, to: int, me: int, group) -> dict:
        """Collective over the servers: each table's row accumulators and update count, whole, on
        server rank `to` ({} elsewhere)."""
        found = {}
        shards = shards or []
        for index, (name, table) in enumerate(self.tables):
            # NCCL: on the GPU; a rank other than `to` receives nothing into it
            whole = torch.zeros(table.num_embeddings if me == to else 0, device=self.device)
            for s in range(self.roles.servers):
                low, high = table_rows(table.num_embeddings, self.roles.servers, s)
                source = self.roles.server_rank(s)
                if me == source == to:
                    whole[low:high] = shards[index].accumulator
                elif me == source:
                    dist.send(shards[index].accumulator.contiguous(), dst=to, group=group)
                elif me == to:
                    dist.recv(whole[low:high], src=source, group=group)
            if me == to and shards[index].updates:
                found[f"{name}.weight"] = {"sum": whole, "step": torch.tensor(float(shards[index].updates))}
        return found

    def template(self) -> dict:
        """Zeros shaped as the tables' optimizer state to be loaded."""
        return {
            f"{name}.weight": {"sum": torch.zeros(table.num_embeddings), "step": torch.tensor(0.0)}
            for name, table in self.tables
        }

    def install(self, shards: list, saved: dict) -> None:
        """A server's ranges from the loaded whole tables and their saved state."""
        for shard, (name, table) in zip(shards, self.tables):
            shard.weight.copy_(table.weight.detach()[shard.low : shard.high])
            state = saved.get(f"{name}.weight", {})
            if "sum" in state:
                shard.accumulator.copy_(state["sum"][shard.low : shard.high])
                shard.updates = int(state["step"].item())
