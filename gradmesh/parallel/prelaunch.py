"""The registry rows' pre-launch checks (`Strategy.checks`): check(cfg, mesh, meta_model) raises
UsageError. Each imports its strategy's module only when called, so the CLI reads the registry
without importing torch."""

from gradmesh.errors import UsageError
from gradmesh.mesh import DP_AXIS, PP_AXIS, TP_AXIS


def check_tp(cfg, mesh: dict[str, int], meta_model) -> None:
    from gradmesh.parallel.tp_plans import check_tp_degree

    check_tp_degree(cfg.model.name, cfg.model.n_head, cfg.model.n_embd, mesh[TP_AXIS])


def check_pipeline(cfg, mesh: dict[str, int], meta_model) -> None:
    from gradmesh.config.workload import HF_MODELS
    from gradmesh.parallel.pipeline import check_pipeline as check

    if cfg.model.name in HF_MODELS:
        raise UsageError(
            f"pipeline parallelism cannot cut --model {cfg.model.name}: a transformers model's forward runs "
            "all of its blocks (making the attention mask and positions on the way), so no stage can run a "
            "slice of it; use ddp, zero1 or fsdp (tp too for hf:llama), or gpt-char for a pipeline"
        )
    train = cfg.train
    check(
        meta_model(),
        schedule=train.pp_schedule,
        microbatches=train.microbatches,
        split=train.split_points,
        pp=mesh[PP_AXIS],
        grad_accum=train.grad_accum,
        local_batch=train.global_batch_size // mesh.get(DP_AXIS, 1),
    )


def check_ps(cfg, mesh: dict[str, int], meta_model) -> None:
    from gradmesh.parallel.ps import check_ps as check

    check(cfg, mesh, meta_model)


def check_hybrid(cfg, mesh: dict[str, int], meta_model) -> None:
    from gradmesh.parallel.ps import check_ps as check

    check(cfg, mesh, meta_model, hybrid=True)


def check_tables(cfg, mesh: dict[str, int], meta_model) -> None:
    from gradmesh.parallel.tables import check_tables as check

    check(cfg, mesh, meta_model)
