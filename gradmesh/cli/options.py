"""What the commands share: the parser whose mistakes are one line, torchrun's launch options, the
flag -> config-key table, config resolution and the argument types that name their bad value."""

import argparse
import math
from pathlib import Path

from gradmesh import config as configuration
from gradmesh.config.fault import AUTO_STEP_TIMEOUT
from gradmesh.errors import UsageError
from gradmesh.paths import checked

# Command-line flag -> config key. Flags left out stay None and do not override.
FLAG_KEYS = {
    "model": "model.name",
    "data": "data.path",
    "strategy": "train.strategy",
    "mesh": "train.mesh",
    "ps_servers": "ps.servers",
    "ps_mode": "ps.mode",
    "ps_shares": "ps.shares",
    "learners": "rl.learners",
    "pp_schedule": "train.pp_schedule",
    "microbatches": "train.microbatches",
    "pp_split": "train.pp_split",
    "table_sharding": "train.table_sharding",
    "global_batch_size": "train.global_batch_size",
    "grad_accum": "train.grad_accum",
    "bucket_mb": "train.bucket_mb",
    "balance": "train.balance",
    "compression": "train.compression",
    "optimizer": "train.optimizer",
    "lr": "train.lr",
    "max_steps": "train.max_steps",
    "seed": "train.seed",
    "eval_every": "train.eval_every",
    "record_samples": "train.record_samples",
    "checkpoint_every": "checkpoint.every",
    "resume": "checkpoint.resume",
    "async_checkpoint": "checkpoint.async_save",
    "recovery": "fault.recovery",
    "max_restarts": "fault.max_restarts",
    "step_timeout": "fault.step_timeout",
    "on_nonfinite": "fault.on_nonfinite",
    "inject": "fault.inject",
    "monitor_enabled": "monitor.enabled",
    "check_every": "monitor.check_every",
    "trace_steps": "monitor.trace_steps",
    "tensorboard": "monitor.tensorboard",
    "prometheus_port": "monitor.prometheus_port",
    "run_dir": "run.dir",
    "overwrite": "run.overwrite",
    "quiet": "run.quiet",
    "nproc": "launch.nproc",
    "nnodes": "launch.nnodes",
    "node_rank": "launch.node_rank",
    "rdzv_endpoint": "launch.rdzv_endpoint",
    "rdzv_id": "launch.rdzv_id",
    "rdzv_backend": "launch.rdzv_backend",
    "device": "launch.device",
    "rdzv_conf": "launch.rdzv_conf",
    "iface": "launch.iface",
    "local_addr": "launch.local_addr",
}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit code 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _ascii_number(kind: type):
    """An argparse type like int or float that refuses other scripts' digits (int('١٢') is 12)."""

    def parse(text: str):
        if not text.isascii():
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__} (ASCII digits only)")
        return kind(text)  # a ValueError here is argparse's "invalid int value" line

    parse.__name__ = kind.__name__
    return parse


integer, number = _ascii_number(int), _ascii_number(float)


def bucket_type(text: str) -> float:
    """--bucket-mb: MiB > 0, or 'auto' (0: timed over the first steps)."""
    if text == "auto":
        return 0.0
    try:
        value = number(text)
    except (ValueError, argparse.ArgumentTypeError):
        value = -1.0
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"--bucket-mb must be a size in MiB > 0 (e.g. 25) or 'auto', got {text!r}")
    return value


def timeout_type(text: str) -> float:
    """--step-timeout: seconds >= 0 (0: off), or 'auto'."""
    if text == "auto":
        return AUTO_STEP_TIMEOUT
    try:
        value = number(text)
    except (ValueError, argparse.ArgumentTypeError):
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"--step-timeout must be 'auto', 0 (off) or seconds > 0, got {text!r}")
    return value


