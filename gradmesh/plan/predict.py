"""A candidate's predicted step: its time in parts, its memory per rank, and what follows from them
(samples/s, time and cost to train the data volume, speed-up over one worker).

The step is built by the plan's registry rows (`gradmesh.plan.costs`); the parts that run on the
cores are then slowed by what N processes at once cost each of them, as calibrated on this
machine (`compute.co_running`: shared hyperthreads, caches and memory bandwidth, and too few
cores); without that figure, N workers of T threads on C cores run at C / (N x T) of their
calibrated speed when N x T > C.
"""

import math
from dataclasses import dataclass, field

import torch

from gradmesh import config as configuration
from gradmesh.optim import optimizer_slots
from gradmesh.parallel import registry
from gradmesh.plan import costs
from gradmesh.plan.arithmetic import method_of
from gradmesh.plan.candidates import Candidate, data_ranks
from gradmesh.plan.compute import ComputeProfile

SHARED_PARTS = ("compute", "bubble", "optimizer", "server", "loop", "framework", "compress")
"""Parts that run on the cores (and slow down when the workers oversubscribe them)."""
BOTTLENECK_WORDS = {
    "compute": "compute-bound",
    "comm": "communication-bound",
    "bubble": "pipeline bubble",
    "optimizer": "optimizer step",
    "server": "server-bound",
    "loop": "the training loop's own work",
    "framework": "the strategy's machinery",
    "compress": "compression's arithmetic",
}


