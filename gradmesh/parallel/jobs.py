"""The plan (strategies on a named mesh) a job's configuration asks for, checked before launch:
what `gradmesh train` refuses with one line, and what the planner asks of each candidate."""

import math

from gradmesh import config as configuration
from gradmesh.config.balance import parse_balance
from gradmesh.config.compression import parse_compression
from gradmesh.config.ps import check_ps_options_need_ps
from gradmesh.errors import UsageError
from gradmesh.mesh import DATA_AXES
from gradmesh.parallel import registry


def job_plan(cfg: configuration.Config, nproc: int, world: int, meta_model) -> registry.Plan:
    """The strategy registry's checks; returns the plan (strategies on a named mesh) the workers build."""
    check_ps_options_need_ps(cfg, cfg.train.strategy, [row.name for row in registry.ROWS if row.has_servers])
    check_experience(cfg)
    mesh = registry.mesh_for(cfg.train.strategy, world, cfg.train.mesh)
    product = math.prod(mesh.values())
    if product != world:
        raise UsageError(
            f"--mesh {cfg.train.mesh!r} spans {product} ranks but the job has {world} "
            f"({nproc} per node x {cfg.launch.nnodes} nodes); make the product {world}"
        )
    cfg.check_world(math.prod(mesh.get(axis, 1) for axis in DATA_AXES))
    plan = registry.resolve(cfg.train.strategy, mesh)
    check_batch_norm(cfg, plan, meta_model)
    plan.check(cfg, meta_model)
    check_balance(cfg, plan, math.prod(mesh.get(axis, 1) for axis in DATA_AXES))
    check_table_sharding(cfg, plan)
    method = parse_compression(cfg.train.compression)[0]
    if method not in plan.compressions:
        accepted = ", ".join(plan.compressions)
        raise UsageError(
            f"--compression {cfg.train.compression} does not apply to {plan.label}; accepted with it: {accepted}"
        )
    return plan


def has_batch_norm(model) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(module, _BatchNorm) for module in model.modules())


def check_experience(cfg: configuration.Config) -> None:
    """Reinforcement-learning workloads train under the strategy whose ranks act and learn, and it
    trains nothing else; --learners means nothing to another workload (refused, not ignored)."""
    experience = registry.experience_strategy()
    learns = cfg.model.name in configuration.RL_MODELS
    if learns and cfg.train.strategy != experience:
        raise UsageError(
            f"--model {cfg.model.name} learns from its own actors' experience: it trains under --strategy "
            f"{experience} only (its default), not {cfg.train.strategy}; leave --strategy out"
        )
    if not learns and cfg.train.strategy == experience:
        raise UsageError(
            f"--strategy {experience} trains reinforcement-learning workloads ({', '.join(configuration.RL_MODELS)}), "
            f"not --model {cfg.model.name}; give --model {configuration.RL_MODELS[0]} or another strategy"
        )
    if not learns and cfg.rl.learners != configuration.RLConfig().learners and not cfg.checkpoint.resume:
        raise UsageError(
            f"--learners applies to --model {', '.join(configuration.RL_MODELS)}, not {cfg.model.name}; leave it out"
        )


def check_batch_norm(cfg: configuration.Config, plan: registry.Plan, meta_model) -> None:
    """A model with batch normalisation trains only under plans whose ranks each run the whole
    model on their share, in step (`Strategy.batch_norm`): its batch statistics span those ranks."""
    if not plan.batch_norm and has_batch_norm(meta_model()):
        accepted = [row.name for row in registry.ROWS if row.batch_norm]
        raise UsageError(
            f"--model {cfg.model.name} has batch normalisation, which trains under --strategy "
            f"{', '.join(accepted[:-1])} or {accepted[-1]} (each rank the whole model on its share, in step with "
            f"the others), not {plan.label}; use one of those"
        )


def check_table_sharding(cfg: configuration.Config, plan: registry.Plan) -> None:
    """--table-sharding means nothing to a plan that does not shard tables: refused, not ignored
    (except on --resume, where it comes from the saved config)."""
    default = configuration.TrainConfig().table_sharding
    if cfg.train.table_sharding != default and not plan.shards_tables and not cfg.checkpoint.resume:
        accepted = " or ".join(row.name for row in registry.ROWS if row.shards_tables)
        raise UsageError(
            f"--table-sharding applies to --strategy {accepted}, not {plan.label}; "
            f"leave it out or give --strategy {accepted}"
        )


def check_balance(cfg: configuration.Config, plan: registry.Plan, data_ranks: int) -> None:
    how, shares = parse_balance(cfg.train.balance)
    if how != "off" and not plan.accepts_balance:
        raise UsageError(
            f"--balance {cfg.train.balance} applies to strategies whose ranks step together (ddp, zero1, "
            f"fsdp, tp meshes), not to {plan.label} (its own shares); leave it out"
        )
    if how == "static" and len(shares) != data_ranks:
        raise UsageError(
            f"--balance {cfg.train.balance} gives {len(shares)} shares for {data_ranks} data-parallel "
            f"rank(s); give one share per rank, e.g. static:{','.join(['1'] * data_ranks)}"
        )
