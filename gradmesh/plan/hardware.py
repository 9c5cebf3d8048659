"""Hypothetical clusters: a small table of devices and the links between them, in place of a calibration.

`gradmesh plan --hardware NAME` answers "what would 64 nodes of 8 GPUs do" without such a cluster
at hand: the model's FLOPs (`gradmesh.plan.flops`) divided by the device's peak times its
efficiency replace the timed passes, and `Cluster` replaces the calibrated links. Everything
else — the registry rows' cost functions, the state formulas, the ranking — is the calibrated
path's own (`gradmesh.plan.predict`).

The table's figures are the vendors' datasheet peaks (NVIDIA Tesla P100, V100, A100 and H100
datasheets; dense tensor-core figures, no sparsity). `efficiency` is the one figure that is not a
datasheet's: the fraction of peak a training step's arithmetic reaches on that device, taken from
a published training result (each entry's `efficiency_source`, with the derivation in
docs/planning.md#hypothetical-clusters); one per device, never tuned per workload. Latencies are
an assumption: the per-step start-up of NCCL's ring over NVLink or PCIe inside a node, and over
InfiniBand or RoCE between nodes, which no datasheet gives.

This module imports no torch: the CLI lists the table in `--help` and checks `--link` before
anything heavy is imported.
"""

import math
import re
from dataclasses import dataclass, replace
from typing import Protocol

from gradmesh.errors import UsageError
from gradmesh.plan.link import bytes_moved, latency_steps

GB = 1e9
TFLOPS = 1e12
GIB = 2**30
US = 1e-6


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link's Hockney parameters: a message of n bytes takes latency_s + n / bandwidth."""

    bandwidth: float
    """Bytes per second, one direction."""
    latency_s: float
    """Start-up seconds of one step of a collective's algorithm."""

    def describe(self) -> str:
        return f"{self.bandwidth * 8 / GB:g} Gbit/s, {self.latency_s / US:g} us"


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator model and the node it usually sits in."""

    name: str
    peak_fp32: float
    """FLOP/s at fp32 (no TF32: gradmesh trains in fp32)."""
    peak_half: float
    """FLOP/s at bf16/fp16 on tensor cores, dense."""
    memory: float
    """Bytes of device memory."""
    memory_bandwidth: float
    """Bytes per second of device memory (what the optimizer's step, a memory-bound pass, runs at)."""
    efficiency: float
    """Fraction of peak a training step's arithmetic reaches (see `efficiency_source`)."""
    efficiency_source: str
    intra: Link
    """Between two GPUs of one node, per GPU and direction (NVLink, or PCIe without it)."""
    inter: Link
    """A node's network, shared by its GPUs (the usual node of the generation; `--link` overrides)."""
    per_node: int
    """GPUs per node by default (`--nproc` overrides)."""


NVLINK_US, NETWORK_US = 5 * US, 10 * US  # assumed per-step start-ups (see the module's docstring)

P100 = Device(
    name="p100", peak_fp32=9.3 * TFLOPS, peak_half=18.7 * TFLOPS, memory=16 * GIB,
    memory_bandwidth=732 * GB, efficiency=0.48,
    efficiency_source="TensorFlow's published P100 benchmarks (ResNet-50, Inception V3)",
    intra=Link(bandwidth=16 * GB, latency_s=NVLINK_US),  # PCIe 3.0 x16, no NVLink
    inter=Link(bandwidth=25 * GB / 8, latency_s=NETWORK_US), per_node=4,
)  # fmt: skip
V100 = Device(
    name="v100-16g", peak_fp32=15.7 * TFLOPS, peak_half=125 * TFLOPS, memory=16 * GIB,
    memory_bandwidth=900 * GB, efficiency=0.30,
    efficiency_source="Megatron-LM (Shoeybi et al., 2019): its single-V100 baseline's share of peak",
    intra=Link(bandwidth=150 * GB, latency_s=NVLINK_US),  # NVLink 2: 300 GB/s both ways
    inter=Link(bandwidth=100 * GB / 8, latency_s=NETWORK_US), per_node=8,
)  # fmt: skip
A100 = Device(
    name="a100-40g", peak_fp32=19.5 * TFLOPS, peak_half=312 * TFLOPS, memory=40 * GIB,
    memory_bandwidth=1555 * GB, efficiency=0.52,
    efficiency_source="Narayanan et al., SC'21 (Megatron-LM on 3072 A100s): per-GPU share of peak",
    intra=Link(bandwidth=300 * GB, latency_s=NVLINK_US),  # NVLink 3: 600 GB/s both ways
    inter=Link(bandwidth=8 * 200 * GB / 8, latency_s=NETWORK_US), per_node=8,  # DGX A100: 8 x HDR
)  # fmt: skip
H100 = Device(
    name="h100-sxm", peak_fp32=67 * TFLOPS, peak_half=989 * TFLOPS, memory=80 * GIB,
    memory_bandwidth=3350 * GB, efficiency=A100.efficiency,
    efficiency_source="assumed equal to the A100's (no published H100 figure checked)",
    intra=Link(bandwidth=450 * GB, latency_s=NVLINK_US),  # NVLink 4: 900 GB/s both ways
    inter=Link(bandwidth=8 * 400 * GB / 8, latency_s=NETWORK_US), per_node=8,  # DGX H100: 8 x NDR
)  # fmt: skip
DEVICES = {
    d.name: d
    for d in (
        P100,
        V100,
        replace(V100, name="v100-32g", memory=32 * GIB),
        A100,
        replace(A100, name="a100-80g", memory=80 * GIB, memory_bandwidth=2039 * GB),
        H100,
    )
}

BANDWIDTH_UNITS = {"gbit": GB / 8, "mbit": 1e6 / 8, "gb/s": GB, "mb/s": 1e6}
LATENCY_UNITS = {"ns": 1e-9, "us": US, "ms": 1e-3}
LINK_SYNTAX = "BANDWIDTH[,LATENCY]: gbit, mbit, GB/s or MB/s; ns, us or ms (e.g. 25gbit, 200mbit,50us)"


def device(name: str) -> Device:
    if name not in DEVICES:
        raise UsageError(f"--hardware {name!r} is not one of {', '.join(DEVICES)}")
    return DEVICES[name]


def _amount(text: str, units: dict[str, float]) -> float | None:
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z/]+)", text.strip().lower())
    if not found or found.group(2) not in units:
        return None
    value = float(found.group(1)) * units[found.group(2)]
    return value if 0 < value < math.inf else None


