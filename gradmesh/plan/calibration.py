"""The calibration of this machine for one model: what `gradmesh plan` predicts from, and its cache.

Calibration (`Calibration`) is the model's compute at the thread counts the plans would give a
worker, the link's collectives at the group sizes they would form, and the overheads measured by
real runs (`gradmesh.plan.overhead`, `gradmesh.plan.arithmetic`). It is cached under the user's
cache folder (`$XDG_CACHE_HOME/gradmesh/calibration/`, one JSON file per key: this machine's
processor, core count and torch version, the model's parameter shapes, the optimizer and the
batch sizes timed), so planning twice is instant; `refresh` measures again.
"""

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from gradmesh import config as configuration
from gradmesh.plan import cache_dir
from gradmesh.plan.compute import ComputeProfile
from gradmesh.plan.link import LinkProfile, bytes_moved
from gradmesh.plan.predict import Machine

FORMAT = 8


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
    from gradmesh.optim import optimizer_spec

    optimizer_class, kwargs = optimizer_spec(cfg.train)
    what = {
        "machine": [_processor(), os.cpu_count(), torch.__version__],
        "model": sorted(workloads.model_shapes(cfg).items()),
        "optimizer": [optimizer_class.__name__, sorted((k, v) for k, v in kwargs.items() if k != "lr")],
        "threads": sorted({machine.threads(machine.nproc), machine.threads(1)}),
        "sizes": sizes,
        "groups": groups,
    }
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def calibration_place(cfg: configuration.Config, machine: Machine) -> tuple[tuple[int, ...], list[int], Path]:
    """(micro-batch sizes, group sizes, cache file) of the calibration this job needs."""
    sizes = _batch_sizes(cfg, machine)
    groups = sorted({n for n in (2, machine.nproc) if n > 1})
    return sizes, groups, cache_dir() / f"{cfg.model.name}-{_key(cfg, machine, sizes, groups)}.json"


def cached(path: Path) -> Calibration | None:
    try:
        return Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, of another format, or torn: measured again
