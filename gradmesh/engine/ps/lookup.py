"""A parameter-server worker's side of the sparse tables: it holds no table, only the rows of
the share it computes.

A forward pre-hook on the model asks it which ids each table will look up
(`model.lookups(*inputs)`) and pulls those rows of every table at once, one request per server
(ROWS), since round trips, not bytes, bound a small share. Each table then looks up its rows in
a block of just those rows (the table's weight for that forward, its ids mapped into the block),
so backward leaves a dense gradient per block, whose rows go back to their servers in one
message each (GRADS) before the share's commit. Between shares a table's weight is a
placeholder on the meta device; evaluation and checkpoints put the whole table there for a
while (`ParameterServerEngine.refresh`).
"""

from collections.abc import Callable

import torch
import torch.nn as nn

from gradmesh.comm.compress import PushCodec
from gradmesh.comm.ps_records import Grads, Rows, RowsWanted
from gradmesh.comm.ps_wire import Kind
from gradmesh.engine.ps.tables import payload_of
from gradmesh.engine.ps.timing import RoleClock
from gradmesh.parallel.ps import TableSpace


class WorkerTables:
    def __init__(
        self,
        model: nn.Module,
        tables: list[tuple[str, nn.Embedding]],
        roles,
        wire,
        codec: PushCodec | None = None,
        clock: RoleClock | None = None,
        heard: Callable[[float], None] | None = None,
    ):
        self.tables, self.roles, self.wire = [module for _, module in tables], roles, wire
        self.names = [name for name, _ in tables]
        self.codec = codec or PushCodec("none")
        """How the rows' gradients travel (--compression fp16|bf16: half width)."""
        self.clock = clock or RoleClock("worker")
        """The worker's `RoleClock` (its wait for rows is pull time)."""
        self.space = TableSpace([module.num_embeddings for module in self.tables], roles.servers)
        self.active = False
        """Pull on lookup while computing a share..."""
        self.evaluating = False
        """...or evaluating (only the latest block kept, no gradients)."""
        self.gate: tuple[int, int] | None = None
        """Hybrid: (clock, least version) of a share whose first row request is its pull: every
        server answers it once its version is at least `least` (as a PULL waits), with that version
        (`versions`, for the commit) and, from the dispatcher, the previous step's global norm
        (handed to `heard`)."""
        self.versions: list[int] = []
        self.heard = heard
        """Hybrid: `DenseReplica.catch_up`, told the previous step's global norm (squared)."""
        self.blocks: list[list[tuple[torch.Tensor, nn.Parameter]]] = [[] for _ in self.tables]
        """Per table, the (ids, rows) blocks of the share's micro-batches so far, in order."""
        for index, module in enumerate(self.tables):
            module.register_forward_pre_hook(lambda module, inputs, index=index: self._lookup(index, module, inputs[0]))
        model.register_forward_pre_hook(lambda module, inputs: self._pull(module.lookups(*inputs)))

    def _lookup(self, index: int, module: nn.Embedding, ids: torch.Tensor):
        """The table looks up this micro-batch's block: its weight for now, the ids mapped into it."""
        if not (self.active or self.evaluating):
            return None
        found, block = self.blocks[index][-1]
        module.weight, module.sparse = block, False
        at = torch.searchsorted(found, ids.contiguous()).clamp(max=max(len(found) - 1, 0))
        if len(found) == 0 or not torch.equal(found[at], ids):  # else a row of another id, silently
            missing = ids[found[at] != ids][0] if len(found) else ids.reshape(-1)[0]
            raise ValueError(
                f"sparse table {self.names[index]} looked up id {int(missing)}, which the model's "
                f"lookups(...) did not list for it: lookups must give exactly the ids each table's "
                f"forward looks up"
            )
        return (at,)

    def _pull(self, lookups: list[torch.Tensor]) -> None:
        if not (self.active or self.evaluating):
            return
        if self.evaluating:
            for blocks in self.blocks:
                blocks.clear()
        wanted = [torch.unique(ids) for ids in self._checked(lookups)]
        ids = torch.cat([found + self.space.offsets[t] for t, found in enumerate(wanted)])
        gate, self.gate = self.gate, None
        asked = self.space.by_server(ids, every=gate is not None)  # a pull: every server answers it
        clock, least = gate or (0, 0)
        for s, mine in asked:
            count = int(mine.sum())
            self.wire.send(
                self.roles.server_rank(s),
                RowsWanted(clock, least, count).message(),
                ids[mine] if count else None,
            )
        like = self.tables[0]
        rows = torch.empty(len(ids), like.embedding_dim, device=lookups[0].device)
        versions = []
        with self.clock.phase("pull"):
            for s, mine in asked:
                server = self.roles.server_rank(s)
                reply = self.wire.receive_from(server).expect(server, Kind.ROWS)
                reply.check(
                    server, "samples", reply.samples == int(mine.sum()), f"{int(mine.sum())}, the rows asked for"
                )
                answer = Rows.read(reply)
                rows[mine] = payload_of(self.wire, server, answer.count, like.embedding_dim, rows.device, rows.dtype)
                versions.append(answer.version)
                if gate is not None and s == 0 and self.heard:
                    self.heard(answer.norm_sq)
        if gate is not None:
            self.versions = versions
        for blocks, found, part in zip(self.blocks, wanted, rows.split([len(f) for f in wanted])):
            blocks.append((found, nn.Parameter(part)))

    def _checked(self, lookups: list[torch.Tensor]) -> list[torch.Tensor]:
        """The ids each table will look up, each in its table's range, before any leaves this
        worker. The tables share one id space on the wire, so an id past a table's end would be a
        row of the next table there; data parallelism's nn.Embedding raises IndexError, and so
        does this, naming the table, the id and the range."""
        lookups = list(lookups)
        if len(lookups) != len(self.tables):
            raise ValueError(
                f"the model's lookups(...) gave {len(lookups)} id tensors for its {len(self.tables)} "
                f"sparse tables ({', '.join(self.names)}): give one per table, in that order"
            )
        for name, table, ids in zip(self.names, self.tables, lookups):
            bad = (ids < 0) | (ids >= table.num_embeddings)
            if bad.any():
                raise IndexError(
                    f"sparse table {name} looked up id {int(ids[bad][0])}, out of its range: it has "
                    f"{table.num_embeddings} rows, ids 0..{table.num_embeddings - 1}"
                )
        return lookups

    def push(self) -> float:
        """Every table's gradient rows to the servers holding them, one message per server (before
        the share's commit; a row several micro-batches looked up goes once, summed); their sum
        of squares (for the global gradient norm)."""
        ids, values = [], []
        for t, blocks in enumerate(self.blocks):
            for found, block in blocks:
                if block.grad is not None:
                    ids.append(found + self.space.offsets[t])
                    values.append(block.grad)
            blocks.clear()
        if not ids:
            return 0.0
        unique, where = torch.unique(torch.cat(ids), return_inverse=True)
        grads = torch.cat(values)
        summed = torch.zeros(len(unique), grads.shape[1], dtype=grads.dtype, device=grads.device).index_add_(
            0, where, grads
        )
        for s, mine in self.space.by_server(unique):
            server = self.roles.server_rank(s)
            self.wire.send(server, Grads(int(mine.sum())).message(), unique[mine])
            self.wire.send_payload(server, self.codec.encode(summed[mine]).contiguous())
        return float(summed.double().pow(2).sum())
