"""One rank's optimizer step, in seconds, as each strategy shapes it: the registry rows' cost functions.

A `Step` starts as the whole model's step on one rank's share of the data; the rows of a plan
then act on it in composition order (`Strategy.cost`), as they act on the model: tensor parallel
divides each pass and adds the activations' all-reduces, a pipeline cuts the passes into
stages and micro-batches and adds the bubble and the hand-overs, and the data axis (or the
parameter servers) adds the gradients' way to the others and the optimizer's share. Collective
times come from the measured link (`gradmesh.plan.link`: alpha + bytes x beta per call, ring
bytes per kind), compute from the measured model (`gradmesh.plan.compute`).

What the model leaves out, on purpose: overlap of gradient reduction with backward on CPU
(gloo's threads compete with the workers' own for the same cores, so reduction is counted in
full; on CUDA, half of backward can hide it, `OVERLAP_CUDA`), compression's own arithmetic
(calibrated separately, `gradmesh.plan.arithmetic`), and the Python of the training loop (a fixed
cost per step, calibrated separately as the overhead "loop").
"""

import math
from dataclasses import dataclass, field
from typing import Protocol

from gradmesh.plan.compute import ComputeProfile

FP32 = 4
DDP_BUCKET_BYTES = 25 * 2**20
OVERLAP_CUDA = 0.5
"""Share of backward that NCCL's own stream can hide gradient reduction behind (an assumption: no
GPU here to measure it)."""


class Network(Protocol):
    def time(self, kind: str, nbytes: float, ranks: int, calls: int = 1) -> float:
        """Seconds for `calls` collectives of `kind` moving `nbytes` in all over `ranks` ranks."""
        ...

    def along(self, stride: int) -> "Network":
        """The links as a group of ranks `stride` apart sees them (a mesh axis with `stride` ranks
        of later axes between its members: across nodes, where a node holds fewer than that)."""
        ...


@dataclass(frozen=True)
class Options:
    """The job's settings a cost function reads besides the model and the link."""

    microbatches: int = 4
    schedule: str = "1f1b"
    servers: int = 1
    tp_params: int = 0
    """Parameters the tensor-parallel plan splits."""
    table_params: int = 0
    """Parameters in sparse tables (recsys): rows move as touched, not whole."""
    table_rows: int = 0
    whole_tables: tuple[int, ...] = ()
    """Parameters of each sparse table under --table-sharding table (`ModelSize.whole_tables`)."""
    rows_per_sample: float = 0.0
    """Table rows one sample touches (one per categorical feature)."""
    row_bytes: float = 0.0
    cuda: bool = False
    fsdp_units: int = 0
    """FSDP units of the sharding plan, the root's included (0: one per layer and two more)."""
    fsdp_root_share: float = 0.0
    """Share of the parameters in the root unit (FSDP2 keeps the root's gathered from forward to
    backward)."""
    norm_layers: int = 0
    """Batch normalisation layers (synchronised over the data axis: two all-reduces each a pass)."""
    norm_channels: int = 0
    """Their channels, all together."""


@dataclass
class Step:
    """One rank's optimizer step as the rows applied so far leave it."""

    compute: ComputeProfile
    network: Network
    options: Options
    micro_samples: float
    """Samples in one of this rank's micro-batches (forward and backward passes)."""
    micro: int
    """Micro-batches per optimizer step."""
    params: float
    """Parameters whose gradients and optimizer state this rank holds, before the data axis."""
    grad_bytes_per_param: float = FP32
    """On the wire, after compression."""
    grad_calls: int = 1
    """Collectives one reduction of a gradient bucket makes (a low-rank method makes more)."""
    compute_share: float = 1.0
    """Share of a whole-model pass this rank computes (model parallelism splits it)."""
    in_flight: float = 1.0
    """Micro-batches whose activations are alive at once."""
    tables_remote: bool = False
    """The sparse tables live on servers: a pass computes no whole-table gradients."""
    parts: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def pass_s(self) -> float:
        """One micro-batch's forward and backward on this rank."""
        c = self.compute
        fixed = c.fixed_s - (c.table_grad_s if self.tables_remote else 0.0)
        return (max(fixed, 0.0) + c.per_sample_s * self.micro_samples) * self.compute_share

    def reduce_gradients(self, kind: str, ranks: int, calls: int = 1) -> float:
        """Exposed seconds of one reduction of this rank's gradients."""
        seconds = self.network.time(kind, self.params * self.grad_bytes_per_param, ranks, calls * self.grad_calls)
        if self.options.cuda:
            seconds = max(seconds - OVERLAP_CUDA * self.pass_s() * 2 / 3, 0.0)  # backward ~ 2/3 of a pass
        return seconds

    @property
    def reduced_share(self) -> float:
        """Share of the model's gradients this rank reduces (model parallelism holds fewer)."""
        return self.params / max(self.compute.params, 1)

    def optimizer(self, params: float) -> None:
        self.add("optimizer", params * self.compute.optimizer_s_per_param)


def _buckets(params: float) -> int:
    return max(1, math.ceil(params * FP32 / DDP_BUCKET_BYTES))


def sync_norms(step: Step, ranks: int) -> None:
    """Synchronised batch normalisation (`gradmesh.parallel.batchnorm`): each layer all-reduces its
    count and per-channel sums forward, two per-channel sums backward, in float64, every micro-batch."""
    layers, channels = step.options.norm_layers, step.options.norm_channels
    if layers and ranks > 1:
        nbytes = 8 * (4 * channels + layers)
        step.add("comm", step.micro * step.network.time("all_reduce", nbytes, ranks, calls=2 * layers))


