"""The strategy registry: one row per strategy, read by everything that needs to know one.

A row says which mesh axis the strategy spreads over, which roles its ranks play, which step
engine runs it, how it is applied to a plain model (functions named "module:function" and
imported on first use, so the CLI reads the table without importing torch), what it checks
before launch, and its formulas for model-state bytes and bytes on the wire per rank and step.
The CLI, the composition, checkpoints, monitoring and the planner ask the registry; nothing
else compares strategy, engine-family or role names: code elsewhere asks a row's or a `Plan`'s
capabilities (`runs_lockstep`, `accepts_balance`, `has_servers`, `inplace_recovery`,
`compressions`, ...), which are decided here (tests/test_architecture.py).

A mesh of several axes resolves to a `Plan`: the rows of its axes in the fixed composition
order (tensor parallel, then the pipeline split, then data parallelism or sharding).

Adding a strategy: write its apply function (and engine, if no existing family fits), add a
row here, and the CLI, checks, checkpoints and formulas pick it up.
"""

from typing import Any

from gradmesh.errors import UsageError
from gradmesh.mesh import DATA_AXES, parse_mesh
from gradmesh.parallel.actor_learner import check_actor_learner
from gradmesh.parallel.plans import Plan
from gradmesh.parallel.prelaunch import check_hybrid, check_pipeline, check_ps, check_tables, check_tp
from gradmesh.parallel.strategy import (
    ACTOR_ROLE,
    FP32,
    LEARNER_ROLE,
    SERVER_ROLE,
    WORKER_ROLE,
    ModelSize,
    Strategy,
    _all_bytes,
    _ring,
    _tables_state,
    _tp_state,
    load,
)

PS_ENGINE_KEEPS_ITS_OWN_STATE: dict[str, Any] = dict(
    sync=None, optimizer=None, optimizer_state=None, load_optimizer_state=None
)
"""The parameter-server engine synchronises gradients and holds optimizer state its own way
(`gradmesh.engine.ps`): the collective families' functions do not apply to its rows."""

