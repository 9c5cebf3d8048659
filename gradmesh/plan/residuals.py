"""What a step at N workers costs beyond the parts predicted from one worker and the link: short
runs of each strategy on this machine's worker count (`gradmesh.plan.overhead.trial_step`), each
set beside its prediction; the differences are kept in the calibration and added where a plan
has what they measured (`gradmesh.plan.predict`).
"""

import dataclasses
from typing import cast

from gradmesh import config as configuration
from gradmesh.parallel import registry
from gradmesh.plan import costs
from gradmesh.plan.calibration import Calibration
from gradmesh.plan.candidates import COMPRESSIONS, Candidate
from gradmesh.plan.overhead import runnable, trial_step
from gradmesh.plan.predict import Inputs, Machine, Prediction, predict, wire_of


def server_machinery(cfg: configuration.Config, machine: Machine, calibration: Calibration) -> dict[str, float]:
    """Each parameter-server strategy's own seconds beyond its predicted parts (the dispatcher's
    messages, the servers' round trips in Python), which one worker alone cannot show: the
    strategy trains the whole batch on this machine's worker count (at least a server and a
    worker, `trial_step`), in one micro-batch and in two. Part of that machinery is paid per
    step (the share's dispatch, the commit) and part per micro-batch (hybrid's row requests):
    the two trials split it, kept as "server:NAME" (per step) and "NAME" (per micro-batch).
    Signed: where the servers' plan costs less than the loop's residual at N workers says (a
    server and a worker agree on less than two workers do), the difference comes off the loop."""
    local = dataclasses.replace(machine, nproc=max(machine.nproc, 2), nnodes=1)
    found = {}
    for row in registry.ROWS:
        if not row.has_servers or not runnable(cfg, row.name, cfg.train.global_batch_size, local.nproc):
            continue  # not this model's where it cannot run (hybrid needs sparse tables)
        residuals = [_server_residual(cfg, local, calibration, row.name, micro) for micro in (1, 2)]
        if None in residuals:
            continue
        one, two = cast(list[float], residuals)  # signed, as the world residuals: a line through both
        found[row.name], found[f"server:{row.name}"] = two - one, 2 * one - two
    return found


def _server_residual(
    cfg: configuration.Config, local: Machine, calibration: Calibration, strategy: str, micro: int
) -> float | None:
    """What `strategy`'s step in `micro` micro-batches on `local` takes beyond its prediction
    without the servers' machinery; None where it did not run."""
    from gradmesh import workloads

    shapes, options = workloads.model_shapes(cfg), options_for(cfg, local)
    job = Inputs(cfg, calibration.compute, calibration, local, options, shapes, calibration.overheads)
    predicted = baseline(job, strategy, micro).step_s
    batch, threads = cfg.train.global_batch_size, local.threads(local.nproc)
    measured = trial_step(cfg, strategy, batch, threads, local.nproc, estimate_s=predicted, grad_accum=micro)
    if measured is None:
        return None
    return (measured[0] - predicted) / calibration.overheads.get("co_running", 1.0)


def world_residuals(cfg: configuration.Config, machine: Machine, calibration: Calibration) -> dict[str, float]:
    """What a step of N workers costs beyond its parts as predicted from one worker and the link,
    measured once per lockstep strategy at this machine's worker count. The registry's first
    strategy's residual is the loop's own (the loss, the metrics, the step's agreement, the
    processes' wake-ups around every call), paid by every plan of more than one rank; each
    other's is its machinery at N ranks (waits in its collectives, per-call costs that the link's
    fit and a one-worker run do not show), paid where it is planned. Both per step: under
    gradient accumulation FSDP2's second micro-batch adds what the one-worker run and the link
    predict for it, not a second residual. Signed (a plan whose machinery totals below zero
    takes it off the loop's part): clamping each residual would turn every trial's noise into a
    slower plan."""
    from gradmesh import workloads

    local = dataclasses.replace(machine, nnodes=1)
    shapes, options = workloads.model_shapes(cfg), options_for(cfg, local)
    threads = local.threads(local.nproc)
    found: dict[str, float] = {}
    for row in registry.ROWS:
        if row.has_servers or not runnable(cfg, row.name, cfg.train.global_batch_size, local.nproc):
            continue  # the servers' own: server_machinery
        job = Inputs(cfg, calibration.compute, calibration, local, options, shapes, {**calibration.overheads, **found})
        predicted = baseline(job, row.name).step_s
        measured = trial_step(cfg, row.name, cfg.train.global_batch_size, threads, local.nproc, predicted)
        if measured is None:
            continue
        extra = (measured[0] - predicted) / calibration.overheads.get("co_running", 1.0)
        found["world_loop" if row is registry.ROWS[0] else f"world:{row.name}"] = extra
    found.update(
        _sync_point(cfg, local, dataclasses.replace(calibration, overheads={**calibration.overheads, **found}))
    )
    return found


