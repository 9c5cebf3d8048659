"""Sparse tables sharded by rows over every rank, the dense network data-parallel (`--strategy
tables`): the embedding model parallelism of DLRM and TorchRec, on torch's own parts.

Each table the model declares sparse (`model.sparse_tables()`) is split into even row ranges over
the data axis (torch.chunk's split: rank r holds rows [r c, (r + 1) c), c = ceil(rows / ranks)),
or, with --table-sharding table, kept whole on one rank placed by size
(`gradmesh.parallel.table_layout`), each rank making its own rows (`model.init_rows`). Row-wise
the weight is a DTensor sharded on its rows, as FSDP2 keeps a parameter: checkpoints hold it
under its parameter name and DCP reshards it to and from every other strategy; the final export
and `full_state` gather it. Table-wise the state dict shows the same DTensor, made from the
owner's table when asked (`gradmesh.parallel.table_state`).

A step: one exchange serves every table (`gradmesh.comm.exchange`: every rank's lookups are
known from every rank's share, which the engine shows before each micro-batch
(`show_every_share`), so only the rows travel). The rows set off as the model's forward begins
and travel while the layers before the first table run; at the first table's call they are
taken in, and each table module returns its part of them. Backward sends the rows' gradients to
their owners without waiting for them (the layers below go on). At the optimizer step an owner
sums them per distinct row and applies row-wise Adagrad to those rows alone
(`gradmesh.parallel.table_rows`) — what one process does with the dense table gradient, where
an untouched row neither moves nor adds to its accumulator — so a step costs the rows its batch
touched, whatever the tables' size. The dense layers train as under ddp (DDP through gradmesh's
reducer), and a global clip counts the tables' rows (`grad_norm_sq`, `scale_grads`).
"""

import functools
from typing import cast

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradmesh.comm import hooks
from gradmesh.comm.exchange import Fetch, InFlight, Link, Routed, Router, RowGradients, all_reduce_sum, answer
from gradmesh.errors import UsageError
from gradmesh.mesh import DP_AXIS
from gradmesh.parallel.data import apply_ddp
from gradmesh.parallel.options import ApplyOptions
from gradmesh.parallel.ps import sparse_tables
from gradmesh.parallel.sparse import SparseModel
from gradmesh.parallel.state import install_optimizer_state, named_optimizer_state
from gradmesh.parallel.table_layout import layout_for
from gradmesh.parallel.table_rows import TableRows
from gradmesh.parallel.table_state import TableWiseState
from gradmesh.topology import Topology

ATTRIBUTE = "_gradmesh_tables"
"""Where a model (and each of its table weights) keeps its `ShardedTables`."""