def parse_link(text: str, default: Link) -> Link:
    """`--link BANDWIDTH[,LATENCY]` between nodes; a latency left out keeps `default`'s."""
    bandwidth, _, latency = text.partition(",")
    speed = _amount(bandwidth, BANDWIDTH_UNITS)
    delay = _amount(latency, LATENCY_UNITS) if latency else default.latency_s
    if not text.isascii() or speed is None or delay is None:
        raise UsageError(f"--link must be {LINK_SYNTAX}; got {text!r}")
    return Link(bandwidth=speed, latency_s=delay)


class Within(Protocol):
    """What a node's own links answer (`costs.Network`'s `time`)."""

    def time(self, kind: str, nbytes: float, ranks: int, calls: int = 1) -> float: ...


@dataclass(frozen=True, kw_only=True)
class OneLink:
    """The links inside a node as one Hockney link (a device's NVLink or PCIe)."""

    link: Link

    def time(self, kind: str, nbytes: float, ranks: int, calls: int = 1) -> float:
        return _phase(self.link, kind, nbytes, ranks, calls)


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """`costs.Network` of `nodes` nodes of `nproc` ranks each: collectives run hierarchically.

    A group of ranks `stride` apart (a row-major mesh: later axes are contiguous, so a model
    axis sits inside a node) has `local` members on each node it spans. Its collective runs within
    each node over the node's own links (`within`), then across its `spanned` nodes over the
    node's network, then within the node again (NCCL's and Horovod's hierarchical all-reduce:
    reduce-scatter, all-reduce of the shard across nodes, all-gather). Every group of the axis runs
    at once, so a node's network carries the cross-node bytes of all the groups with members on
    it. Across nodes, Hockney's alpha-beta: `latency_steps` start-ups plus the ring's
    `bytes_moved` over the link."""

    within: Within
    """Inside a node: a device's links (`OneLink`), or this machine's calibration."""
    nodes: int
    nproc: int
    inter: Link
    """Between nodes (the device's default, or `--link`)."""
    stride: int = 1

    def along(self, stride: int) -> "Nodes":
        """The same nodes seen by groups whose ranks are `stride` apart."""
        return replace(self, stride=stride)

    def placement(self, ranks: int) -> tuple[int, int]:
        """(members on each node, nodes spanned) of one group of `ranks`."""
        local = max(1, min(ranks, self.nproc // self.stride))
        return local, math.ceil(ranks / local)

    def time(self, kind: str, nbytes: float, ranks: int, calls: int = 1) -> float:
        """Seconds for `calls` collectives of `kind`, `nbytes` in all, over a group of `ranks`."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        local, spanned = self.placement(ranks)
        within = self.within.time(kind, nbytes, local, calls) if local > 1 else 0.0
        # every group of this axis with members on a node crosses to the others through its one network
        across = _phase(self.inter, kind, nbytes * self.nproc / local, spanned, calls)
        return within + across

    def describe(self) -> str:
        return f"{self.nodes} x {self.nproc} ranks, {self.inter.describe()} between nodes"


@dataclass(frozen=True, kw_only=True)
class Cluster(Nodes):
    """Nodes of a device from the table, its links inside each node."""

    device: Device

    def describe(self) -> str:
        return f"{self.nodes} x {self.nproc} {self.device.name}, {self.inter.describe()} between nodes"


def cluster(gpu: Device, nodes: int, nproc: int, inter: Link) -> Cluster:
    return Cluster(within=OneLink(link=gpu.intra), nodes=nodes, nproc=nproc, inter=inter, device=gpu)


def _phase(link: Link, kind: str, nbytes: float, members: int, calls: int) -> float:
    """One level of a hierarchical collective: Hockney's alpha-beta over `link` among `members`."""
    return calls * latency_steps(kind, members) * link.latency_s + bytes_moved(kind, nbytes, members) / link.bandwidth