def ddp(step: Step, ranks: int) -> None:
    """One bucketed all-reduce per step (no_sync for the other micro-batches), every parameter stepped."""
    step.add("comm", step.reduce_gradients("all_reduce", ranks, _buckets(step.params)))
    sync_norms(step, ranks)
    step.optimizer(step.params)


def zero1(step: Step, ranks: int) -> None:
    """ddp's all-reduce; each rank steps its shard, then each rank's shard is broadcast from it
    (torch's ZeroRedundancyOptimizer with its parameters in one bucket per rank)."""
    step.add("comm", step.reduce_gradients("all_reduce", ranks, _buckets(step.params)))
    step.add("comm", step.network.time("broadcast", FP32 * step.params, ranks, calls=ranks))
    sync_norms(step, ranks)
    step.optimizer(step.params / ranks)


def fsdp(step: Step, ranks: int) -> None:
    """Per micro-batch, each unit's parameters gathered for forward and again for backward, but
    the root's (FSDP2 does not reshard the root after forward); the gradients reduce-scattered
    once per step, one call per unit; each rank steps its shard."""
    units = step.options.fsdp_units or step.compute.layers + 2
    forward = step.network.time("all_gather", FP32 * step.params, ranks, calls=units)
    blocks = FP32 * step.params * (1 - step.options.fsdp_root_share)
    backward = step.network.time("all_gather", blocks, ranks, calls=units - 1) if units > 1 else 0.0
    step.add("comm", step.micro * (forward + backward) + step.reduce_gradients("reduce_scatter", ranks, units))
    sync_norms(step, ranks)
    step.optimizer(step.params / ranks)


def tp(step: Step, ranks: int) -> None:
    """Megatron's layout: each block all-reduces its activations twice forward, twice backward."""
    layers = step.compute.layers
    activation = step.micro_samples * step.compute.boundary_bytes_per_sample
    step.add("comm", step.micro * step.network.time("all_reduce", 4 * layers * activation, ranks, calls=4 * layers))
    step.compute_share /= ranks
    split = step.options.tp_params
    step.params = step.params - split + split / ranks


def pipeline(step: Step, stages: int) -> None:
    """Each micro-batch cut into `microbatches`; a stage runs its share of every one, plus the
    fill and drain of (stages - 1) ticks (GPipe, 1F1B and interleaved alike: interleaving's
    smaller bubble has its own hand-overs), and hands activations on and gradients back."""
    m = step.options.microbatches
    step.micro_samples /= m
    step.micro *= m
    step.compute_share /= stages
    step.add("bubble", (stages - 1) * step.pass_s() * (step.micro // m))
    boundary = step.micro_samples * step.compute.boundary_bytes_per_sample
    ticks = step.micro + (stages - 1) * (step.micro // m)
    step.add("comm", 2 * ticks * step.network.time("p2p", boundary, 2) if stages > 1 else 0.0)
    step.in_flight = stages if step.options.schedule != "gpipe" else m
    step.params /= stages


def ps(step: Step, ranks: int) -> None:
    """Each worker pushes its dense gradient whole to the servers and pulls the parameters back, and
    a sparse table's rows as touched (hybrid's way); a server takes every worker's share of its
    shard in turn and steps once per step (sync)."""
    options = step.options
    servers, workers = options.servers, max(ranks - options.servers, 1)
    dense = step.params - options.table_params
    shard = FP32 * dense / servers
    step.add("comm", 2 * workers * step.network.time("p2p", shard, 2))
    touched = _touched_rows(step, workers)
    step.add(
        "server", workers * (shard / FP32 + touched * options.row_bytes / FP32 / servers) * step.compute.add_s_per_param
    )
    step.optimizer((dense + touched * options.row_bytes / FP32) / servers)


def hybrid(step: Step, ranks: int) -> None:
    """The dense part as ddp among the workers; the rows a step touched pushed to and pulled from
    the servers (ids and values), the servers stepping only those rows."""
    options = step.options
    workers = max(ranks - options.servers, 1)
    dense = step.params - options.table_params
    calls = _buckets(dense) * step.grad_calls
    step.add("comm", step.network.time("all_reduce", dense * step.grad_bytes_per_param, workers, calls))
    touched = _touched_rows(step, workers)
    step.optimizer(dense + touched * options.row_bytes / FP32)


def tables(step: Step, ranks: int) -> None:
    """The dense part as ddp over every rank; each micro-batch's rows come from their owners and
    their gradients go back (two all-to-alls: every rank knows every share's ids, so no ids
    travel), (N-1)/N of the lookups remote, and each rank steps the touched rows of its ranges."""
    options = step.options
    dense = step.params - options.table_params
    calls = _buckets(dense) * step.grad_calls
    step.add("comm", step.network.time("all_reduce", dense * step.grad_bytes_per_param, ranks, calls))
    if not options.table_params:
        return
    step.tables_remote = True
    remote = step.micro_samples * options.rows_per_sample * (ranks - 1) / ranks
    step.add("comm", step.micro * 2 * step.network.time("p2p", remote * options.row_bytes, 2))
    touched = min(step.micro_samples * step.micro * ranks * options.rows_per_sample, options.table_rows) / ranks
    step.optimizer(dense + touched * options.row_bytes / FP32)


def _touched_rows(step: Step, workers: int) -> float:
    """Rows of the sparse tables a step looks up (at most all of them), their ids and values pushed
    to the servers and pulled back by every worker; the tables' whole gradients are then no
    worker's work."""
    options = step.options
    if not options.table_params:
        return 0.0
    step.tables_remote = True
    rows = min(step.micro_samples * step.micro * options.rows_per_sample, options.table_rows)
    step.add("comm", 2 * workers * step.network.time("p2p", rows * (options.row_bytes + 8) / options.servers, 2))
    return rows