def add_failure_options(train: argparse.ArgumentParser) -> None:
    faults = train.add_argument_group("failures")
    faults.add_argument(
        "--recovery",
        choices=configuration.RECOVERY,
        help="restart: every worker restarts from the latest checkpoint; inplace: the survivors "
        "go on from the current step (ddp and ps, one machine; under ps a lost server "
        "restarts every rank) (default none)",
    )
    faults.add_argument(
        "--max-restarts",
        type=integer,
        metavar="K",
        help="restart: worker-group restarts allowed; inplace: replacement workers started for lost ones "
        "(ps: restarts after a lost server); rollback: rollbacks allowed (default 3)",
    )
    faults.add_argument(
        "--step-timeout",
        type=timeout_type,
        metavar="SECONDS",
        help="declare a hang when a step makes no progress this long: stacks dumped, ranks named "
        "(ps: a worker holding a share this long); 'auto' (default): max(300 s, 20x the slowest "
        "step so far); 0: off",
    )
    faults.add_argument(
        "--on-nonfinite",
        choices=configuration.NONFINITE,
        help="a NaN or infinite loss, gradient or push: stop (apply nothing, end the run with exit code "
        "4; default), skip (drop the step's update; stops after fault.max_skips in a row) or "
        "rollback (back to the last intact checkpoint, skipping that step's batch)",
    )
    faults.add_argument(
        "--inject",
        action="append",
        metavar="FAULT",
        help="inject a fault (repeatable): kill:rank=R,step=N[,at=checkpoint], hang:rank=R,step=N, "
        "slow:rank=R,factor=F|delay=S, diverge:rank=R,step=N, memory:rank=R,free_mb=M, "
        "nan:rank=R,step=N[,steps=M]; or a soak of N seeded random "
        "kills, hangs and slow-downs: chaos:faults=N,seed=S[,kinds=kill+hang+slow][,pace=S]",
    )


def nproc_type(text: str) -> int:
    """--nproc: a whole number >= 1, or 'auto' (0: one per GPU, decided at launch)."""
    if text == "auto":
        return 0
    try:
        value = integer(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"--nproc must be a whole number >= 1 or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--nproc must be >= 1 (or 'auto'), got {value}")
    return value


def port_type(text: str) -> int:
    try:
        value = integer(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"--port must be a whole number from 1 to 65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be from 1 to 65535, got {value}")
    return value


def existing_run_dir(text: str) -> Path:
    """The RUN_DIR argument of export, monitor and report."""
    return checked(text, "run dir", "the --run-dir of a gradmesh train run", ("folder",))


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workers (torchrun's options)")
    group.add_argument(
        "--nproc",
        type=nproc_type,
        metavar="N",
        help="workers on this machine, or 'auto' (default: one per GPU, else 2)",
    )
    group.add_argument("--nnodes", type=integer, metavar="N", help="machines in the job (default 1)")
    group.add_argument("--node-rank", type=integer, metavar="R", help="this machine's rank (static rendezvous)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous address for multi-node jobs")
    group.add_argument("--rdzv-id", metavar="ID", help="job id shared by every node")
    group.add_argument("--rdzv-backend", choices=("c10d", "static"), help="rendezvous backend")
    group.add_argument("--rdzv-conf", metavar="K=V,...", help="more rendezvous settings, passed to torchrun")
    group.add_argument(
        "--iface",
        metavar="NAME",
        help="network interface for gloo/NCCL (default: the one that routes to --rdzv-endpoint)",
    )
    group.add_argument(
        "--local-addr", metavar="ADDR", help="this machine's address as the others reach it (default: --iface's)"
    )
    group.add_argument("--device", choices=configuration.DEVICES, help="auto: CUDA+NCCL if present, else CPU+gloo")


def flag_layer(args: argparse.Namespace) -> dict[str, dict]:
    """The config layer of the flags given on the command line (FLAG_KEYS)."""
    layer: dict[str, dict] = {}
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if isinstance(value, list):
            value = ";".join(value)
        if value is not None:
            section, name = key.split(".")
            layer.setdefault(section, {})[name] = value
    return layer


def resolve_config(args: argparse.Namespace) -> configuration.Config:
    layers = []
    run_dir = Path(args.run_dir or configuration.RunConfig().dir)
    saved = run_dir / "config.toml"
    if getattr(args, "resume_if_any", None):  # decided now, at (re)start, not when the job was written
        from gradmesh.fault.checkpoint import complete_checkpoints

        args.resume = True if complete_checkpoints(run_dir) else args.resume
    if args.resume and saved.is_file():
        layers.append(configuration.load_toml(saved))  # continue the run as it was configured
    if args.config:
        layers.append(configuration.load_toml(args.config))
    from gradmesh.cli.scheduler import scheduler_layer

    layers += [scheduler_layer(), flag_layer(args), configuration.parse_sets(args.set)]
    return configuration.build(layers)


def launch_shape(launch: configuration.LaunchConfig) -> tuple[str, int]:
    """(device, workers on this machine), with --nproc auto settled."""
    from gradmesh import env
    from gradmesh.launch.network import check_node
    from gradmesh.topology import auto_nproc, resolve_device

    env.omp_threads()  # the workers' thread count: a bad value is refused here, not at launch
    if launch.rdzv_endpoint:  # several machines: an endpoint that resolves, an interface this one has
        check_node(launch.rdzv_endpoint, launch.iface)
    device = resolve_device(launch.device)
    nproc = launch.nproc or auto_nproc(device)
    if nproc < 1:
        raise UsageError("--nproc auto found no GPU; give --nproc N or --device cpu")
    return device, nproc
