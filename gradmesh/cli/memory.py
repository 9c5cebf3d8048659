"""Before launch: does the model's state fit where it will live?

The strategy registry's `state_bytes` formulas (parameters, gradients and optimizer state, fp32)
applied to the configured model on the meta device — counted, never allocated — give each
rank's share; on CPU the machine's ranks share its memory, on CUDA each rank has a GPU. A model
far too large otherwise fails minutes later as an out-of-memory kill with no message at all.
Activations and framework overhead come on top, so passing this check is no promise to fit.
"""

from gradmesh import config as configuration
from gradmesh.errors import UsageError
from gradmesh.parallel import registry

GIB = 2**30
SIZE_KEYS = {
    **dict.fromkeys(configuration.TEXT_MODELS, "model.n_layer, model.n_embd"),
    "mlp-digits": "model.hidden",
    "recsys": "model.rows, model.dim",
    "resnet": "model.width",
}


SLOTS_BOUND = 4
"""More state tensors per parameter than any optimizer `train.optimizer` names keeps (AdamW: 2)."""


def model_size(cfg: configuration.Config, model, slots: int | None = None) -> registry.ModelSize:
    """What the registry's formulas need to know of the configured model and optimizer; `slots`:
    the optimizer's state tensors per parameter where already known (else asked of it)."""
    from gradmesh.optim import optimizer_slots, optimizer_spec
    from gradmesh.parallel.tp_plans import tp_parameter_count

    if slots is None:
        slots = optimizer_slots(*optimizer_spec(cfg.train))
    from gradmesh.parallel.placement import whole_tables
    from gradmesh.parallel.ps import sparse_tables

    tables = [table for _, table in sparse_tables(model)]
    return registry.ModelSize(
        params=sum(p.numel() for p in model.parameters()),
        slots=slots,
        tp_params=tp_parameter_count(model),
        table_params=sum(table.weight.numel() for table in tables),
        whole_tables=whole_tables(cfg, tables),
    )


def memory_room(cfg: configuration.Config, nproc: int, device: str) -> tuple[float | None, int, str]:
    """(bytes the model state may take, ranks sharing them, where that figure comes from); None
    where the system does not say. `launch.memory_per_rank_mb` overrides what the system says."""
    from gradmesh.topology import memory_bytes

    budget = cfg.launch.memory_per_rank_mb
    if budget:
        return budget * 2**20, 1, f"launch.memory_per_rank_mb gives each rank {budget / 1024:.1f} GiB"
    have = memory_bytes(device)
    if have is None or device == "cuda":
        return have, 1, f"each GPU has {(have or 0) / GIB:.1f} GiB"
    return have, nproc, f"this machine has {have / GIB:.1f} GiB"


def check_memory(cfg: configuration.Config, plan: registry.Plan, meta_model, nproc: int, device: str) -> None:
    """UsageError when the estimated model state exceeds the memory it will live in."""
    from gradmesh.topology import memory_bytes

    _check_data(cfg, nproc, memory_bytes("cpu"))
    have, sharing, where = memory_room(cfg, nproc, device)
    if have is None:
        return
    model = meta_model()
    # The bound first: asking the optimizer its slots steps it once, and torch's first optimizer
    # step imports its compiler (about a second), which a launch that clearly fits need not wait for.
    if plan.state_bytes(model_size(cfg, model, slots=SLOTS_BOUND)) * sharing <= have:
        return
    size = model_size(cfg, model)
    need = plan.state_bytes(size) * sharing
    if need <= have:
        return
    advice = [
        f"a smaller model ({SIZE_KEYS[cfg.model.name]})",
        *_sharded(size, nproc * cfg.launch.nnodes, sharing, need),
        "more machines (--nnodes)",
    ]
    raise UsageError(
        f"the model does not fit: its {size.params:,} parameters need ~{need / GIB:.1f} GiB of parameters, gradients "
        f"and {cfg.train.optimizer} state ({plan.label}, {sharing} rank(s) sharing the memory) but {where}; use "
        + ", ".join(advice[:-1])
        + f" or {advice[-1]}"
    )


def _sharded(size: registry.ModelSize, world: int, sharing: int, need: float) -> list[str]:
    """The advice to shard, when the registry has a strategy that holds clearly less per rank."""
    lightest = min(registry.ROWS, key=lambda row: row.state_bytes(size, world))
    lighter = lightest.state_bytes(size, world) * sharing
    return [f"--strategy {lightest.name} (~{lighter / GIB:.1f} GiB)"] if lighter < 0.9 * need else []


def _check_data(cfg: configuration.Config, nproc: int, have: int | None) -> None:
    """Every local rank generates and holds the whole synthetic data set (recsys, resnet)."""
    from gradmesh import workloads

    need = workloads.data_bytes(cfg) * nproc
    if have is None or need <= have / 2:  # the model, torch and the generation's temporaries need the rest
        return
    raise UsageError(
        f"model.samples={cfg.model.samples:,}: the {cfg.model.name} data takes ~{need / GIB:.1f} GiB on {nproc} "
        f"rank(s) (each holds all of it) but this machine has {have / GIB:.1f} GiB; use at most "
        f"model.samples={int(cfg.model.samples * have / 2 / need):,}"
    )
