"""Sparse embedding tables on parameter servers: each server holds a row range of every table
with its row-wise Adagrad accumulators; a worker pulls only the rows its batch looks up and
pushes only their gradients.

Worker (`gradmesh.engine.ps.lookup`): pulls the rows a share looks up (ROWS), every table's in
one request per server (the tables' rows numbered in one id space:
`gradmesh.parallel.ps.TableSpace`), and pushes their gradients back (GRADS) before the share's
commit.

Server: the pushed rows wait with their share; sync and ssp:0 sum a step's shares row by row and
apply row-wise Adagrad to the touched rows (`gradmesh.optim.rowwise_adagrad`), which is exactly
what one process does with a dense table gradient (an untouched row's gradient is zero: it
neither moves nor adds to its accumulator). async and ssp:K >= 1 apply each share's rows as it
arrives, at lr x share/batch, as the dense part does.
"""

import torch
import torch.nn as nn

from gradmesh.comm.compress import PushCodec
from gradmesh.comm.ps_records import Rows
from gradmesh.comm.ps_wire import Kind, Message, WireError
from gradmesh.optim import rowwise_adagrad
from gradmesh.parallel.ps import TableSpace, table_rows


class TableShard:
    """Server side: rows [low, high) of one table and their accumulators."""

    def __init__(
        self, table: nn.Embedding, servers: int, server: int, initial, device: torch.device, name: str = "table"
    ):
        """`initial(low, high)`: the table's initial rows (a model whose tables stay on the meta
        device makes them itself, so no rank ever holds the whole table to start)."""
        self.count, self.servers, self.server, self.name = table.num_embeddings, servers, server, name
        self.low, self.high = table_rows(table.num_embeddings, servers, server)
        if table.weight.is_meta:
            self.weight = initial(self.low, self.high).to(device)
        else:
            self.weight = table.weight.detach()[self.low : self.high].clone().to(device)
        self.accumulator = torch.zeros(self.high - self.low, dtype=self.weight.dtype, device=self.weight.device)
        self.updates = 0

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """One row-wise Adagrad update of these distinct rows."""
        local = rows - self.low
        weight, accumulator = self.weight[local], self.accumulator[local]
        rowwise_adagrad(weight, grads, accumulator, lr)
        self.weight[local], self.accumulator[local] = weight, accumulator
        self.updates += 1