ROWS = (
    Strategy(
        "ddp",
        "dp",
        "collective",
        "gradmesh.parallel.data:apply_ddp",
        "data parallel: replicas, gradients averaged by all-reduce (torch DDP)",
        state_bytes=lambda size, n: _all_bytes(size),
        wire_bytes=lambda size, n: 2 * _ring(n) * FP32 * size.params,
        cost="gradmesh.plan.costs:ddp",
        beside_model_parallel=("gradmesh.parallel.data:apply_local", "gradmesh.parallel.data:flat_average_sync"),
        replicated=True,
        inplace_recovery=True,
        batch_norm=True,
    ),
    Strategy(
        "zero1",
        "dp",
        "collective",
        "gradmesh.parallel.data:apply_ddp",
        "ZeRO-1: data parallel with the optimizer state sharded (ZeroRedundancyOptimizer)",
        state_bytes=lambda size, n: FP32 * size.params * (2 + size.slots / n),
        wire_bytes=lambda size, n: 3 * _ring(n) * FP32 * size.params,
        cost="gradmesh.plan.costs:zero1",
        optimizer="gradmesh.parallel.sharded:zero1_optimizer",
        optimizer_state="gradmesh.parallel.sharded:zero1_state",
        load_optimizer_state="gradmesh.parallel.sharded:zero1_loaded",
        replicated=True,
        batch_norm=True,
    ),
    Strategy(
        "fsdp",
        "fsdp",
        "collective",
        "gradmesh.parallel.sharded:apply_fsdp",
        "fully sharded: parameters, gradients and optimizer state split (FSDP2)",
        state_bytes=lambda size, n: _all_bytes(size) / n,
        wire_bytes=lambda size, n: 3 * _ring(n) * FP32 * size.params,
        cost="gradmesh.plan.costs:fsdp",
        sync="gradmesh.parallel.sharded:fsdp_sync",
        casts_only=True,
        collective_forward=True,
        batch_norm=True,
    ),
    Strategy(
        "tp",
        "tp",
        "collective",
        "gradmesh.parallel.tensor:apply_tp",
        "tensor parallel: attention heads and MLP columns split (DTensor plans)",
        state_bytes=_tp_state,
        wire_bytes=lambda size, n: 4 * size.layers * 2 * _ring(n) * size.activation_bytes,
        cost="gradmesh.plan.costs:tp",
        sync="gradmesh.parallel.data:no_sync",
        checks=(check_tp,),
        collective_forward=True,
        splits_model=True,
    ),
    Strategy(
        "pipeline",
        "pp",
        "pipeline",
        "gradmesh.parallel.pipeline:apply_pipeline",
        "pipeline parallel: stages of layers, micro-batches in flight (gpipe, 1f1b, interleaved)",
        state_bytes=lambda size, n: _all_bytes(size) / n,
        wire_bytes=lambda size, n: 2 * _ring(n) * size.activation_bytes,
        cost="gradmesh.plan.costs:pipeline",
        sync="gradmesh.parallel.data:no_sync",
        checks=(check_pipeline,),
        splits_model=True,
        same_work=False,
    ),
    # Workers hold the whole model and its gradient; a server holds its shard with the optimizer
    # state (state_bytes is a worker's, the larger at S >= 1). Each worker pushes its gradient
    # and pulls the parameters once per step: 2 x 4P bytes, whatever the number of servers.
    Strategy(
        "ps",
        "ps",
        "ps",
        "gradmesh.parallel.ps:apply_ps",
        "parameter servers: servers hold the parameters sharded, workers push gradients and pull "
        "parameters (sync, async, ssp:K)",
        state_bytes=lambda size, n: FP32 * size.params * 2,
        wire_bytes=lambda size, n: 2 * FP32 * size.params,
        cost="gradmesh.plan.costs:ps",
        roles=(WORKER_ROLE, SERVER_ROLE),
        **PS_ENGINE_KEEPS_ITS_OWN_STATE,
        checks=(check_ps,),
        same_work=False,
        step_breakdown=False,
        inplace_recovery=True,
        critical="gradmesh.parallel.ps:server_ranks",
    ),
    # The dense part as ddp keeps it, among the W workers; the tables' rows move as under ps
    # (counted apart, per row touched). In-place recovery would have to regroup the workers'
    # all-reduce mid-segment: a lost rank restarts the job from the last checkpoint instead.
    Strategy(
        "hybrid",
        "ps",
        "ps",
        "gradmesh.parallel.ps:apply_ps",
        "hybrid: sparse tables on parameter servers (sync or ssp:K), the dense network all-reduced among the workers",
        state_bytes=lambda size, n: _all_bytes(size),
        wire_bytes=lambda size, n: FP32 * size.params,
        cost="gradmesh.plan.costs:hybrid",
        roles=(WORKER_ROLE, SERVER_ROLE),
        **PS_ENGINE_KEEPS_ITS_OWN_STATE,
        checks=(check_hybrid,),
        same_work=False,
        step_breakdown=False,
        dense_on_workers=True,
    ),
    # Every rank holds 1/N of each sparse table's rows and the whole dense part: the lookups'
    # rows and their gradients cross by all-to-all (per row touched, counted by the cost model),
    # the dense gradients by DDP's all-reduce.
    Strategy(
        "tables",
        "dp",
        "collective",
        "gradmesh.parallel.tables:apply_tables",
        "sparse tables sharded by rows over every rank, or each whole on one (--table-sharding), the lookups' rows "
        "exchanged by all-to-all, the dense network data parallel",
        state_bytes=_tables_state,
        wire_bytes=lambda size, n: 2 * _ring(n) * FP32 * (size.params - size.table_params),
        cost="gradmesh.plan.costs:tables",
        optimizer="gradmesh.parallel.tables:tables_optimizer",
        optimizer_state="gradmesh.parallel.tables:tables_optimizer_state",
        load_optimizer_state="gradmesh.parallel.tables:install_tables_optimizer_state",
        every_share="gradmesh.parallel.tables:show_every_share",
        checks=(check_tables,),
        shards_tables=True,
    ),
    # Reinforcement learning's actor-learner shape (IMPALA): actors act with the weights they last
    # pulled and send trajectories, learners train on them with V-trace and all-reduce among
    # themselves. A learner holds the model, its gradient and the optimizer state; the wire carries
    # a pull of the weights every K trajectories (trajectories' bytes depend on the environment).
    # A lost actor is dropped in place; a lost learner restarts every rank from the last checkpoint.
    Strategy(
        "impala",
        "ps",
        "actor-learner",
        "gradmesh.parallel.actor_learner:apply_actor_learner",
        "actor-learner reinforcement learning (IMPALA, V-trace): actors act and send trajectories, learners train "
        "(rl-cartpole)",
        state_bytes=lambda size, n: _all_bytes(size),
        wire_bytes=lambda size, n: FP32 * size.params,
        roles=(LEARNER_ROLE, ACTOR_ROLE),
        **PS_ENGINE_KEEPS_ITS_OWN_STATE,
        checks=(check_actor_learner,),
        same_work=False,
        step_breakdown=False,
        inplace_recovery=True,
        critical="gradmesh.parallel.actor_learner:learner_ranks",
        experience=True,
    ),
)
STRATEGIES = {row.name: row for row in ROWS}


