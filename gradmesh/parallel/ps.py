"""Parameter servers: the parameters laid out as one flat vector, sharded over the servers by bytes.

Every parameter of the plain model, flattened in `named_parameters()` order, is one range of a
flat vector; server s holds the contiguous range `Layout.shard(s)` of it, with its optimizer
state. Shards are balanced by bytes: a tensor larger than a share is split across servers, at a
row boundary (its first dimension), so a piece of it is whole rows. Workers hold the whole flat
vector (their model's parameters are views into it) and exchange shard-sized ranges of it and
of the gradient with each server (`gradmesh.engine.ps`).

Ranks 0..W-1 are workers and W..W+S-1 servers: rank 0, which writes the run's files, is a
worker and holds the whole model, as under data parallelism.
"""

import bisect
from dataclasses import dataclass

import torch
import torch.nn as nn

from gradmesh.errors import UsageError
from gradmesh.mesh import PS_AXIS


@dataclass(frozen=True)
class Roles:
    """Who does what in a job of `world` ranks with `servers` servers."""

    world: int
    servers: int

    @property
    def workers(self) -> int:
        return self.world - self.servers

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def server_rank(self, index: int) -> int:
        return self.workers + index

    @property
    def dispatcher(self) -> int:
        """The server that hands out the shares of each global batch (the first one)."""
        return self.workers


class Layout:
    """The flat vector's ranges: one per parameter, one shard per server."""

    def __init__(self, shapes: list[tuple[int, ...]], servers: int, on_servers: bool = True):
        """on_servers False (the hybrid strategy): the workers hold the vector; every shard is empty."""
        self.shapes = [tuple(shape) for shape in shapes]
        self.numels = [_numel(shape) for shape in self.shapes]
        self.offsets = [0]
        for numel in self.numels:
            self.offsets.append(self.offsets[-1] + numel)
        self.total = self.offsets[-1]
        if not on_servers:
            self.bounds = [0] * (servers + 1)
            return
        rows = Rows(self.shapes)
        if servers > rows.count:
            raise UsageError(
                f"--ps-servers {servers}: the model has {rows.count} rows of parameters in all, so at "
                f"most {rows.count} servers can each hold a share; give --ps-servers at most {rows.count}"
            )
        self.bounds = _balanced(rows, servers)

    def shard(self, server: int) -> tuple[int, int]:
        return self.bounds[server], self.bounds[server + 1]

    def shard_numel(self, server: int) -> int:
        low, high = self.shard(server)
        return high - low

    def buckets(self, server: int, bucket_elements: int) -> list[tuple[int, int]]:
        """The server's shard cut into ranges of at most `bucket_elements`, in flat order."""
        low, high = self.shard(server)
        step = max(1, bucket_elements)
        return [(start, min(start + step, high)) for start in range(low, high, step)]

    def params_in(self, low: int, high: int) -> list[int]:
        """Indices of the parameters overlapping the flat range [low, high)."""
        first = bisect.bisect_right(self.offsets, low) - 1
        found = []
        for index in range(max(first, 0), len(self.numels)):
            if self.offsets[index] >= high:
                break
            if self.numels[index]:
                found.append(index)
        return found


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


class Rows:
    """The places a shard may begin: where a row of some parameter starts, numbered 0..count
    (count: the end of the flat vector). Computed, not listed: a table of 10^7 rows has 10^7."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        self.starts, self.widths, self.firsts = [], [], []  # per non-empty parameter
        offset, count = 0, 0
        for shape in shapes:
            numel = _numel(shape)
            if numel:
                rows = shape[0] if shape else 1
                self.starts.append(offset)
                self.widths.append(numel // rows)
                self.firsts.append(count)
                count += rows
            offset += numel
        self.count, self.total = count, offset

    def offset(self, index: int) -> int:
        """The flat offset of cut `index`."""
        if index >= self.count:
            return self.total
        j = bisect.bisect_right(self.firsts, index) - 1
        return self.starts[j] + (index - self.firsts[j]) * self.widths[j]

    def nearest(self, offset: float) -> int:
        """The index of the cut nearest to `offset`."""
        j = max(bisect.bisect_right(self.starts, offset) - 1, 0)
        rows = (self.firsts[j + 1] if j + 1 < len(self.firsts) else self.count) - self.firsts[j]
        return self.firsts[j] + min(max(round((offset - self.starts[j]) / self.widths[j]), 0), rows)


def _balanced(rows: Rows, servers: int) -> list[int]:
    """S+1 bounds at row starts, each share as near total/S elements as whole rows allow, none empty."""
    indices = [0]
    for s in range(1, servers):
        lowest = indices[-1] + 1
        highest = rows.count - (servers - s)  # leave a row for each server still to come
        indices.append(min(max(rows.nearest(rows.total * s / servers), lowest), highest))
    return [rows.offset(i) for i in indices] + [rows.total]


def sparse_tables(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """(name, module) of each embedding table the model declares sparse (`model.sparse_tables()`,
    plain model data: models do not import gradmesh); [] for a model that declares none. Those
    train row-wise (`gradmesh.optim`); under the parameter-server strategies the servers hold
    them row-sharded and workers move only the rows a batch touches. Such a model also says which
    ids each table will look up (`model.lookups(*inputs)`, one tensor per table in the declared
    order), so a worker fetches every table's rows before the forward. Never guessed from shapes:
    a dense layer may share a table's shape."""
    declared = getattr(model, "sparse_tables", None)
    if declared is None:
        return []
    names = {id(module): name for name, module in model.named_modules()}
    tables = list(declared())
    for table in tables:
        if not isinstance(table, nn.Embedding) or id(table) not in names:
            raise UsageError(
                f"{type(model).__name__}.sparse_tables() listed {type(table).__name__}, which is not "
                "one of the model's own nn.Embedding modules; list only those"
            )
    return [(names[id(table)], table) for table in tables]


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of everything but the sparse tables: the flat vector's contents."""
    tables = {id(module.weight) for _, module in sparse_tables(model)}
    return [(name, p) for name, p in model.named_parameters() if id(p) not in tables]


