"""The configuration's sections: keyword-only dataclasses, each field documented and checked in
`__post_init__`; checks that need more than one section (or the world size) live in
`Config.check_world`."""

import dataclasses
from dataclasses import dataclass, field

import tomli_w

from gradmesh.config import checks as _checks
from gradmesh.config.balance import parse_balance
from gradmesh.config.checks import finite as _finite
from gradmesh.config.checks import one_of as _one_of
from gradmesh.config.checks import positive as _positive
from gradmesh.config.compression import parse_compression
from gradmesh.config.fault import RECOVERY, FaultConfig  # noqa: F401 (re-exported)
from gradmesh.config.ps import PSConfig
from gradmesh.config.rl import RLConfig
from gradmesh.config.workload import DataConfig, ModelConfig
from gradmesh.errors import UsageError
from gradmesh.paths import check_name

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
TABLE_SHARDINGS = ("row", "table")
OPTIMIZERS = ("adamw", "sgd")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(kw_only=True)
class TrainConfig:
    """The optimisation: batch, optimizer, schedule, strategy."""

    strategy: str = "ddp"
    """Parallelism strategy, a row of the strategy registry (`gradmesh.parallel.registry`): ddp, zero1
    (optimizer state sharded), fsdp (everything sharded), tp (tensor parallel), pipeline, ps (parameter
    servers) or hybrid (sparse tables on servers, the dense part all-reduced); checked there."""
    mesh: str = ""
    """Named device mesh composing strategies, e.g. "dp=2,tp=2", "fsdp=2,tp=2" or "dp=2,pp=2" (empty: the
    strategy alone)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved (1F1B with two stages per rank)."""
    microbatches: int = 4
    """Micro-batches each pipeline cuts its share of a batch into."""
    pp_split: str = ""
    """Manual pipeline cut: comma-separated units that begin stages 1, 2, ... e.g. "h.2" (empty: balanced by
    measured cost)."""
    table_sharding: str = "row"
    """--strategy tables: row (each sparse table split in even row ranges over every rank) or table (each
    table whole on one rank, placed greedily by size)."""
    global_batch_size: int = 32
    """Samples per optimizer step summed over all ranks and micro-batches."""
    grad_accum: int = 1
    """Micro-batches per rank per optimizer step."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB for DDP's all-reduce (DDP's own default: 25); 0 (--bucket-mb auto): a few
    sizes timed over the first steps, the fastest kept."""
    balance: str = "off"
    """How each global batch is split among data-parallel ranks: off (equal shares), auto (by measured
    speed, re-split every few steps) or static:S1,S2,... (fixed proportions); every split trains the same model."""
    compression: str = "none"
    """How data-parallel gradients travel: none (fp32), fp16 or bf16 (half the bytes), powersgd:rank=R[,start=N]
    (low-rank, with error feedback, after N plain steps), topk:ratio=K[,start=N] (the largest K of each gradient,
    with error feedback) or auto (chosen from a link probe after step 2)."""
    optimizer: str = "adamw"
    """adamw or sgd."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 (sgd)."""
    momentum: float = 0.9
    """SGD momentum."""
    table_lr: float = 0.1
    """Learning rate of the embedding tables, which train with row-wise Adagrad (recsys)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    decay_steps: int = 1500
    """Length of the cosine decay; independent of max_steps so a cut-short run resumes on the same schedule."""
    max_steps: int = 1500
    """Optimizer steps to run (the run stops here)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
    seed: int = 0
    """Seed for model initialisation and the global sample order."""
    log_every: int = 10
    """Gather every rank's per-step figures every N steps (metrics.jsonl still gets every step)."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    sample_chars: int = 300
    """Characters generated at the end of a gpt-char run (0: none)."""
    record_samples: bool = False
    """Write the sample indices each rank consumed per step to samples-rank{R}.jsonl."""

    def __post_init__(self):
        _finite(self)
        _one_of("train", "optimizer", self.optimizer, OPTIMIZERS)
        parse_compression(self.compression)
        parse_balance(self.balance)
        _one_of("train", "pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _one_of("train", "table_sharding", self.table_sharding, TABLE_SHARDINGS)
        for name in (
            "global_batch_size",
            "grad_accum",
            "microbatches",
            "max_steps",
            "decay_steps",
            "eval_batches",
            "log_every",
        ):
            _positive("train", name, getattr(self, name))
        for name in ("warmup_steps", "eval_every", "sample_chars", "weight_decay", "grad_clip"):
            _positive("train", name, getattr(self, name), allow_zero=True)
        if not 0 <= self.seed < 2**63:
            raise UsageError(f"train.seed must be in [0, 2^63), got {self.seed}")
        if not 0 <= self.bucket_mb < 1e6:
            raise UsageError(f"train.bucket_mb must be > 0 (MiB, e.g. 25) or 0 (auto), got {self.bucket_mb}")
        if self.lr <= 0 or self.min_lr < 0:
            raise UsageError(f"train.lr must be > 0 and train.min_lr >= 0, got {self.lr}, {self.min_lr}")
        if self.table_lr <= 0:
            raise UsageError(f"train.table_lr must be > 0 (the tables' row-wise Adagrad), got {self.table_lr}")
        _checks.fraction("train", "momentum", self.momentum)  # torch refuses < 0 only after launch

    @property
    def split_points(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.pp_split.split(",") if part.strip())


@dataclass(kw_only=True)
class CheckpointConfig:
    """When to write checkpoints and whether to start from one."""

    every: int = 0
    """Write a checkpoint every N optimizer steps (0: only at the end)."""
    keep: int = 3
    """Keep the newest N checkpoints (0 keeps all)."""
    resume: bool = False
    """Continue from the latest intact checkpoint in the run directory."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on."""

    def __post_init__(self):
        _finite(self)
        _positive("checkpoint", "every", self.every, allow_zero=True)
        _positive("checkpoint", "keep", self.keep, allow_zero=True)


