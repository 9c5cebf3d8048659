"""`gradmesh plan`: calibrate once per machine and model shape (`gradmesh.plan.calibration`, cached),
predict every candidate, rank them.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from gradmesh import config as configuration
from gradmesh.files import atomic_write
from gradmesh.parallel import registry
from gradmesh.plan import costs
from gradmesh.plan.arithmetic import measure_compression
from gradmesh.plan.calibration import Calibration, cached, calibration_place
from gradmesh.plan.candidates import COMPRESSIONS, Candidate, candidates
from gradmesh.plan.compute import ComputeProfile, co_running, measure_compute
from gradmesh.plan.hardware import Cluster, Link, Nodes
from gradmesh.plan.link import measure_link
from gradmesh.plan.overhead import measure_overheads, runnable, trial_step
from gradmesh.plan.predict import Inputs, Machine, Prediction, predict, settle


@dataclass
class Planned:
    ranked: list[Prediction]
    """Those that fit, fastest first, then those that do not, by how much they miss."""
    refused: list[tuple[Candidate, str]]
    single_step_s: float
    samples: int
    cache: Path | None = None
    """The calibration's file (None on a hypothetical cluster)."""
    cached: bool = False
    hardware: Cluster | None = None
    """The hypothetical cluster predicted for, in place of a calibration."""
    hosts: Nodes | None = None
    """Hosts like this one joined by a given network (`--link` without `--hardware`)."""


def calibrate(cfg: configuration.Config, machine: Machine, refresh: bool = False) -> tuple[Calibration, Path, bool]:
    """(calibration, its cache file, whether it came from the cache)."""
    sizes, groups, path = calibration_place(cfg, machine)
    found = None if refresh else cached(path)
    if found is not None:
        return found, path, True
    found = _measure(cfg, machine, sizes, groups)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(found.to_json(), indent=1))
    return found, path, False


