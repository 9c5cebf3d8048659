"""`gradmesh plan`: calibrate once per machine and model shape, predict every candidate, rank them.

Calibration (`Calibration`) is the model's compute at the thread counts the plans would give a
worker and the link's collectives at the group sizes they would form. It is cached under the
user's cache folder (`$XDG_CACHE_HOME/gradmesh/calibration/`, one JSON file per key: this
machine's processor, core count and torch version, the model's parameter shapes, the optimizer
and the batch sizes timed), so planning twice is instant; `refresh` measures again.
"""

import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradmesh import config as configuration
from gradmesh.files import atomic_write
from gradmesh.parallel import registry
from gradmesh.parallel.state import probe_state
from gradmesh.plan import cache_dir, costs
from gradmesh.plan.candidates import Candidate, candidates
from gradmesh.plan.compute import ComputeProfile, co_running, measure_compute
from gradmesh.plan.hardware import Cluster
from gradmesh.plan.link import LinkProfile, bytes_moved, measure_link
from gradmesh.plan.overhead import measure_overheads, one_worker_step
from gradmesh.plan.predict import Inputs, Machine, Prediction, predict, settle

FORMAT = 4


@dataclass(frozen=True)
class Calibration:
    compute: dict[int, ComputeProfile]
    """By threads per worker."""
    links: dict[int, LinkProfile]
    """By group size."""
    overheads: dict[str, float]
    """Seconds per step beyond the model's arithmetic: "loop", and each strategy's machinery
    (`gradmesh.plan.overhead`)."""

    def time(self, kind: str, nbytes: float, ranks: int, calls: int = 1) -> float:
        """`costs.Network`: a group size not calibrated uses the nearest one's per-byte time, with a
        ring's per-call latency growing with its steps (ranks - 1)."""
        if ranks <= 1 or nbytes <= 0 or not self.links:
            return 0.0
        link = self.links.get(ranks) or self.links[min(self.links, key=lambda n: abs(n - ranks))]
        fit = link.fits[kind]
        steps = (ranks - 1) / max(link.world - 1, 1)
        return calls * fit.alpha_s * steps + bytes_moved(kind, nbytes, ranks) * fit.beta_s_per_byte

    def along(self, stride: int) -> "Calibration":
        """`costs.Network`: every rank calibrated here shares this machine's links, wherever it sits."""
        return self

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "compute": {str(k): v.to_json() for k, v in self.compute.items()},
            "links": {str(k): v.to_json() for k, v in self.links.items()},
            "overheads": self.overheads,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        if data.get("format") != FORMAT:
            raise ValueError(f"calibration format {data.get('format')!r}, expected {FORMAT}")
        return cls(
            {int(k): ComputeProfile.from_json(v) for k, v in data["compute"].items()},
            {int(k): LinkProfile.from_json(v) for k, v in data["links"].items()},
            {str(k): float(v) for k, v in data["overheads"].items()},
        )


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


def _batch_sizes(cfg: configuration.Config, machine: Machine) -> tuple[int, ...]:
    """Micro-batches from the smallest any candidate runs (a pipeline's slice of one rank's share)
    to the largest (one worker taking the whole batch)."""
    batch = cfg.train.global_batch_size
    smallest = max(1, batch // (machine.world * 2 * 8))
    return tuple(sorted({smallest, max(smallest, batch // machine.world), batch}))


def _processor() -> str:
    """The processor's model name (Linux: /proc/cpuinfo; platform.processor() would run uname)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.machine()


def _key(cfg: configuration.Config, machine: Machine, sizes: tuple[int, ...], groups: list[int]) -> str:
    from gradmesh import workloads
    from gradmesh.loop.trainer import optimizer_spec

    optimizer_class, kwargs = optimizer_spec(cfg.train)
    what = {
        "machine": [_processor(), os.cpu_count(), torch.__version__],
        "model": sorted(workloads.model_shapes(cfg).items()),
        "optimizer": [optimizer_class.__name__, probe_state(optimizer_class, kwargs)[0]],
        "threads": sorted({machine.threads(machine.nproc), machine.threads(1)}),
        "sizes": sizes,
        "groups": groups,
    }
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def _calibration_place(cfg: configuration.Config, machine: Machine) -> tuple[tuple[int, ...], list[int], Path]:
    """(micro-batch sizes, group sizes, cache file) of the calibration this job needs."""
    sizes = _batch_sizes(cfg, machine)
    groups = sorted({n for n in (2, machine.nproc) if n > 1})
    return sizes, groups, cache_dir() / f"{cfg.model.name}-{_key(cfg, machine, sizes, groups)}.json"


def _cached(path: Path) -> Calibration | None:
    try:
        return Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, of another format, or torn: measured again


def calibrate(cfg: configuration.Config, machine: Machine, refresh: bool = False) -> tuple[Calibration, Path, bool]:
    """(calibration, its cache file, whether it came from the cache)."""
    sizes, groups, path = _calibration_place(cfg, machine)
    found = None if refresh else _cached(path)
    if found is not None:
        return found, path, True
    threads = sorted({machine.threads(machine.nproc), machine.threads(1)})
    compute = {t: measure_compute(cfg, t, sizes) for t in threads}
    links = {n: measure_link(n, threads=machine.threads(n), repeats=9) for n in groups}
    worker = compute[machine.threads(machine.nproc)]
    batch = max(1, cfg.train.global_batch_size // machine.world)
    overheads = measure_overheads(cfg, worker, batch, _slots(cfg))
    overheads["co_running"] = co_running(machine.nproc, worker.threads)
    # The speed-up's baseline is measured, not predicted: one worker with every core, the whole batch.
    alone = one_worker_step(cfg, registry.ROWS[0].name, cfg.train.global_batch_size, machine.threads(1))
    if alone is not None:
        overheads["single_step_s"] = alone[0]
    found = Calibration(compute, links, overheads)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(found.to_json(), indent=1))
    return found, path, False


def _slots(cfg: configuration.Config) -> int:
    from gradmesh.loop.trainer import optimizer_spec
    from gradmesh.parallel.state import optimizer_slots

    return optimizer_slots(*optimizer_spec(cfg.train))


def _options(cfg: configuration.Config, machine: Machine) -> costs.Options:
    from gradmesh import workloads
    from gradmesh.parallel.ps import sparse_tables
    from gradmesh.parallel.tensor import tp_parameter_count

    model = workloads.meta_model(cfg)
    tables = [table for _, table in sparse_tables(model)]
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
    )


def plan(cfg: configuration.Config, machine: Machine, samples: int, refresh: bool = False) -> Planned:
    """Every candidate predicted and ranked; `samples`: the data volume to train."""
    found, path, cached = calibrate(cfg, machine, refresh)
    return _ranked(cfg, machine, samples, found.compute, found, found.overheads, cache=path, cached=cached)


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
    path = _calibration_place(cfg, machine)[2]
    found = _cached(path)
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
    baseline = Candidate(registry.ROWS[0].name)
    plan = registry.resolve(baseline.strategy, registry.mesh_for(baseline.strategy, 1))
    return predict(dataclasses.replace(job, machine=one), baseline, plan).step_s
