"""The `gradmesh` command: `train` and `run` check everything, then start workers; `export`,
`monitor` and `report` read a run directory.

All input is validated here, before any worker starts: a bad value prints one line naming it
and what is accepted, and exits with code 2.
"""

import argparse
import math
import sys
from pathlib import Path

from gradmesh import config as configuration
from gradmesh import rundir
from gradmesh.parallel import registry
from gradmesh.errors import EXIT_USAGE, UsageError
from gradmesh.fault.inject import check_ranks, parse_faults

RESTART_CHECKPOINT_EVERY = 10
INPLACE_COLLECTIVE_TIMEOUT = 10.0

# Command-line flag -> config key. Flags left out stay None and do not override.
FLAG_KEYS = {
    "model": "model.name", "data": "data.path", "strategy": "train.strategy", "mesh": "train.mesh",
    "pp_schedule": "train.pp_schedule", "microbatches": "train.microbatches", "pp_split": "train.pp_split",
    "global_batch_size": "train.global_batch_size", "grad_accum": "train.grad_accum",
    "optimizer": "train.optimizer", "lr": "train.lr", "max_steps": "train.max_steps",
    "seed": "train.seed", "eval_every": "train.eval_every", "record_samples": "train.record_samples",
    "checkpoint_every": "checkpoint.every", "resume": "checkpoint.resume",
    "async_checkpoint": "checkpoint.async_save",
    "recovery": "fault.recovery", "max_restarts": "fault.max_restarts", "step_timeout": "fault.step_timeout",
    "inject": "fault.inject",
    "monitor_enabled": "monitor.enabled", "check_every": "monitor.check_every", "trace_steps": "monitor.trace_steps",
    "tensorboard": "monitor.tensorboard", "prometheus_port": "monitor.prometheus_port",
    "run_dir": "run.dir", "quiet": "run.quiet",
    "nproc": "launch.nproc", "nnodes": "launch.nnodes", "node_rank": "launch.node_rank",
    "rdzv_endpoint": "launch.rdzv_endpoint", "rdzv_id": "launch.rdzv_id",
    "rdzv_backend": "launch.rdzv_backend", "device": "launch.device",
}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit code 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _nproc(text: str) -> int:
    if text == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nproc must be a whole number >= 1 or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--nproc must be >= 1 (or 'auto'), got {value}")
    return value


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workers (torchrun's options)")
    group.add_argument("--nproc", type=_nproc, metavar="N", help="workers on this machine, or 'auto' (default: one per GPU, else 2)")
    group.add_argument("--nnodes", type=int, metavar="N", help="machines in the job (default 1)")
    group.add_argument("--node-rank", type=int, metavar="R", help="this machine's rank (static rendezvous)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous address for multi-node jobs")
    group.add_argument("--rdzv-id", metavar="ID", help="job id shared by every node")
    group.add_argument("--rdzv-backend", choices=("c10d", "static"), help="rendezvous backend")
    group.add_argument("--device", choices=configuration.DEVICES, help="auto: CUDA+NCCL if present, else CPU+gloo")


def build_parser() -> Parser:
    parser = Parser(prog="gradmesh", description="Distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    train = sub.add_parser("train", help="train a built-in model on N workers",
                           description="Train a built-in workload on N workers: data parallel, sharded, "
                                       "tensor or pipeline parallel, or composed on a mesh.")
    what = train.add_argument_group("what to train")
    what.add_argument("--model", choices=configuration.MODELS, help="built-in model (default gpt-char)")
    what.add_argument("--data", metavar="PATH", help="UTF-8 text file or folder for gpt-char (default: Python's stdlib source)")
    what.add_argument("--config", metavar="FILE", help="TOML config file (sections model, data, train, checkpoint, launch, run)")
    what.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key, e.g. model.n_layer=8 (repeatable)")
    how = train.add_argument_group("how to train")
    how.add_argument("--strategy", choices=registry.STRATEGIES, help="parallelism (default ddp)")
    how.add_argument("--mesh", metavar="AXIS=N,...", help="compose strategies on a named mesh: dp=2,tp=2, fsdp=2,tp=2 or dp=2,pp=2")
    how.add_argument("--pp-schedule", choices=configuration.PP_SCHEDULES, help="pipeline schedule (default 1f1b)")
    how.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per pipeline step (default 4)")
    how.add_argument("--pp-split", metavar="UNIT,...", help="manual pipeline cut, e.g. h.2 (default: balanced by measured cost)")
    how.add_argument("--global-batch-size", type=int, metavar="B", help="samples per optimizer step over all ranks (default 32)")
    how.add_argument("--grad-accum", type=int, metavar="K", help="micro-batches per rank per step (default 1)")
    how.add_argument("--optimizer", choices=configuration.OPTIMIZERS, help="default adamw")
    how.add_argument("--lr", type=float, help="peak learning rate")
    how.add_argument("--max-steps", type=int, metavar="N", help="optimizer steps to run (default 600)")
    how.add_argument("--seed", type=int)
    how.add_argument("--eval-every", type=int, metavar="N", help="held-out evaluation every N steps (default: at the end)")
    run = train.add_argument_group("run directory")
    run.add_argument("--run-dir", metavar="DIR", help="where config, metrics, checkpoints and weights go (default runs/latest)")
    run.add_argument("--checkpoint-every", type=int, metavar="N", help="checkpoint every N steps (default: at the end)")
    run.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint in --run-dir")
    run.add_argument("--async-checkpoint", action="store_true", default=None, help="write checkpoints in the background")
    run.add_argument("--record-samples", action="store_true", default=None, help="log each rank's sample indices per step")
    faults = train.add_argument_group("failures")
    faults.add_argument("--recovery", choices=configuration.RECOVERY,
                        help="restart: every worker restarts from the latest checkpoint; inplace: the survivors "
                             "go on from the current step (ddp, one machine) (default none)")
    faults.add_argument("--max-restarts", type=int, metavar="K", help="restart: worker-group restarts allowed; inplace: replacement workers started for lost ones (default 3)")
    faults.add_argument("--step-timeout", type=float, metavar="SECONDS",
                        help="declare a hang when a step makes no progress this long: stacks dumped, ranks named (default off)")
    faults.add_argument("--inject", action="append", metavar="FAULT",
                        help="inject a fault (repeatable): kill:rank=R,step=N[,at=checkpoint], hang:rank=R,step=N, "
                             "slow:rank=R,factor=F|delay=S, diverge:rank=R,step=N")
    watch = train.add_argument_group("monitoring (see gradmesh monitor / gradmesh report)")
    watch.add_argument("--no-monitor", dest="monitor_enabled", action="store_false", default=None,
                       help="no per-rank step breakdown, straggler detection or replica checks")
    watch.add_argument("--check-every", type=int, metavar="N",
                       help="compare parameter checksums across data-parallel replicas every N steps (default 50; 0: never)")
    watch.add_argument("--trace-steps", metavar="A:B", help="write trace.json (Chrome/Perfetto) of steps A..B on every rank")
    watch.add_argument("--tensorboard", action="store_true", default=None, help="write TensorBoard event files to RUN_DIR/tensorboard")
    watch.add_argument("--prometheus-port", type=int, metavar="P", help="serve Prometheus metrics on 127.0.0.1:P/metrics")
    run.add_argument("--quiet", action="store_true", default=None, help="no progress bar or summary table")
    _add_launch_options(train)

    script = sub.add_parser("run", help="run your own torch.distributed script on N workers",
                            description="Run SCRIPT.py on N workers, as torchrun would (options before the script).")
    _add_launch_options(script)
    script.add_argument("script", metavar="SCRIPT.py")
    script.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...")
    exporter = sub.add_parser("export", help="write one unsharded .safetensors file from a checkpoint",
                              description="Export a checkpoint (any strategy, any world size) as one unsharded safetensors file.")
    exporter.add_argument("run_dir", metavar="RUN_DIR")
    exporter.add_argument("--step", type=int, metavar="N", help="checkpoint step (default: the latest)")
    exporter.add_argument("--out", required=True, metavar="FILE.safetensors")
    _add_monitor_commands(sub)
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be a whole number from 1 to 65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be from 1 to 65535, got {value}")
    return value


def _add_monitor_commands(sub) -> None:
    monitor = sub.add_parser("monitor", help="live web dashboard of a run directory",
                             description="Serve a live dashboard of RUN_DIR: loss, throughput, where each rank's step "
                                         "time goes, memory per rank, and straggler and divergence alerts. Works while "
                                         "the run trains (updates every second) and after it has finished. Stop with Ctrl-C.")
    monitor.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a gradmesh train run")
    monitor.add_argument("--port", type=_port, default=8265, metavar="P", help="port to listen on (default 8265)")
    monitor.add_argument("--host", default="127.0.0.1", metavar="H",
                         help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 exposes the "
                              "dashboard to the network)")
    report = sub.add_parser("report", help="write a static HTML report with plots of a run directory",
                            description="Write RUN_DIR/report.html with PNG plots in RUN_DIR/report/: loss, throughput, "
                                        "step-time breakdown and memory per rank, a summary table and the alerts. "
                                        "Prints the path of report.html.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a gradmesh train run")


def _flag_layer(args: argparse.Namespace) -> dict[str, dict]:
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
    if args.resume and saved.is_file():
        layers.append(configuration.load_toml(saved))  # continue the run as it was configured
    if args.config:
        layers.append(configuration.load_toml(args.config))
    layers += [_flag_layer(args), configuration.parse_sets(args.set)]
    return configuration.build(layers)


def _launch_shape(launch: configuration.LaunchConfig) -> tuple[str, int]:
    from gradmesh.topology import auto_nproc, resolve_device

    device = resolve_device(launch.device)
    nproc = launch.nproc or auto_nproc(device)
    if nproc < 1:
        raise UsageError("--nproc auto found no GPU; give --nproc N or --device cpu")
    return device, nproc


def _check_resume(cfg: configuration.Config, run_dir: Path) -> None:
    from gradmesh import workloads
    from gradmesh.fault import checkpoint
    from gradmesh.worker import run_info

    if not checkpoint.complete_checkpoints(run_dir):
        raise UsageError(f"--resume: no complete checkpoint in {str(run_dir / 'checkpoints')!r}; run without --resume first")
    latest = checkpoint.latest_good_checkpoint(run_dir, warn=lambda text: print(text, file=sys.stderr))
    if latest is None:
        raise UsageError(f"--resume: every checkpoint in {str(run_dir / 'checkpoints')!r} is damaged; start a fresh run")
    problems = checkpoint.shape_mismatches(checkpoint.saved_shapes(latest), workloads.model_shapes(cfg))
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise UsageError(f"--resume: {latest} does not fit this model: " + "; ".join(problems[:4]) + more)
    saved = checkpoint.read_state(latest).get("run", {})
    now = run_info(cfg)
    diffs = [f"{key}: checkpoint {saved.get(key)!r} vs now {now[key]!r}"
             for key in now if saved.get(key) != now[key]]
    if diffs:
        raise UsageError(f"--resume: config incompatible with {latest}: " + "; ".join(diffs))


def _start_fresh(run_dir: Path, quiet: bool) -> None:
    if rundir.clear_previous_run(run_dir) and not quiet:
        print(f"gradmesh: starting a fresh run in {run_dir} (the previous run's files were replaced; "
              "--resume continues a run instead)", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> int:
    from gradmesh import workloads
    from gradmesh.launch import run_workers

    cfg = resolve_config(args)
    _, nproc = _launch_shape(cfg.launch)
    world = nproc * cfg.launch.nnodes
    mesh = registry.mesh_for(cfg.train.strategy, world, cfg.train.mesh)
    plan = registry.resolve(cfg.train.strategy, mesh)
    product = math.prod(mesh.values())
    if product != world:
        raise UsageError(f"--mesh {cfg.train.mesh!r} spans {product} ranks but the job has {world} "
                         f"({nproc} per node x {cfg.launch.nnodes} nodes); make the product {world}")
    cfg.check_world(mesh.get("dp", 1) * mesh.get("fsdp", 1))
    plan.check(cfg, lambda: workloads.meta_model(cfg))
    check_ranks(parse_faults(cfg.fault.inject), world)
    if cfg.fault.recovery == "inplace" and (not plan.inplace_recovery or cfg.launch.nnodes > 1):
        raise UsageError("--recovery inplace supports --strategy ddp on one machine (a lost rank's shard of "
                         "sharded, tensor- or pipeline-parallel state is gone); use --recovery restart")
    if cfg.fault.recovery == "restart" and not cfg.checkpoint.every:
        cfg.checkpoint.every = RESTART_CHECKPOINT_EVERY  # a restart must have something recent to resume
    workloads.check_inputs(cfg)
    run_dir = rundir.ensure_writable(cfg.run.dir)
    if cfg.checkpoint.resume:
        _check_resume(cfg, run_dir)
    else:
        _start_fresh(run_dir, cfg.run.quiet)
    config_path = run_dir / "config.toml"
    config_path.write_text(cfg.to_toml())
    restarts = cfg.fault.max_restarts if cfg.fault.recovery != "none" else 0
    return run_workers(cfg.launch, nproc, ["-m", "gradmesh.worker", str(config_path)], max_restarts=restarts,
                       inplace=(cfg.fault.step_timeout or INPLACE_COLLECTIVE_TIMEOUT) if cfg.fault.recovery == "inplace" else 0.0)


def cmd_run(args: argparse.Namespace) -> int:
    from gradmesh.launch import run_workers

    if not Path(args.script).is_file():
        raise UsageError(f"script {args.script!r} does not exist; usage: gradmesh run [options] SCRIPT.py [args]")
    launch = configuration.build([_flag_layer(args)]).launch
    _, nproc = _launch_shape(launch)
    return run_workers(launch, nproc, [args.script, *args.script_args])


def cmd_export(args: argparse.Namespace) -> int:
    from gradmesh.export import export

    if not Path(args.run_dir).is_dir():
        raise UsageError(f"run dir {args.run_dir!r} does not exist")
    path, count = export(args.run_dir, args.out, args.step)
    print(f"wrote {count} tensors from {path} to {args.out}")
    return 0


def _existing_run_dir(text: str) -> Path:
    if not Path(text).is_dir():
        raise UsageError(f"run dir {text!r} does not exist; give the --run-dir of a gradmesh train run")
    return Path(text)


def cmd_monitor(args: argparse.Namespace) -> int:
    from gradmesh.monitor.dashboard import serve

    run_dir = _existing_run_dir(args.run_dir)
    serve(run_dir, args.host, args.port,
          on_ready=lambda url: print(f"gradmesh monitor: {run_dir} at {url} (Ctrl-C to stop)", flush=True))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from gradmesh.monitor.report import write_report

    print(write_report(_existing_run_dir(args.run_dir)))
    return 0


COMMANDS = {"train": cmd_train, "run": cmd_run, "export": cmd_export, "monitor": cmd_monitor, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        code = COMMANDS[args.command](args)
    except UsageError as err:
        print(f"gradmesh: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gradmesh: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
