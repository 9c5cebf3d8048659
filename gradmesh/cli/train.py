"""`gradmesh train`: its options, the checks that can fail before any worker starts
(`check_train`), and the launch of the workers."""

import argparse
import functools
import math
import socket
import sys
from pathlib import Path

from gradmesh import config as configuration
from gradmesh import env, rundir
from gradmesh.config.fault import AUTO_TIMEOUT_CAP
from gradmesh.runlock import RunLock
from gradmesh.cli.memory import check_memory
from gradmesh.cli.options import add_failure_options, add_launch_options, bucket_type, integer, launch_shape, number, resolve_config
from gradmesh.config.balance import parse_balance
from gradmesh.config.compression import parse_compression
from gradmesh.config.ps import check_ps_options_need_ps
from gradmesh.errors import NothingToDo, UsageError
from gradmesh.files import atomic_write
from gradmesh.mesh import DATA_AXES
from gradmesh.monitor.monitor import parse_trace_steps
from gradmesh.parallel import registry
from gradmesh.chaos import check_chaos, parse_inject
from gradmesh.specs import check_memory_faults, check_ranks

RESTART_CHECKPOINT_EVERY = 10
INPLACE_COLLECTIVE_TIMEOUT = 10.0
COLLECTIVE_MARGIN_S = 300.0


def add_parser(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a built-in model on N workers",
                                  description="Train a built-in workload on N workers: data parallel, sharded, "
                                              "tensor or pipeline parallel, composed on a mesh, or with parameter servers.")
    _add_what_options(train)
    _add_how_options(train)
    run = _add_run_options(train)
    add_failure_options(train)
    _add_monitoring_options(train)
    # Added after the monitoring options so that the usage line lists it where it always has.
    run.add_argument("--quiet", action="store_true", default=None, help="no progress bar or summary table")
    add_launch_options(train)


def _add_what_options(train: argparse.ArgumentParser) -> None:
    what = train.add_argument_group("what to train")
    what.add_argument("--model", choices=configuration.MODELS, help="built-in model (default gpt-char)")
    what.add_argument("--data", metavar="PATH", help="UTF-8 text file or folder for gpt-char (default: Python's stdlib source)")
    what.add_argument("--config", metavar="FILE", help="TOML config file (sections model, data, train, checkpoint, launch, run)")
    what.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key, e.g. model.n_layer=8 (repeatable)")


def _add_how_options(train: argparse.ArgumentParser) -> None:
    how = train.add_argument_group("how to train")
    how.add_argument("--strategy", choices=tuple(registry.STRATEGIES), help="parallelism (default ddp)")
    how.add_argument("--mesh", metavar="AXIS=N,...", help="compose strategies on a named mesh: dp=2,tp=2, fsdp=2,tp=2 or dp=2,pp=2")
    how.add_argument("--ps-servers", type=integer, metavar="S", help="--strategy ps or hybrid: ranks that hold the parameters (hybrid: the sparse tables; default 1)")
    how.add_argument("--ps-mode", metavar="MODE", help="--strategy ps or hybrid: sync, async (ps) or ssp:K (default sync)")
    how.add_argument("--ps-shares", type=integer, metavar="N", help="--strategy ps, async and ssp:K >= 1: shares per worker "
                     "per step, each its own update (default 2; at most 64 and the samples per worker; more: smaller "
                     "updates, less staleness)")
    how.add_argument("--pp-schedule", choices=configuration.PP_SCHEDULES, help="pipeline schedule (default 1f1b)")
    how.add_argument("--microbatches", type=integer, metavar="M", help="micro-batches per pipeline step (default 4)")
    how.add_argument("--pp-split", metavar="UNIT,...", help="manual pipeline cut, e.g. h.2 (default: balanced by measured cost)")
    how.add_argument("--global-batch-size", type=integer, metavar="B", help="samples per optimizer step over all ranks (default 32)")
    how.add_argument("--grad-accum", type=integer, metavar="K", help="micro-batches per rank per step (default 1)")
    how.add_argument("--optimizer", choices=configuration.OPTIMIZERS, help="default adamw")
    how.add_argument("--balance", metavar="HOW",
                     help="split each global batch by rank speed: off (equal, default), auto (measured, re-split every "
                          "few steps) or static:S1,S2,... (fixed shares); the model trained is the same")
    how.add_argument("--bucket-mb", type=bucket_type, metavar="MB",
                     help="DDP's gradient bucket size in MiB, or 'auto': a few sizes timed over the first steps (default 25)")
    how.add_argument("--compression", metavar="METHOD",
                     help="data-parallel gradients on the wire: none (fp32, default), fp16 or bf16 (half the bytes), "
                          "powersgd:rank=R[,start=N], topk:ratio=K[,start=N] (both with error feedback) or auto")
    how.add_argument("--lr", type=number, help="peak learning rate")
    how.add_argument("--max-steps", type=integer, metavar="N", help="optimizer steps to run (default 1500)")
    how.add_argument("--seed", type=integer)
    how.add_argument("--eval-every", type=integer, metavar="N", help="held-out evaluation every N steps (default: at the end)")


