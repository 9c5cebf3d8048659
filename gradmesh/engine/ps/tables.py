"""Sparse embedding tables on parameter servers: each server holds a row range of every table
with its row-wise Adagrad accumulators; a worker pulls only the rows its batch looks up and
pushes only their gradients.

Worker: a forward pre-hook on each table sees the ids the batch looks up, pulls those rows from
the servers that hold them (ROWS) into the worker's copy of the table, and the table computes a
sparse gradient (`nn.Embedding(sparse=True)`), whose rows go back to their servers (GRADS)
before the share's commit. Rows the batch does not touch are never moved, so a worker's copy is
stale everywhere but where it looks.

Server: the pushed rows wait with their share; sync and ssp:0 sum a step's shares row by row and
apply row-wise Adagrad to the touched rows (`gradmesh.optim.rowwise_adagrad`), which is exactly
what one process does with a dense table gradient (an untouched row's gradient is zero: it
neither moves nor adds to its accumulator). async and ssp:K >= 1 apply each share's rows as it
arrives, at lr x share/batch, as the dense part does.
"""

import torch
import torch.nn as nn

from gradmesh.comm.ps_wire import Kind, Message
from gradmesh.optim import rowwise_adagrad
from gradmesh.parallel.ps import table_rows


class TableShard:
    """Server side: rows [low, high) of one table and their accumulators."""

    def __init__(self, table: nn.Embedding, servers: int, server: int):
        self.low, self.high = table_rows(table.num_embeddings, servers, server)
        self.weight = table.weight.detach()[self.low:self.high].clone()
        self.accumulator = torch.zeros(self.high - self.low, dtype=self.weight.dtype, device=self.weight.device)
        self.updates = 0

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids - self.low].contiguous()

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

    def __init__(self, shards: list[TableShard], lr: float):
        self.shards, self.lr = shards, lr
        self.receiving: dict[int, list] = {}
        """worker -> [(table, ids, gradient rows)] pushed for the share it has not committed yet."""
        self.done: dict[int, dict[int, list]] = {}
        """clock -> chunk -> what that share pushed (sync, until the step is complete)."""

    def state_bytes(self) -> int:
        return sum(s.weight.numel() * s.weight.element_size() + s.accumulator.numel() * 4 for s in self.shards)

    def message(self, wire, source: int, message: Message) -> None:
        """ROWS: answer with the rows asked for (their current values); GRADS: keep the rows'
        gradients until the worker commits. RuntimeError: the worker died before sending it all."""
        shard = self.shards[message.bucket]
        weight = shard.weight
        ids = payload_of(wire, source, message.samples, 0, weight.device)
        if message.kind == Kind.ROWS:
            wire.send(source, Message(Kind.ROWS, bucket=message.bucket, samples=len(ids)), shard.rows(ids))
            return
        grads = payload_of(wire, source, message.samples, weight.shape[1], weight.device, weight.dtype)
        self.receiving.setdefault(source, []).append((message.bucket, ids, grads))

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
    wire.payload_from(source, rows).wait()
    return rows


class WorkerTables:
    """Worker side: pull what the forward looks up, push the sparse gradients after backward."""

    def __init__(self, tables: list[tuple[str, nn.Embedding]], roles, wire):
        self.tables, self.roles, self.wire = [module for _, module in tables], roles, wire
        self.active = False
        """Pull on lookup only while computing a share (evaluation uses the refreshed tables)."""
        for index, module in enumerate(self.tables):
            module.sparse = True  # the gradient holds the looked-up rows only
            module.register_forward_pre_hook(lambda module, inputs, index=index: self._pull(index, inputs[0]))

    def _owners(self, table: int, ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(server index, the ids it holds) for the servers holding any of `ids`."""
        rows = self.tables[table].num_embeddings
        found = []
        for s in range(self.roles.servers):
            low, high = table_rows(rows, self.roles.servers, s)
            mine = ids[(ids >= low) & (ids < high)]
            if len(mine):
                found.append((s, mine.contiguous()))
        return found

    def _pull(self, table: int, ids: torch.Tensor) -> None:
        if not self.active:
            return
        wanted = torch.unique(ids)
        asked = self._owners(table, wanted)
        for s, mine in asked:
            self.wire.send(self.roles.server_rank(s), Message(Kind.ROWS, bucket=table, samples=len(mine)), mine)
        weight = self.tables[table].weight
        for s, mine in asked:
            server = self.roles.server_rank(s)
            reply = self.wire.receive_from(server)
            assert reply.kind == Kind.ROWS and reply.samples == len(mine), reply
            with torch.no_grad():
                weight[mine] = payload_of(self.wire, server, len(mine), weight.shape[1], weight.device, weight.dtype)

    def push(self) -> float:
        """Each table's gradient rows to the servers holding them (before the share's commit);
        their sum of squares (for the global gradient norm)."""
        squares = 0.0
        for index, module in enumerate(self.tables):
            grad = module.weight.grad
            if grad is None:
                continue
            grad = grad.coalesce()
            ids, values = grad.indices()[0], grad.values()
            squares += float(values.double().pow(2).sum())
            for s, mine in self._owners(index, ids):
                keep = torch.isin(ids, mine)
                self.wire.send(self.roles.server_rank(s), Message(Kind.GRADS, bucket=index, samples=len(mine)), mine)
                self.wire.send_payload(self.roles.server_rank(s), values[keep].contiguous())
            module.weight.grad = None
        return squares