@dataclass(frozen=True)
class Machine:
    """Where the job would run."""

    nproc: int
    nnodes: int = 1
    cores: int = 1
    memory_per_rank: float | None = None
    """Bytes one rank can hold (a GPU's, or the machine's RAM shared by its ranks)."""
    cuda: bool = False
    price_per_hour: float | None = None
    """Per worker (rank)."""
    omp_threads: int | None = None
    """The user's OMP_NUM_THREADS, which the launcher gives every worker instead of a share."""

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    def threads(self, local: int) -> int:
        """A worker's threads when `local` share the machine, as the launcher gives them."""
        return self.omp_threads or max(1, self.cores // local)


@dataclass
class Prediction:
    candidate: Candidate
    plan: str
    step_s: float
    parts: dict[str, float]
    state_bytes: float
    activation_bytes: float
    peak_bytes: float
    fits: bool
    samples_per_s: float
    train_s: float
    world: int
    speedup: float = 1.0
    efficiency: float = 1.0
    cost: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def bottleneck(self) -> str:
        part = max(self.parts, key=lambda k: self.parts[k])
        return f"{BOTTLENECK_WORDS.get(part, part)} ({self.parts[part] / self.step_s:.0%})"


def wire_of(compression: str, shapes: dict[str, tuple[int, ...]]) -> tuple[float, int]:
    """(bytes per gradient element on the wire, collective calls per reduction) under
    `compression`, in its steady state."""
    from gradmesh.comm.compress import reducer_for

    reducer = reducer_for(compression)
    params = sum(math.prod(s) for s in shapes.values())
    if reducer is None or not params:
        return costs.FP32, 1
    if hasattr(reducer, "seen"):
        reducer.seen = {name: 1 << 30 for name in shapes}  # past any plain start-up steps
    flat = torch.empty(params, device="meta")
    parts = [(name, torch.Size(s)) for name, s in shapes.items()]
    return reducer.wire_bytes(flat, parts) / params, reducer.collectives(flat, parts)


def _model_size(cfg: configuration.Config, profile: ComputeProfile, options: costs.Options) -> registry.ModelSize:
    from gradmesh.optim import optimizer_spec

    optimizer_class, kwargs = optimizer_spec(cfg.train)
    return registry.ModelSize(
        params=profile.params,
        slots=optimizer_slots(optimizer_class, kwargs),
        tp_params=options.tp_params,
        table_params=options.table_params,
        whole_tables=options.whole_tables,
    )


@dataclass(frozen=True)
class Inputs:
    """What every prediction of one plan reads: the job, its calibration and where it would run."""

    cfg: configuration.Config
    profiles: dict[int, ComputeProfile]
    """The compute calibration, by threads per worker."""
    network: costs.Network
    machine: Machine
    options: costs.Options
    shapes: dict[str, tuple[int, ...]]
    overheads: dict[str, float] = field(default_factory=dict)
    """The training loop's seconds per step ("loop") and each strategy's per micro-batch pass."""


def apply_rows(step: costs.Step, plan: registry.Plan) -> costs.Step:
    """The plan's rows shape `step` in composition order, each over its axis's group of ranks as
    the row-major mesh places it (later axes contiguous); the compute they leave is added last."""
    network, axes = step.network, list(plan.mesh)
    for row in plan.rows:
        assert row.cost is not None, row.name  # every row has a cost function (tests/test_architecture.py)
        step.network = network.along(math.prod(plan.mesh[axis] for axis in axes[axes.index(row.axis) + 1 :]))
        registry.load(row.cost)(step, plan.mesh[row.axis])
    step.network = network
    step.add("compute", step.micro * step.pass_s())
    return step


def _step(inputs: Inputs, candidate: Candidate, plan: registry.Plan) -> costs.Step:
    """One rank's step as the plan's rows shape it, compute added last."""
    profile = inputs.profiles[inputs.machine.threads(inputs.machine.nproc)]
    workers = data_ranks(plan, inputs.options.servers)
    step = costs.Step(
        compute=profile,
        network=inputs.network,
        options=inputs.options,
        micro_samples=inputs.cfg.train.global_batch_size / (workers * candidate.grad_accum),
        micro=candidate.grad_accum,
        params=profile.params,
    )
    step.grad_bytes_per_param, step.grad_calls = wire_of(candidate.compression, inputs.shapes)
    apply_rows(step, plan)
    step.add("compress", inputs.overheads.get(method_of(candidate.compression), 0.0) * step.reduced_share)
    step.add("loop", _loop_s(inputs, step))
    step.add("framework", candidate.grad_accum * sum(inputs.overheads.get(row.name, 0.0) for row in plan.rows))
    if inputs.machine.world > 1:  # what each row's machinery adds at N ranks (residuals.world_residuals)
        step.add("framework", sum(inputs.overheads.get(f"world:{row.name}", 0.0) for row in plan.rows))
        step.add("comm", (step.grad_calls - 1) * inputs.overheads.get("world_call_s", 0.0))  # residuals._sync_point
    # the servers' machinery per step (residuals.server_machinery; per micro-batch: just above)
    step.add("framework", sum(inputs.overheads.get(f"server:{row.name}", 0.0) for row in plan.rows))
    if step.parts["framework"] < 0:  # the residuals say this plan's machinery costs less than the loop's
        step.parts["loop"] = max(step.parts["loop"] + step.parts.pop("framework"), 0.0)
    return step


def _loop_s(inputs: Inputs, step: costs.Step) -> float:
    """The training loop's own seconds: fixed, the passes over the gradients this rank holds (not
    the sparse tables' when servers hold them), and what N workers add."""
    held = step.params - (inputs.options.table_params * step.reduced_share if step.tables_remote else 0.0)
    return (
        inputs.overheads.get("loop", 0.0)
        + inputs.overheads.get("loop_s_per_param", 0.0) * held
        + inputs.overheads.get("world_loop", 0.0) * (inputs.machine.world > 1)
    )


def predict(inputs: Inputs, candidate: Candidate, plan: registry.Plan) -> Prediction:
    machine, step = inputs.machine, _step(inputs, candidate, plan)
    profile = step.compute
    # Every local rank runs at once (a server receives and sums while its workers compute): the
    # calibrated slowdown of that many processes at once, which includes sharing too few cores;
    # without one, the cores' share alone.
    shared = max(1.0, machine.nproc * profile.threads / machine.cores)
    oversubscribed = inputs.overheads.get("co_running", shared) if machine.nproc > 1 else 1.0
    parts = {k: v * (oversubscribed if k in SHARED_PARTS else 1.0) for k, v in step.parts.items() if v > 0}
    step_s = sum(parts.values())
    state = plan.state_bytes(_model_size(inputs.cfg, profile, inputs.options))
    activations = profile.activation_bytes_per_sample * step.micro_samples * step.compute_share * step.in_flight
    peak = inputs.overheads.get("base_bytes", profile.base_bytes) + state + activations
    return Prediction(
        candidate=candidate,
        plan=plan.label,
        step_s=step_s,
        parts=parts,
        state_bytes=state,
        activation_bytes=activations,
        peak_bytes=peak,
        fits=machine.memory_per_rank is None or peak <= machine.memory_per_rank,
        samples_per_s=inputs.cfg.train.global_batch_size / step_s,
        train_s=0.0,
        world=machine.world,
    )


def settle(predictions: list[Prediction], single_s: float, samples: int, machine: Machine) -> None:
    """Fill in what needs every prediction or the one-worker baseline: time and cost to train
    `samples`, speed-up over one worker taking `single_s` per step, its efficiency."""
    for p in predictions:
        p.train_s = samples / p.samples_per_s
        p.speedup = single_s / p.step_s
        p.efficiency = p.speedup / p.world
        if machine.price_per_hour is not None:
            p.cost = p.train_s / 3600 * machine.price_per_hour * p.world