class ShardedTables:
    """This rank's row ranges of a model's sparse tables, the exchange, the pending gradients."""

    def __init__(self, model: nn.Module, topology: Topology, options: ApplyOptions):
        named = sparse_tables(model)
        self.tables = [table for _, table in named]
        self.group, self.ranks, self.me = topology.group(DP_AXIS), topology.dp_size, topology.dp_rank
        rows = [table.num_embeddings for table in self.tables]
        self.layout = layout_for(options.table_sharding, rows, self.ranks, self.me)
        self.rows = torch.tensor(rows, device=topology.device)
        self.pending = RowGradients(self.tables[0].embedding_dim)
        self.link = Link(self.group, self.me, options.counter)
        self.router = Router(self.layout.placement(topology.device), self.ranks, self.link)
        self.anchor = torch.zeros((), requires_grad=True)
        self.args: tuple = ()
        self.outputs: list[torch.Tensor] = []
        self.carried: torch.Tensor | None = None
        self.shares: list | None = None
        self.arriving: tuple[int, Routed, InFlight] | None = None
        assert topology.mesh is not None  # a started topology has its mesh
        mesh = topology.mesh[DP_AXIS]
        self.storage = TableRows(self.tables, self.layout, mesh, topology.device)
        for index, (table, (low, high)) in enumerate(zip(self.tables, self.layout.ranges)):
            if table.weight.is_meta:
                self.storage.place(index, cast(SparseModel, model).init_rows(index, low, high))
            else:
                self.storage.place(index, table.weight.detach()[low:high])
            # Sharding as data: the module's forward reads the exchange's answer for its index.
            table.forward = functools.partial(self._output, index)  # type: ignore[method-assign]
        self.table_wise: TableWiseState | None = None
        if not self.storage.sharded:  # checkpoints and the export see row-wise DTensors
            names = [f"{name}.weight" for name, _ in named]
            self.table_wise = TableWiseState(self.tables, names, self.storage, self.layout, self.group, mesh)
            self.table_wise.install()
        model.register_forward_pre_hook(self._before_forward)
        setattr(model, ATTRIBUTE, self)

    def tag(self) -> None:
        """Mark the table weights as this object's, for the optimizer to find: after any `.to()`,
        which gives a DTensor parameter a new object."""
        for table in self.tables:
            setattr(table.weight, ATTRIBUTE, self)

    def _before_forward(self, model: nn.Module, args: tuple) -> None:
        self.model, self.args, self.outputs = cast(SparseModel, model), args, []
        # Training shows every share first (`show_every_share`): the route needs no collective,
        # so the rows set off now and travel while the layers before the first table run.
        self.arriving = self._send() if self.shares is not None else None

    def _send(self) -> tuple[int, Routed, InFlight]:
        """(samples, route, the owners' answer under way) of this forward's lookups."""
        ids = self._ids(self.args)
        routed = self._known_route(ids) if self.shares is not None else None
        self.shares = None
        if routed is None:
            routed = self.router.route(ids)
        with torch.no_grad():
            served = self.storage.serve(routed.keys)
        return ids.shape[1], routed, answer(served, routed, self.link)

    def _exchange(self) -> None:
        """On the first table's call, not before the forward: the exchange's node in the autograd
        graph then comes after the layers the model ran first (the bottom MLP), so backward
        reaches it — and the rows' gradients their owners — before the dense gradients are
        complete, and the tables' squared norm can travel with DDP's last bucket (`ask`)."""
        samples, routed, arriving = self.arriving or self._send()
        self.arriving = None
        if torch.is_grad_enabled():  # a backward will bring this exchange's gradients
            self.pending.expect()
        rows = Fetch.apply(self.anchor, arriving.wait(), routed, self.link, self.pending)
        self.outputs = list(rows.view(len(self.tables), samples, -1).unbind(0))

    def _ids(self, args: tuple, check: bool = True) -> torch.Tensor:
        ids = torch.stack([ids.reshape(-1) for ids in self.model.lookups(*args)]).to(self.rows.device)
        if check:
            self._check_ids(ids)
        return ids

    def _known_route(self, ids: torch.Tensor) -> Routed | None:
        """Every rank's lookups from every rank's inputs (`show_every_share`), where this forward's
        inputs are found among this rank's (by identity: the same on every rank)."""
        assert self.shares is not None
        mine = self.shares[self.me]
        places = [next((k for k, item in enumerate(mine) if item is arg), None) for arg in self.args]
        if None in places:
            return None
        everyone = [
            ids if r == self.me else self._ids(tuple(share[k] for k in places), check=False)
            for r, share in enumerate(self.shares)  # a bad id fails on the rank whose batch holds it
        ]
        return self.router.known(everyone, self.me)

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Here, not on the owner: a bad id must fail on the rank whose batch holds it."""
        if not ids.numel():
            return
        bad = ((ids.min(dim=1).values < 0) | (ids.max(dim=1).values >= self.rows)).nonzero()
        if len(bad):
            table = int(bad[0])
            raise ValueError(f"table {table} looked up an id outside [0, {int(self.rows[table])})")

    def _output(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        if not self.outputs:
            self._exchange()
        found = self.outputs[index]
        return found.view(*ids.shape, found.shape[-1])

    # -- the optimizer step's side -------------------------------------------------------------

    def summed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's distinct touched rows (as keys) and their gradient. Every rank's loss is
        weighted so that the average over ranks is the batch's gradient (as DDP averages)."""
        return self.pending.summed(1.0 / self.ranks)

    def _local_norm_sq(self) -> torch.Tensor:
        return self.summed()[1].double().pow(2).sum().to(self.rows.device)

    def grad_norm_sq(self) -> torch.Tensor:
        """Collective unless DDP's last bucket carried it: the squared norm of the tables'
        gradients, every rank's rows."""
        if self.carried is not None:
            return self.carried
        return all_reduce_sum(self._local_norm_sq(), self.group)

    def ask(self) -> torch.Tensor | None:
        """DDP's last bucket asks (`gradmesh.comm.hooks.Rider`): every exchange of this step has
        had its backward (the same on every rank: the same model, the same autograd order)."""
        return self._local_norm_sq().reshape(1) if self.pending.complete() else None

    def take(self, summed: torch.Tensor) -> None:
        self.carried = summed.reshape(())

    def scale_grads(self, coef: float) -> None:
        self.summed()[1].mul_(coef)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Row-wise Adagrad on the touched rows (`TableRows.step`)."""
        self.storage.step(optimizer, *self.summed())
        self.clear()

    def clear(self) -> None:
        self.pending.clear()
        self.carried = None


def holders(model: nn.Module) -> list[ShardedTables]:
    """The `ShardedTables` of a model (wrapped or not)."""
    return [found for module in model.modules() if (found := module.__dict__.get(ATTRIBUTE)) is not None]


def apply_tables(model: nn.Module, topology: Topology, options: ApplyOptions) -> nn.Module:
    """The tables row-sharded over the data axis, the rest wrapped in DDP (which leaves the tables
    alone: their rows travel by the exchange)."""
    tables = ShardedTables(model, topology, options)
    names = [f"{name}.weight" for name, _ in sparse_tables(model)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    wrapped = apply_ddp(model, topology, options)
    tables.tag()
    state = hooks.state_of(wrapped)
    if state is not None and options.compression == "none":  # a compressed bucket would not keep the norm
        state.rider = tables
    return wrapped


def tables_optimizer_state(model: nn.Module, optimizer, for_load: bool = False) -> dict:
    """The optimizer state by parameter name, table-wise accumulators made row-wise (`TableWiseState`)."""
    state = named_optimizer_state(model, optimizer, for_load)
    for tables in holders(model):
        if tables.table_wise is not None:
            tables.table_wise.saved_sums(state["state"])
    return state


def install_tables_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    for tables in holders(model):
        if tables.table_wise is not None:
            tables.table_wise.loaded_sums(state["state"])
    install_optimizer_state(model, optimizer, state)


def show_every_share(model: nn.Module, everyone: list, me: int) -> None:
    """Before a micro-batch (`Strategy.every_share`): every rank's inputs, kept for its forward."""
    for tables in holders(model):
        tables.shares = everyone