def _sync_point(cfg: configuration.Config, local: Machine, calibration: Calibration) -> dict[str, float]:
    """{"world_call_s": what one more collective in a step costs at N workers beyond its time on
    the link}: a step that waits on a peer where the link's timing runs both ranks in lockstep
    (the earlier one sleeps until the other arrives, then both wake on a shared core). A
    compressor that splits a reduction into several calls pays it per extra call; measured
    from the registry's first strategy under the low-rank method (its P and Q exchanges)."""
    from gradmesh import workloads

    compression = next((c for c in COMPRESSIONS if c.startswith("powersgd")), None)
    first = registry.ROWS[0].name
    shapes = workloads.model_shapes(cfg)
    if compression is None or wire_of(compression, shapes)[1] <= 1:
        return {}  # nothing in this model that the method would split
    options = options_for(cfg, local)
    job = Inputs(cfg, calibration.compute, calibration, local, options, shapes, calibration.overheads)
    candidate = Candidate(first, compression=compression)
    predicted = predict(job, candidate, registry.resolve(first, registry.mesh_for(first, local.world))).step_s
    batch, threads = cfg.train.global_batch_size, local.threads(local.nproc)
    measured = trial_step(cfg, first, batch, threads, local.nproc, estimate_s=predicted, compression=compression)
    if measured is None:
        return {}
    extra = (measured[0] - predicted) / calibration.overheads.get("co_running", 1.0)
    return {"world_call_s": extra / (wire_of(compression, shapes)[1] - 1)}


def options_for(cfg: configuration.Config, machine: Machine) -> costs.Options:
    from torch.nn.modules.batchnorm import _BatchNorm

    from gradmesh import workloads
    from gradmesh.parallel.placement import whole_tables
    from gradmesh.parallel.ps import sparse_tables
    from gradmesh.parallel.sharded import fsdp_units
    from gradmesh.parallel.tp_plans import tp_parameter_count

    model = workloads.meta_model(cfg)
    tables = [table for _, table in sparse_tables(model)]
    units, root = fsdp_units(model)
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    return costs.Options(
        microbatches=cfg.train.microbatches,
        schedule=cfg.train.pp_schedule,
        servers=cfg.ps.servers,
        tp_params=tp_parameter_count(model),
        table_params=sum(t.weight.numel() for t in tables),
        table_rows=sum(t.weight.shape[0] for t in tables),
        whole_tables=whole_tables(cfg, tables),
        rows_per_sample=len(tables),
        row_bytes=costs.FP32 * (tables[0].weight.shape[1] if tables else 0),
        cuda=machine.cuda,
        fsdp_units=units,
        fsdp_root_share=root / max(sum(p.numel() for p in model.parameters()), 1),
        norm_layers=len(norms),
        norm_channels=sum(m.num_features for m in norms),
    )


def baseline(job: Inputs, strategy: str = registry.ROWS[0].name, grad_accum: int = 1) -> Prediction:
    """`strategy` (the registry's first), predicted on `job`'s machine."""
    baseline = Candidate(strategy, grad_accum=grad_accum)
    plan = registry.resolve(baseline.strategy, registry.mesh_for(baseline.strategy, job.machine.world))
    return predict(job, baseline, plan)