def experience_strategy() -> str:
    """The strategy of the workloads that train on their own actors' experience (`Strategy.experience`)."""
    return next(row.name for row in ROWS if row.experience)


def critical_ranks(cfg, world: int) -> frozenset[int]:
    """Ranks of `cfg`'s strategy that in-place recovery cannot do without (`Strategy.critical`)."""
    row = STRATEGIES.get(cfg.train.strategy)
    return frozenset(load(row.critical)(cfg, world)) if row and row.critical else frozenset()


AXIS_STRATEGY = {"dp": "ddp", "fsdp": "fsdp", "tp": "tp", "pp": "pipeline", "ps": "ps"}
"""The strategy each mesh axis stands for when several axes compose."""
COMPOSITION_ORDER = ("tp", "pp", "fsdp", "dp")
"""Tensor parallel rewrites modules, the pipeline cuts the rewritten model, data parallelism or
sharding then spreads whatever each rank holds."""
SUPPORTED_MESHES = tuple(
    frozenset(axes) for axes in ({"dp"}, {"fsdp"}, {"tp"}, {"pp"}, {"dp", "tp"}, {"fsdp", "tp"}, {"dp", "pp"})
)


def get(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise UsageError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def mesh_for(name: str, world_size: int, mesh: str = "") -> dict[str, int]:
    """The named mesh: `--mesh` when given, else the strategy's own axis over every rank."""
    return parse_mesh(mesh, SUPPORTED_MESHES) if mesh else {get(name).axis: world_size}


def resolve(name: str, mesh: dict[str, int]) -> Plan:
    """The strategy named, or the composition its mesh describes (several axes)."""
    row = get(name)
    if set(mesh) == {row.axis}:
        return Plan(row.name, dict(mesh), (row,))
    if len(mesh) == 1 and set(mesh) <= set(DATA_AXES) and not row.splits_model:
        # One data axis (a session's default mesh): the strategy named runs alone over its ranks;
        # fsdp and ps named on it had run as ddp.
        return Plan(row.name, {row.axis: sum(mesh.values())}, (row,))
    if row.axis not in COMPOSITION_ORDER:
        raise UsageError(
            f"--strategy {name} does not combine with other mesh axes ({', '.join(mesh)}); leave --mesh out"
        )
    rows = tuple(STRATEGIES[AXIS_STRATEGY[axis]] for axis in COMPOSITION_ORDER if axis in mesh)
    label = rows[0].name if len(rows) == 1 else ",".join(f"{axis}={size}" for axis, size in mesh.items())
    return Plan(label, dict(mesh), rows)


__all__ = [
    "ROWS",
    "STRATEGIES",
    "ModelSize",
    "Plan",
    "Strategy",
    "experience_strategy",
    "get",
    "load",
    "mesh_for",
    "resolve",
]