class ServerTables:
    """A server's row ranges of every sparse table, and the rows workers pushed: kept with their
    share until it commits, then applied with it (sync: summed over the step's shares)."""

    def __init__(self, shards: list[TableShard], lr: float, codec: PushCodec | None = None):
        self.shards, self.lr, self.codec = shards, lr, codec or PushCodec("none")
        self.held = TableSpace([s.count for s in shards], shards[0].servers) if shards else None
        self.receiving: dict[int, list] = {}
        """worker -> [(table, ids, gradient rows)] pushed for the share it has not committed yet."""
        self.done: dict[int, dict[int, list]] = {}
        """clock -> chunk -> what that share pushed (sync, until the step is complete)."""

    def state_bytes(self) -> int:
        return sum(s.weight.numel() * s.weight.element_size() + s.accumulator.numel() * 4 for s in self.shards)

    def space(self) -> TableSpace:
        """The tables' one id space (only a server holding rows receives ROWS or GRADS: `accept`)."""
        assert self.held is not None, "a table message reached a server that holds no table"
        return self.held

    def rows_held(self) -> int:
        """Rows of every table this server holds: the most one message may name (its ids are distinct)."""
        return sum(s.high - s.low for s in self.shards)

    def check_ids(self, source: int, message: Message, ids: torch.Tensor) -> None:
        """WireError unless every id is a row this server holds. The tables share one id space, so
        an id past a table's end is a row of the next table (or of another server's range): the
        worker checks its lookups before they leave (`WorkerTables`), and this is the last line."""
        total = self.space().offsets[-1]
        inside = (ids >= 0) & (ids < total)
        mine = inside & (
            self.space().ranges(ids.clamp(0, max(total - 1, 0))) % self.space().servers == self.shards[0].server
        )
        if bool(mine.all()):
            return
        bad = int(ids[~mine][0])
        accepted = f"global ids 0..{total - 1}"
        if 0 <= bad < total:
            table = int(self.space().ranges(torch.tensor([bad]))[0]) // self.space().servers
            shard, start = self.shards[table], self.space().offsets[table]
            accepted = (
                f"rows {shard.low}..{shard.high - 1} of {shard.name} (global ids {start + shard.low}.."
                f"{start + shard.high - 1}) on this server; id {bad} is row {bad - start}"
            )
        raise WireError(source, message.kind, "ids", bad, accepted)

    def message(self, wire, source: int, message: Message) -> torch.Tensor | None:
        """ROWS: the ids asked for (answered by `answer` once the version asked for is here);
        GRADS: the rows' gradients, kept until the worker commits. RuntimeError: the worker
        died before sending it all."""
        like = self.shards[0].weight
        ids = payload_of(wire, source, message.samples, 0, like.device)
        self.check_ids(source, message, ids)
        if message.kind == Kind.ROWS:
            return ids
        grads = torch.empty(message.samples, like.shape[1], dtype=like.dtype, device=like.device)
        pushed = self.codec.buffer(grads)
        if message.samples:
            wire.payload_from(source, pushed).wait()
            self.codec.decode(pushed, grads)
        ranges = self.space().ranges(ids)
        tables, parts = ranges // self.space().servers, self.receiving.setdefault(source, [])
        for table in torch.unique(tables).tolist():
            mine = tables == table
            parts.append((table, ids[mine] - self.space().offsets[table], grads[mine]))
        return None

    def answer(self, wire, worker: int, ids: torch.Tensor, version: int, norm_sq: float) -> None:
        """The rows of these global ids, as they are now; `version` and `norm_sq` as a pull's answer."""
        like = self.shards[0].weight
        ranges = self.space().ranges(ids)
        tables = ranges // self.space().servers
        rows = torch.empty(len(ids), like.shape[1], dtype=like.dtype, device=like.device)
        for table in torch.unique(tables).tolist():
            mine = tables == table
            rows[mine] = self.shards[table].weight[ids[mine] - self.space().starts[ranges[mine]]]
        reply = Rows(len(ids), version, norm_sq).message()
        wire.send(worker, reply, rows if len(ids) else None)

    def take(self, worker: int) -> list:
        return self.receiving.pop(worker, [])

    def stash(self, clock: int, chunk: int, parts: list) -> None:
        self.done.setdefault(clock, {})[chunk] = parts

    def step_parts(self, clock: int) -> list:
        """Every share's rows of a complete step, in share order."""
        parts = self.done.pop(clock, {})
        return [part for chunk in sorted(parts) for part in parts[chunk]]

    def summed(self, parts: list) -> list[tuple[TableShard, torch.Tensor, torch.Tensor]]:
        """Per table: the distinct rows pushed and their gradients summed (what one process's
        dense table gradient holds in those rows)."""
        found = []
        for index, shard in enumerate(self.shards):
            mine = [(ids, grads) for table, ids, grads in parts if table == index]
            if mine:
                rows, where = torch.unique(torch.cat([i for i, _ in mine]), return_inverse=True)
                grads = torch.cat([g for _, g in mine])
                total = torch.zeros(len(rows), grads.shape[1], dtype=grads.dtype, device=grads.device)
                found.append((shard, rows, total.index_add_(0, where, grads)))
        return found

    @staticmethod
    def norm_sq(summed: list) -> float:
        return sum(float(grads.double().pow(2).sum()) for _, _, grads in summed)

    def apply(self, summed: list, lr_factor: float, scale: float = 1.0) -> None:
        """Row-wise Adagrad on each table's rows at lr x lr_factor, the gradients times `scale`
        (a share's mean, a clipping factor)."""
        for shard, rows, grads in summed:
            shard.apply(rows, grads.mul_(scale) if scale != 1.0 else grads, self.lr * lr_factor)


def payload_of(wire, source: int, count: int, dim: int, device, dtype=torch.float32) -> torch.Tensor:
    """Receive a payload of `count` rows of `dim` values (dim 0: `count` ids) from `source`."""
    rows = torch.empty((count, dim) if dim else (count,), dtype=torch.int64 if not dim else dtype, device=device)
    if count:  # an empty request (hybrid: a pull with no rows of this server's) has no payload
        wire.payload_from(source, rows).wait()
    return rows