def _measure(cfg: configuration.Config, machine: Machine, sizes: tuple[int, ...], groups: list[int]) -> Calibration:
    from gradmesh import workloads

    threads = sorted({machine.threads(machine.nproc), machine.threads(1)})
    compute = {t: measure_compute(cfg, t, sizes) for t in threads}
    links = {n: measure_link(n, threads=machine.threads(n), repeats=9) for n in groups}
    worker = compute[machine.threads(machine.nproc)]
    batch = max(1, cfg.train.global_batch_size // machine.world)
    overheads = measure_overheads(cfg, worker, batch, _slots(cfg))
    overheads["co_running"] = co_running(machine.nproc, worker.threads)
    overheads.update(measure_compression(workloads.model_shapes(cfg), COMPRESSIONS, worker.threads))
    # The speed-up's baseline is measured, not predicted: one worker with every core, the whole batch.
    whole = compute[machine.threads(1)]
    estimate = whole.pass_s(cfg.train.global_batch_size) + whole.optimizer_s_per_param * whole.params
    alone = trial_step(cfg, registry.ROWS[0].name, cfg.train.global_batch_size, machine.threads(1), estimate_s=estimate)
    if alone is not None:
        overheads["single_step_s"] = alone[0]
    found = Calibration(compute, links, overheads)
    if machine.nproc > 1:
        overheads.update(_world_residuals(cfg, machine, found))
        overheads.update(_server_machinery(cfg, machine, found))
    return found


def _server_machinery(cfg: configuration.Config, machine: Machine, calibration: Calibration) -> dict[str, float]:
    """Each parameter-server strategy's own seconds beyond its predicted parts (the dispatcher's
    messages, the servers' round trips in Python), which one worker alone cannot show: the
    strategy trains the whole batch on this machine's worker count (at least a server and a
    worker, `trial_step`), in one micro-batch and in two. Part of that machinery is paid per
    step (the share's dispatch, the commit) and part per micro-batch (hybrid's row requests):
    the two trials split it, kept as "server:NAME" (per step) and "NAME" (per micro-batch)."""
    local = dataclasses.replace(machine, nproc=max(machine.nproc, 2), nnodes=1)
    found = {}
    for row in registry.ROWS:
        if not row.has_servers or not runnable(cfg, row.name, cfg.train.global_batch_size, local.nproc):
            continue  # not this model's where it cannot run (hybrid needs sparse tables)
        residuals = [_server_residual(cfg, local, calibration, row.name, micro) for micro in (1, 2)]
        if None in residuals:
            continue
        one, two = cast(list[float], residuals)
        per_micro = max(two - one, 0.0)
        found[row.name], found[f"server:{row.name}"] = per_micro, max(one - per_micro, 0.0)
    return found


def _server_residual(
    cfg: configuration.Config, local: Machine, calibration: Calibration, strategy: str, micro: int
) -> float | None:
    """What `strategy`'s step in `micro` micro-batches on `local` takes beyond its prediction
    without the servers' machinery; None where it did not run."""
    from gradmesh import workloads

    shapes, options = workloads.model_shapes(cfg), _options(cfg, local)
    job = Inputs(cfg, calibration.compute, calibration, local, options, shapes, calibration.overheads)
    predicted = _baseline(job, strategy, micro).step_s
    batch, threads = cfg.train.global_batch_size, local.threads(local.nproc)
    measured = trial_step(cfg, strategy, batch, threads, local.nproc, estimate_s=predicted, grad_accum=micro)
    if measured is None:
        return None
    return (measured[0] - predicted) / calibration.overheads.get("co_running", 1.0)


def _world_residuals(cfg: configuration.Config, machine: Machine, calibration: Calibration) -> dict[str, float]:
    """What a step of N workers costs beyond its parts as predicted from one worker and the link,
    measured once per lockstep strategy at this machine's worker count. The registry's first
    strategy's residual is the loop's own (the loss, the metrics, the step's agreement, the
    processes' wake-ups around every call), paid by every plan of more than one rank; each
    other's is its machinery at N ranks (waits in its collectives, per-call costs that the link's
    fit and a one-worker run do not show), paid where it is planned. Both per step: under
    gradient accumulation FSDP2's second micro-batch adds what the one-worker run and the link
    predict for it, not a second residual. Signed (a part whose total comes out below zero
    counts as zero): clamping each residual would turn every trial's noise into a slower plan."""
    from gradmesh import workloads

    local = dataclasses.replace(machine, nnodes=1)
    shapes, options = workloads.model_shapes(cfg), _options(cfg, local)
    threads = local.threads(local.nproc)
    found: dict[str, float] = {}
    for row in registry.ROWS:
        if row.has_servers or not runnable(cfg, row.name, cfg.train.global_batch_size, local.nproc):
            continue  # the servers' own: _server_machinery
        job = Inputs(cfg, calibration.compute, calibration, local, options, shapes, {**calibration.overheads, **found})
        predicted = _baseline(job, row.name).step_s
        measured = trial_step(cfg, row.name, cfg.train.global_batch_size, threads, local.nproc, predicted)
        if measured is None:
            continue
        extra = (measured[0] - predicted) / calibration.overheads.get("co_running", 1.0)
        found["world_loop" if row is registry.ROWS[0] else f"world:{row.name}"] = extra
    return found


def _slots(cfg: configuration.Config) -> int:
    from gradmesh.optim import optimizer_slots, optimizer_spec

    return optimizer_slots(*optimizer_spec(cfg.train))


def _options(cfg: configuration.Config, machine: Machine) -> costs.Options:
    from gradmesh import workloads
    from gradmesh.parallel.ps import sparse_tables
    from gradmesh.parallel.sharded import fsdp_units
    from gradmesh.parallel.tp_plans import tp_parameter_count

    model = workloads.meta_model(cfg)
    tables = [table for _, table in sparse_tables(model)]
    units, root = fsdp_units(model)
    return costs.Options(
        microbatches=cfg.train.microbatches,
        schedule=cfg.train.pp_schedule,
        servers=cfg.ps.servers,
        tp_params=tp_parameter_count(model),
        table_params=sum(t.weight.numel() for t in tables),
        table_rows=sum(t.weight.shape[0] for t in tables),
        rows_per_sample=len(tables),
        row_bytes=costs.FP32 * (tables[0].weight.shape[1] if tables else 0),
        tensors=sum(1 for _ in model.parameters()),
        cuda=machine.cuda,
        fsdp_units=units,
        fsdp_root_share=root / max(sum(p.numel() for p in model.parameters()), 1),
    )


def plan(
    cfg: configuration.Config, machine: Machine, samples: int, refresh: bool = False, inter: Link | None = None
) -> Planned:
    """Every candidate predicted and ranked; `samples`: the data volume to train. `inter`: the
    network between `machine.nnodes` hosts, each calibrated as this one (else the calibrated link
    stands for every group)."""
    found, path, cached = calibrate(cfg, machine, refresh)
    network: costs.Network = found
    hosts = None
    if inter is not None:
        network = hosts = Nodes(within=found, nodes=machine.nnodes, nproc=machine.nproc, inter=inter)
    return _ranked(
        cfg, machine, samples, found.compute, network, found.overheads, cache=path, cached=cached, hosts=hosts
    )


def hypothetical_plan(cfg: configuration.Config, machine: Machine, cluster: Cluster, samples: int) -> Planned:
    """`plan` on a cluster from the hardware table: the model's FLOPs instead of timed passes, the
    cluster's links instead of calibrated ones; nothing measured, nothing started."""
    from gradmesh.plan.flops import flop_profile

    profile = flop_profile(cfg, cluster.device)
    compute = {machine.threads(n): profile for n in (1, machine.nproc)}  # a GPU's speed is not its host's threads
    overheads = {"co_running": 1.0}  # each rank computes on a GPU of its own
    return _ranked(cfg, machine, samples, compute, cluster, overheads, hardware=cluster)


def cached_plan(cfg: configuration.Config, machine: Machine) -> Planned | None:
    """`plan` from this machine's cached calibration of the model; None without one."""
    path = calibration_place(cfg, machine)[2]
    found = cached(path)
    samples = cfg.train.max_steps * cfg.train.global_batch_size
    if found is None:
        return None
    return _ranked(cfg, machine, samples, found.compute, found, found.overheads, cache=path, cached=True)


def _ranked(
    cfg: configuration.Config,
    machine: Machine,
    samples: int,
    compute: dict[int, ComputeProfile],
    network: costs.Network,
    overheads: dict[str, float],
    **source: Any,
) -> Planned:
    """`source`: where the costs come from (`Planned`'s cache and cached, or hardware)."""
    from gradmesh import workloads

    shapes = workloads.model_shapes(cfg)
    allowed, refused = candidates(cfg, machine.nproc, machine.world)
    found = []
    for candidate, job in allowed:
        configured = candidate.configured(cfg)
        options = _options(configured, machine)
        found.append(predict(Inputs(configured, compute, network, machine, options, shapes, overheads), candidate, job))
    single = _single_worker_step(Inputs(cfg, compute, network, machine, _options(cfg, machine), shapes, overheads))
    settle(found, single, samples, machine)
    ranked = _simplest_first(sorted((p for p in found if p.fits), key=lambda p: p.step_s))
    ranked += sorted((p for p in found if not p.fits), key=lambda p: p.peak_bytes)
    return Planned(ranked, refused, single, samples, **source)


TIE = 0.02
"""Plans predicted within this of the fastest are as fast as the calibration can tell."""


def _simplest_first(ranked: list[Prediction]) -> list[Prediction]:
    """Among the plans tied with the fastest, the one with the fewest settings changed goes first:
    compression changes what the gradients are, and accumulation or more micro-batches add work,
    for no gain the prediction can show."""
    if not ranked:
        return ranked
    tied = [p for p in ranked if p.step_s <= ranked[0].step_s * (1 + TIE)]
    simplest = min(
        tied,
        key=lambda p: (p.candidate.compression != "none", p.candidate.grad_accum, p.candidate.microbatches, p.step_s),
    )
    return [simplest, *(p for p in ranked if p is not simplest)]


def _single_worker_step(job: Inputs) -> float:
    """The step of one worker with every core: what speed-up is measured against (as calibrated)."""
    if "single_step_s" in job.overheads:
        return job.overheads["single_step_s"]
    one = dataclasses.replace(job.machine, nproc=1, nnodes=1)
    return _baseline(dataclasses.replace(job, machine=one)).step_s


def _baseline(job: Inputs, strategy: str = registry.ROWS[0].name, grad_accum: int = 1) -> Prediction:
    """`strategy` (the registry's first), predicted on `job`'s machine."""
    baseline = Candidate(strategy, grad_accum=grad_accum)
    plan = registry.resolve(baseline.strategy, registry.mesh_for(baseline.strategy, job.machine.world))
    return predict(job, baseline, plan)
