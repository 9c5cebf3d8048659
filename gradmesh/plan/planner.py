"""`gradmesh plan`: calibrate once per machine and model shape (`gradmesh.plan.calibration`, cached),
predict every candidate, rank them.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh import config as configuration
from gradmesh.files import atomic_write
from gradmesh.parallel import registry
from gradmesh.plan import costs, overhead
from gradmesh.plan.arithmetic import measure_compression
from gradmesh.plan.calibration import Calibration, cached, calibration_place
from gradmesh.plan.candidates import COMPRESSIONS, Candidate, candidates
from gradmesh.plan.compute import ComputeProfile, co_running, measure_compute
from gradmesh.plan.hardware import Cluster, Link, Nodes
from gradmesh.plan.link import measure_link
from gradmesh.plan.overhead import measure_overheads, trial_step
from gradmesh.plan.predict import Inputs, Machine, Prediction, predict, settle
from gradmesh.plan.residuals import baseline, options_for, server_machinery, world_residuals


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
    overhead.FAILED_TRIALS.clear()
    found = _measure(cfg, machine, sizes, groups)
    if overhead.FAILED_TRIALS:  # its plans would miss those overheads: measured again next time
        for line in overhead.FAILED_TRIALS:
            print(f"gradmesh plan: a calibration run failed (left out, and nothing cached): {line}", file=sys.stderr)
        return found, path, False
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
        overheads.update(world_residuals(cfg, machine, found))
        overheads.update(server_machinery(cfg, machine, found))
    return found


def _slots(cfg: configuration.Config) -> int:
    from gradmesh.optim import optimizer_slots, optimizer_spec

    return optimizer_slots(*optimizer_spec(cfg.train))


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
        options = options_for(configured, machine)
        found.append(predict(Inputs(configured, compute, network, machine, options, shapes, overheads), candidate, job))
    single = _single_worker_step(Inputs(cfg, compute, network, machine, options_for(cfg, machine), shapes, overheads))
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
    return baseline(dataclasses.replace(job, machine=one)).step_s