@dataclass(kw_only=True)
class MonitorConfig:
    """Observability: step breakdown, stragglers, replica checks, timeline and exports."""

    enabled: bool = True
    """Per-rank step breakdown, straggler detection and replica checks (false: plain metrics only)."""
    straggler_margin: float = 0.5
    """A rank is a straggler when its busy time per step exceeds the other ranks' median by this fraction..."""
    straggler_steps: int = 5
    """...for this many consecutive steps."""
    check_every: int = 50
    """Compare a checksum of every parameter across data-parallel replicas every N steps; 0: never."""
    trace_steps: str = ""
    """A:B writes trace.json (Chrome/Perfetto format) with every rank's phases and collectives of steps A..B
    (at most 200)."""
    tensorboard: bool = False
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    prometheus_port: int = 0
    """Serve Prometheus metrics on http://127.0.0.1:PORT/metrics (rank 0); 0: off."""

    def __post_init__(self):
        _finite(self)
        if self.straggler_margin <= 0:
            raise UsageError(
                f"monitor.straggler_margin must be > 0 (a fraction, e.g. 0.5), got {self.straggler_margin}"
            )
        _positive("monitor", "straggler_steps", self.straggler_steps)
        _positive("monitor", "check_every", self.check_every, allow_zero=True)
        if not 0 <= self.prometheus_port <= 65535:
            raise UsageError(
                f"monitor.prometheus_port must be a port number 1..65535 (or 0: off), got {self.prometheus_port}"
            )
        if self.trace_steps:
            _checks.trace_steps(self.trace_steps)


@dataclass(kw_only=True)
class LaunchConfig:
    """How many workers, where, and on what device (torchrun's options)."""

    nproc: int = 0
    """Workers on this machine; 0 means auto (one per GPU, else 2 on CPU, 1 on a single core)."""
    nnodes: int = 1
    """Machines in the job."""
    node_rank: int = -1
    """This machine's rank for static rendezvous; -1 lets the rendezvous assign it."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous (multi-node)."""
    rdzv_id: str = "gradmesh"
    """Job id shared by all nodes (give each job its own). One machine: a random id per run."""
    rdzv_backend: str = ""
    """c10d or static; empty picks static when node_rank is given, else c10d."""
    rdzv_conf: str = ""
    """Extra rendezvous settings, key=value,... (torchrun's --rdzv-conf), e.g. is_host=true,join_timeout=600."""
    iface: str = ""
    """Network interface for gloo/NCCL and this node's address (multi-node); empty: the one the route to the
    endpoint uses."""
    local_addr: str = ""
    """This node's address as the others reach it (torchrun's --local-addr); empty: the interface's."""
    device: str = "auto"
    """auto (CUDA with NCCL where present, else CPU with gloo), cpu or cuda."""
    memory_per_rank_mb: float = 0.0
    """Memory one rank may use, in MiB, for the pre-launch memory check and `gradmesh plan` (0: each GPU's,
    or this machine's RAM shared by its ranks)."""

    def __post_init__(self):
        _finite(self)
        _positive("launch", "nproc", self.nproc, allow_zero=True)
        _positive("launch", "memory_per_rank_mb", self.memory_per_rank_mb, allow_zero=True)
        _positive("launch", "nnodes", self.nnodes)
        _one_of("launch", "device", self.device, DEVICES)
        _one_of("launch", "rdzv_backend", self.rdzv_backend, ("", "c10d", "static"))
        _checks.rendezvous(self)


@dataclass(kw_only=True)
class RunConfig:
    """Where results go and how much is printed."""

    dir: str = "runs/latest"
    """Run directory: config, metrics, summary, checkpoints, final weights. The default starts each
    fresh run in a new folder under runs/ with runs/latest pointing at it (and resumes runs/latest)."""
    overwrite: bool = False
    """A fresh run may replace an earlier gradmesh run that has checkpoints in the run directory."""
    quiet: bool = False
    """No progress bar or summary table (errors are still printed)."""

    def __post_init__(self):
        if not self.dir.strip():
            raise UsageError("run.dir is empty: give --run-dir DIR, a folder for this run's files")
        check_name(self.dir, "run.dir")


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def check_world(self, dp_size: int) -> None:
        """Checks that need the number of data-parallel ranks (those that split each batch)."""
        per_step = dp_size * self.train.grad_accum
        if self.train.global_batch_size % per_step:
            raise UsageError(
                f"train.global_batch_size={self.train.global_batch_size} is not divisible by "
                f"data-parallel ranks x grad_accum = {dp_size} x {self.train.grad_accum} = {per_step}; "
                f"use a multiple of {per_step}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())