def _add_run_options(train: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    run = train.add_argument_group("run directory")
    run.add_argument("--run-dir", metavar="DIR",
                     help="where config, metrics, checkpoints and weights go (default: a new folder under runs/, "
                          "runs/latest pointing at it; --resume without --run-dir continues runs/latest)")
    run.add_argument("--overwrite", action="store_true", default=None,
                     help="start afresh in a gradmesh run dir that has checkpoints (its files are replaced)")
    run.add_argument("--checkpoint-every", type=integer, metavar="N", help="checkpoint every N steps (default: at the end)")
    run.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint in --run-dir")
    run.add_argument("--async-checkpoint", action="store_true", default=None, help="write checkpoints in the background")
    run.add_argument("--record-samples", action="store_true", default=None, help="log each rank's sample indices per step")
    return run


def _add_monitoring_options(train: argparse.ArgumentParser) -> None:
    watch = train.add_argument_group("monitoring (see gradmesh monitor / gradmesh report)")
    watch.add_argument("--no-monitor", dest="monitor_enabled", action="store_false", default=None,
                       help="no per-rank step breakdown, straggler detection or replica checks")
    watch.add_argument("--check-every", type=integer, metavar="N",
                       help="compare parameter checksums across data-parallel replicas every N steps (default 50; 0: never)")
    watch.add_argument("--trace-steps", metavar="A:B", help="write trace.json (Chrome/Perfetto) of steps A..B on every rank")
    watch.add_argument("--tensorboard", action="store_true", default=None, help="write TensorBoard event files to RUN_DIR/tensorboard")
    watch.add_argument("--prometheus-port", type=integer, metavar="P", help="serve Prometheus metrics on 127.0.0.1:P/metrics")


def cmd_train(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    device, nproc = launch_shape(cfg.launch)
    run_dir = check_train(cfg, nproc, device)
    _advise(cfg)
    return _launch(cfg, nproc, run_dir)


def _advise(cfg: configuration.Config) -> None:
    """A setting that runs but trains worse than its alternative: said once, before launch."""
    if cfg.train.compression.startswith("topk") and cfg.train.optimizer.startswith("adam"):
        print(f"gradmesh: note: --compression {cfg.train.compression} under {cfg.train.optimizer} trains slower per "
              "step than under sgd (an entry sent once in T steps carries T steps of gradient, which inflates Adam's "
              "second moment); a dense warm-up narrows the gap (topk:ratio=K,start=N), and powersgd:rank=R suits Adam "
              "better (see the README's compression benchmark)", file=sys.stderr)


def check_train(cfg: configuration.Config, nproc: int, device: str = "cpu") -> Path | None:
    """Every check that can fail before a worker starts, in the order a user meets them (a UsageError
    names the first problem; NothingToDo when a resumed run is already done). Writes nothing but
    the run directory itself, and that only once everything else passed; returns it (None: a new
    default one is made at launch)."""
    from gradmesh import workloads

    world = nproc * cfg.launch.nnodes
    meta_model = functools.cache(lambda: workloads.meta_model(cfg))
    plan = _check_parallelism(cfg, nproc, world, meta_model)
    faults, chaos = parse_inject(cfg.fault.inject)
    check_ranks(faults, world)
    check_memory_faults(faults, cfg.train.balance)
    check_chaos(chaos, cfg.train.max_steps, cfg.fault.recovery, cfg.fault.explicit_timeout)
    _check_recovery(cfg, plan)
    _check_trace(cfg)
    workloads.check_inputs(cfg)
    check_memory(cfg, plan, meta_model, nproc, device)
    if cfg.monitor.prometheus_port:
        _check_port_free(cfg.monitor.prometheus_port)
    if _default_fresh(cfg):  # a folder of its own is made at launch, under runs/
        rundir.ensure_writable(rundir.DEFAULT_ROOT)
        return None
    RunLock(cfg.run.dir, _job_key(cfg)).check()
    if cfg.checkpoint.resume:
        _check_resume(cfg, Path(cfg.run.dir))
    else:
        rundir.check_fresh(cfg.run.dir, cfg.run.overwrite)
    return rundir.ensure_writable(cfg.run.dir)


def _default_fresh(cfg: configuration.Config) -> bool:
    """A fresh run without --run-dir (the default names runs/latest, the newest run)."""
    return not cfg.checkpoint.resume and Path(cfg.run.dir) == rundir.DEFAULT_ROOT / rundir.LATEST


def _job_key(cfg: configuration.Config) -> str:
    """What the launchers of one multi-node job share (they may share the run dir); '' on one machine."""
    return f"{cfg.launch.rdzv_endpoint}/{cfg.launch.rdzv_id}" if cfg.launch.nnodes > 1 else ""


def _check_parallelism(cfg: configuration.Config, nproc: int, world: int, meta_model) -> registry.Plan:
    """The strategy registry's checks; returns the plan (strategies on a named mesh) the workers build."""
    check_ps_options_need_ps(cfg, cfg.train.strategy, [row.name for row in registry.ROWS if "server" in row.roles])
    mesh = registry.mesh_for(cfg.train.strategy, world, cfg.train.mesh)
    product = math.prod(mesh.values())
    if product != world:
        raise UsageError(f"--mesh {cfg.train.mesh!r} spans {product} ranks but the job has {world} "
                         f"({nproc} per node x {cfg.launch.nnodes} nodes); make the product {world}")
    cfg.check_world(math.prod(mesh.get(axis, 1) for axis in DATA_AXES))
    plan = registry.resolve(cfg.train.strategy, mesh)
    plan.check(cfg, meta_model)
    _check_balance(cfg, plan, math.prod(mesh.get(axis, 1) for axis in DATA_AXES))
    method = parse_compression(cfg.train.compression)[0]
    if method != "none" and method not in plan.compressions:
        accepted = ", ".join(["none", *plan.compressions])
        raise UsageError(f"--compression {cfg.train.compression} does not apply to {plan.label}; "
                         f"accepted with it: {accepted}")
    return plan


def _check_balance(cfg: configuration.Config, plan: registry.Plan, data_ranks: int) -> None:
    how, shares = parse_balance(cfg.train.balance)
    if how != "off" and plan.engine != "collective":
        raise UsageError(f"--balance {cfg.train.balance} applies to strategies whose ranks step together (ddp, zero1, "
                         f"fsdp, tp meshes), not to {plan.label} (its own shares); leave it out")
    if how == "static" and len(shares) != data_ranks:
        raise UsageError(f"--balance {cfg.train.balance} gives {len(shares)} shares for {data_ranks} data-parallel "
                         f"rank(s); give one share per rank, e.g. static:{','.join(['1'] * data_ranks)}")


def _check_recovery(cfg: configuration.Config, plan: registry.Plan) -> None:
    if cfg.fault.on_nonfinite == "rollback" and plan.engine == "ps":
        raise UsageError(f"--on-nonfinite rollback needs ranks that step together; {plan.label}'s parameter servers "
                         "check every push instead: use --on-nonfinite stop or skip")
    if cfg.fault.recovery == "inplace" and (not plan.inplace_recovery or cfg.launch.nnodes > 1):
        accepted = ", ".join(row.name for row in registry.ROWS if row.inplace_recovery)
        raise UsageError(f"--recovery inplace supports --strategy {accepted} on one machine (a lost rank's shard of "
                         "sharded, tensor- or pipeline-parallel state is gone); use --recovery restart")


def _check_trace(cfg: configuration.Config) -> None:
    first = parse_trace_steps(cfg.monitor.trace_steps)
    if first and first[0] > cfg.train.max_steps:  # a trace that silently never starts
        raise UsageError(f"--trace-steps {cfg.monitor.trace_steps}: the run ends at step {cfg.train.max_steps} "
                         f"(train.max_steps); trace steps up to {cfg.train.max_steps}")


def _check_port_free(port: int) -> None:
    """Rank 0 serves Prometheus there after launch: a port in use must fail now, not mid-run."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise UsageError(f"--prometheus-port {port}: 127.0.0.1:{port} is not free ({exc.strerror}); "
                             "choose another port, or 0 for no Prometheus endpoint") from None


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
    state = checkpoint.read_state(latest)
    saved = state.get("run", {})
    now = run_info(cfg)
    diffs = [f"{key}: checkpoint {saved.get(key)!r} vs now {now[key]!r}"
             for key in now if saved.get(key) != now[key]]
    if diffs:
        raise UsageError(f"--resume: config incompatible with {latest}: " + "; ".join(diffs))
    _check_steps_left(cfg, run_dir, state["step"])


def _check_steps_left(cfg: configuration.Config, run_dir: Path, step: int) -> None:
    """A checkpoint past train.max_steps cannot be trained back to it; one at it is a finished run,
    and resuming it again (a scheduler's retry) has nothing to do rather than failing."""
    max_steps = cfg.train.max_steps
    if step > max_steps:
        raise UsageError(f"--resume: the latest checkpoint of {str(run_dir)!r} is at step {step}, past "
                         f"--max-steps {max_steps}; give --max-steps above {step} to train on")
    if step == max_steps:
        raise NothingToDo(f"{str(run_dir)!r} is already at step {step} = --max-steps: nothing to train (give "
                          f"--max-steps above {step} to go on; `gradmesh export {run_dir} --out FILE` writes its weights)")


def _launch(cfg: configuration.Config, nproc: int, run_dir: Path | None) -> int:
    """Settle what the checks left open, write config.toml and start the workers."""
    if run_dir is None:
        run_dir = rundir.new_default_run_dir()
        cfg.run.dir = str(run_dir)
    with RunLock(run_dir, _job_key(cfg)):  # taken before anything in the folder is touched
        return _start(cfg, nproc, run_dir)


def _start(cfg: configuration.Config, nproc: int, run_dir: Path) -> int:
    from gradmesh.launch import run_workers

    inplace = cfg.fault.recovery == "inplace"
    critical = registry.critical_ranks(cfg, nproc * cfg.launch.nnodes) if inplace else frozenset()
    going_back = cfg.fault.recovery == "restart" or critical or cfg.fault.on_nonfinite == "rollback"
    if going_back and not cfg.checkpoint.every:
        cfg.checkpoint.every = RESTART_CHECKPOINT_EVERY  # a restart or rollback must have something recent to load
    if not cfg.checkpoint.resume:
        _start_fresh(run_dir, cfg.run.overwrite, cfg.run.quiet)
    config_path = run_dir / "config.toml"
    atomic_write(config_path, cfg.to_toml())
    restarts = cfg.fault.max_restarts if cfg.fault.recovery != "none" else 0
    if not inplace and cfg.fault.explicit_timeout > AUTO_TIMEOUT_CAP:  # the step watchdog reports first
        env.set_collective_timeout(cfg.fault.explicit_timeout + COLLECTIVE_MARGIN_S)
    return run_workers(cfg.launch, nproc, ["-m", "gradmesh.worker", str(config_path)], max_restarts=restarts,
                       inplace=(cfg.fault.explicit_timeout or INPLACE_COLLECTIVE_TIMEOUT) if inplace else 0.0,
                       critical=critical)


def _start_fresh(run_dir: Path, overwrite: bool, quiet: bool) -> None:
    if rundir.start_fresh(run_dir, overwrite) and not quiet:
        print(f"gradmesh: starting a fresh run in {run_dir} (the previous run's files were replaced; "
              "--resume continues a run instead)", file=sys.stderr)