def tables_optimizer(params, topology: Topology, optimizer_class, **kwargs) -> torch.optim.Optimizer:
    """`optimizer_class` (the workload's row-wise tables beside torch's own) whose step first
    applies the sharded tables' touched rows, and whose zero_grad drops their pending gradients."""

    # A base class chosen at run time: mypy cannot type a class over a variable base.
    class ShardedRows(optimizer_class):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            # Found once, by the mark `ShardedTables.tag` left on the weights: a later `.to()` of
            # the module swaps a DTensor parameter's contents, its attributes with them.
            found = {id(t): t for g in self.param_groups for p in g["params"] if (t := getattr(p, ATTRIBUTE, None))}
            self.sharded = list(found.values())

        @torch.no_grad()
        def step(self, closure=None):
            for tables in self.sharded:
                tables.step(self)
            return super().step(closure)

        def zero_grad(self, set_to_none: bool = True) -> None:
            super().zero_grad(set_to_none)
            for tables in getattr(self, "sharded", ()):  # torch's constructor may zero before ours ran
                tables.clear()

    ShardedRows.__name__ = ShardedRows.__qualname__ = f"ShardedRows{optimizer_class.__name__}"
    return ShardedRows(params, **kwargs)


def check_tables(cfg, mesh: dict[str, int], meta_model) -> None:
    tables = sparse_tables(meta_model())
    if not tables:
        raise UsageError(
            f"--strategy tables shards a model's sparse embedding tables, and --model {cfg.model.name} declares none; "
            "use it with --model recsys, or choose ddp, zero1 or fsdp"
        )
    dims = sorted({table.embedding_dim for _, table in tables})
    if len(dims) > 1:  # one tensor holds every table's rows (gradmesh.parallel.table_rows)
        raise UsageError(f"--strategy tables needs sparse tables of one width; this model's are {dims} wide")