def table_rows(rows: int, servers: int, server: int) -> tuple[int, int]:
    """The rows [low, high) of a table of `rows` rows that server `server` holds (even ranges)."""
    return rows * server // servers, rows * (server + 1) // servers


class TableSpace:
    """Every sparse table's rows numbered in one id space (table t's row r is `offsets[t] + r`),
    so one request to a server carries the ids of every table it holds rows of. Server s holds
    rows `table_rows(rows_t, S, s)` of each table t: in the global numbering, range t * S + s of
    `starts`, which are in order."""

    def __init__(self, rows: list[int], servers: int):
        self.servers, self.offsets = servers, [0]
        for count in rows:
            self.offsets.append(self.offsets[-1] + count)
        self.starts = torch.tensor(
            [self.offsets[t] + table_rows(count, servers, s)[0] for t, count in enumerate(rows) for s in range(servers)]
        )

    def ranges(self, ids: torch.Tensor) -> torch.Tensor:
        """The range (t * S + s) each global id falls in."""
        return torch.searchsorted(self.starts, ids, right=True) - 1

    def by_server(self, ids: torch.Tensor, every: bool = False) -> list[tuple[int, torch.Tensor]]:
        """(server, mask over `ids`) for each server holding any of these global ids (`every`:
        for every server)."""
        server = self.ranges(ids) % self.servers
        return [(s, mask) for s in range(self.servers) if (mask := server == s).any() or every]


def layout_of(model: nn.Module, servers: int, on_servers: bool = True) -> Layout:
    return Layout([tuple(p.shape) for _, p in dense_parameters(model)], servers, on_servers)


def check_ps(cfg, mesh: dict[str, int], meta_model, hybrid: bool = False) -> None:
    """Before launch: servers and workers both present, shards possible, the batch splittable;
    hybrid: a model with sparse tables, and tables in sync or ssp:K mode."""
    world, servers, name = mesh[PS_AXIS], cfg.ps.servers, cfg.train.strategy
    if cfg.train.mesh:
        raise UsageError(
            f"--strategy {name} does not combine with --mesh {cfg.train.mesh!r} (its ranks are servers "
            "and workers, not mesh axes); leave --mesh out"
        )
    if not 1 <= servers < world:
        raise UsageError(
            f"--ps-servers {servers} leaves {world - servers} worker(s) of {world} ranks: give at least "
            f"one server and one worker (--ps-servers 1..{world - 1}, or more ranks with --nproc)"
        )
    workers, accum = world - servers, cfg.train.grad_accum
    if cfg.train.global_batch_size % (workers * accum):
        raise UsageError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by workers x "
            f"grad_accum = {workers} x {accum}; use a multiple of {workers * accum}"
        )
    per_worker = cfg.train.global_batch_size // workers
    if cfg.ps.shares > per_worker and cfg.ps.bound != 0 and not hybrid:  # sync and hybrid cut no shares
        raise UsageError(
            f"--ps-shares {cfg.ps.shares} cuts each worker's {per_worker} samples per step into shares of "
            f"less than one sample; give --ps-shares 1..{per_worker} (at most global_batch_size / workers)"
        )
    model = meta_model()
    if hybrid:
        _check_hybrid(cfg, model)
    for table_name, table in sparse_tables(model):
        if table.num_embeddings < servers:
            raise UsageError(
                f"--ps-servers {servers}: table {table_name} has {table.num_embeddings} rows, fewer than "
                f"the servers that share it; give --ps-servers at most {table.num_embeddings}"
            )
    layout_of(model, servers, on_servers=not hybrid)


def _check_hybrid(cfg, model: nn.Module) -> None:
    if not sparse_tables(model):
        raise UsageError(
            f"--strategy hybrid puts a model's sparse embedding tables on the servers, and --model "
            f"{cfg.model.name} has none; use it with --model recsys, or use ddp or ps"
        )
    if cfg.ps.mode == "async":
        raise UsageError(
            "--strategy hybrid keeps the dense part in step by all-reduce, so its tables train in "
            "--ps-mode sync or ssp:K, not async; give sync or ssp:K (e.g. ssp:1)"
        )


def server_ranks(cfg, world: int) -> list[int]:
    """The servers: under in-place recovery a dead worker's shares go to the others, but a dead
    server's shard is gone, so its loss restarts every rank from the last checkpoint."""
    roles = Roles(world, cfg.ps.servers)
    return [roles.server_rank(s) for s in range(cfg.ps.servers)]


def apply_ps(model: nn.Module, topology, options) -> nn.Module:
    """Every rank keeps the plain model on its device: workers train it, servers mirror it for
    evaluation and checkpoints (`gradmesh.engine.ps`)."""
    return to_device(model, topology.device)


def to_device(model: nn.Module, device) -> nn.Module:
    """`model.to(device)`, leaving tensors on the meta device there (sparse tables the servers
    make and hold: no rank allocates them whole)."""
    return model._apply(lambda t: t if t.is_meta else t.to(device))
