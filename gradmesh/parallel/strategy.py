"""What a registry row is (`Strategy`) and what its formulas read (`ModelSize`): the model-state and
wire-bytes formulas' shared parts live here, the rows themselves in `gradmesh.parallel.registry`."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from gradmesh.parallel.placement import largest_share

FP32 = 4
WORKER_ROLE, SERVER_ROLE = "worker", "server"
"""The roles a rank plays: every strategy's ranks are workers; parameter servers add servers."""
LEARNER_ROLE, ACTOR_ROLE = "learner", "actor"
"""The actor-learner strategy's roles: learners train, actors make the experience they train on."""


@dataclass(frozen=True)
class ModelSize:
    """What the formulas need to know of a model and its step, per data-parallel replica."""

    params: int
    """P: parameter count."""
    slots: int = 2
    """Optimizer state tensors per parameter (AdamW 2, SGD with momentum 1, plain SGD 0)."""
    tp_params: int = 0
    """Parameters the tensor-parallel plan splits (the rest is replicated)."""
    layers: int = 1
    """Transformer blocks (tensor parallel all-reduces activations in each)."""
    activation_bytes: int = 0
    """Bytes of one block-boundary activation of this replica's share of a global batch."""
    table_params: int = 0
    """Parameters in sparse embedding tables (they train row-wise: one accumulator per row)."""
    whole_tables: tuple[int, ...] = ()
    """Parameters of each sparse table where each is held whole by one rank (`--table-sharding
    table`: the rank the placement loads most counts); empty: their rows split evenly."""


def _ring(n: int) -> float:
    """The share of a buffer each rank sends in a ring reduce-scatter or all-gather."""
    return (n - 1) / n


def _all_bytes(size: ModelSize) -> float:
    return FP32 * size.params * (2 + size.slots)


@dataclass(frozen=True)
class Strategy:
    name: str
    axis: str
    """The mesh axis it spreads over when it runs alone."""
    engine: str
    """Step engine family (`gradmesh.engine.ENGINES`): collective, pipeline or ps."""
    apply: str
    """(model, topology, options) -> model: this strategy applied to a plain model."""
    summary: str
    """One line for --help and the docs."""
    state_bytes: Callable[[ModelSize, int], float]
    """Bytes of parameters, gradients and optimizer state one rank holds at degree N (fp32)."""
    wire_bytes: Callable[[ModelSize, int], float]
    """Bytes one rank sends per optimizer step at degree N (ring collectives)."""
    cost: str | None = None
    """(Step, ranks) -> None: what this strategy adds to one rank's optimizer step, in seconds, and
    how it reshapes the step for the rows after it (`gradmesh.plan.costs`); read by the planner."""
    roles: tuple[str, ...] = (WORKER_ROLE,)
    sync: str | None = "gradmesh.parallel.data:ddp_sync"
    """(model, last_micro_batch) -> context around one micro-batch's backward. This and the three
    optimizer functions below are what the collective and pipeline engines call; None for a family
    (ps) whose engine keeps its gradients and optimizer state its own way."""
    optimizer: str | None = "gradmesh.parallel.state:plain_optimizer"
    """(params, topology, optimizer_class, **kwargs) -> optimizer."""
    optimizer_state: str | None = "gradmesh.parallel.state:named_optimizer_state"
    """(model, optimizer, for_load) -> {"state": {parameter name: {name: tensor}}} for checkpoints."""
    load_optimizer_state: str | None = "gradmesh.parallel.state:install_optimizer_state"
    checks: tuple[Callable, ...] = ()
    """Pre-launch checks: check(cfg, mesh, meta_model) raises UsageError."""
    splits_model: bool = False
    """Each rank holds a different part of the model (tensor or pipeline parallel)."""
    beside_model_parallel: tuple[str, str] | None = None
    """(apply, sync) used instead when the mesh also splits the model (DDP takes no DTensor or stage)."""
    replicated: bool = False
    """Every rank holds identical parameters: the replica check applies."""
    same_work: bool = True
    """Every rank does the same work per step, so a slow one is a straggler."""
    inplace_recovery: bool = False
    """A lost rank holds nothing the others lack: survivors can go on in place."""
    critical: str | None = None
    """(cfg, world) -> ranks whose loss the survivors cannot absorb in place (a parameter
    server's shard): under in-place recovery every rank then restarts from the last checkpoint."""
    step_breakdown: bool = True
    """The monitor's per-phase step breakdown applies (its ranks step together)."""
    casts_only: bool = False
    """Its gradients are reduced outside the job's reducer (FSDP2 reduce-scatters them at its
    reduce dtype), so of the --compression methods its engine family takes (the compressor
    registry, `gradmesh.config.compression`) only a plain cast applies."""
    collective_forward: bool = False
    """Every micro-batch's forward or backward is a collective (FSDP's gathers, tensor parallel's
    all-reduces): every rank must run as many micro-batches, also where an epoch's short last
    batch leaves a rank fewer (the collective engine pads with micro-batches at weight 0)."""
    every_share: str | None = None
    """(model, every data-parallel rank's inputs of the coming micro-batch, this rank's index):
    the global order lets every rank read every share of a batch, and a strategy that asks is
    shown them before each micro-batch (the collective engine's ranks then run as many
    micro-batches each). `tables`: each owner knows which of its rows every rank will look up,
    with no exchange of ids."""
    batch_norm: bool = False
    """Models with batch normalisation train under it: each rank runs the whole model on its own
    share of every micro-batch, in step with the others, so their batch statistics are taken over
    all those ranks together (`gradmesh.parallel.batchnorm`)."""
    shards_tables: bool = False
    """The model's sparse tables are split by rows over the ranks, each making its own rows
    (`model.init_rows`): the workload keeps its whole tables on the meta device."""
    experience: bool = False
    """Its ranks train on experience their own actors make (reinforcement learning), not on a
    dataset's global batches: the strategy of the workloads that do so, and of no other."""
    dense_on_workers: bool = False
    """Parameter-server family: the dense parameters are replicated on the workers and averaged
    among them by all-reduce; the servers hold only the sparse tables (hybrid)."""

    @property
    def has_servers(self) -> bool:
        """Some ranks serve parameters instead of training: the model's sparse tables live on them
        (`remote_tables`), and the --ps options apply."""
        return SERVER_ROLE in self.roles


def load(ref: str | None) -> Callable:
    """'module:function' -> the function (imported on first use)."""
    if ref is None:
        raise ValueError("this strategy's engine keeps its own state: it has no such function")
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _tables_state(size: ModelSize, n: int) -> float:
    """The dense part as ddp holds it; 1/N of the tables' rows, or table-wise the most whole tables
    one rank holds (`placement.largest_share`; their gradients are the touched rows', their
    row-wise state a column: both left out)."""
    tables = largest_share(list(size.whole_tables), n) if size.whole_tables else size.table_params / n
    return FP32 * ((size.params - size.table_params) * (2 + size.slots) + tables)


def _tp_state(size: ModelSize, n: int) -> float:
    return FP32 * (2 + size.slots) * (size.params - size.tp_params + size.tp_params / n)
