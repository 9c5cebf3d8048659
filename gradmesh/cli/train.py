"""`gradmesh train`: its options, the checks that can fail before any worker starts
(`check_train`), and the launch of the workers."""

import argparse
import functools
import socket
import sys
from pathlib import Path

from gradmesh import config as configuration
from gradmesh import env, rundir
from gradmesh.chaos import check_chaos, parse_inject
from gradmesh.cli import auto
from gradmesh.cli.memory import check_memory
from gradmesh.cli.options import launch_shape, resolve_config
from gradmesh.cli.train_options import add_parser  # noqa: F401 (the command's parser, built there)
from gradmesh.config.fault import AUTO_TIMEOUT_CAP
from gradmesh.errors import NothingToDo, UsageError
from gradmesh.files import atomic_write
from gradmesh.monitor.monitor import parse_trace_steps
from gradmesh.parallel import registry
from gradmesh.parallel.jobs import job_plan
from gradmesh.runlock import RunLock
from gradmesh.specs import check_memory_faults, check_ranks

RESTART_CHECKPOINT_EVERY = 10
INPLACE_COLLECTIVE_TIMEOUT = 10.0
COLLECTIVE_MARGIN_S = 300.0


def cmd_train(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    device, nproc = launch_shape(cfg.launch)
    prediction: dict | None
    if cfg.train.strategy == auto.AUTO:
        check_train(auto.placeholder(cfg), nproc, device)  # the rest of the input first: planning takes a while
        cfg, prediction = auto.choose(cfg, nproc, device)
        run_dir = check_train(cfg, nproc, device)
    else:
        run_dir = check_train(cfg, nproc, device)
        prediction = auto.predict_own(cfg, nproc, device)
    _advise(cfg)
    return _launch(cfg, nproc, run_dir, prediction)


def _advise(cfg: configuration.Config) -> None:
    """A setting that runs but trains worse than its alternative: said once, before launch."""
    if cfg.train.compression.startswith("topk") and cfg.train.optimizer.startswith("adam"):
        print(
            f"gradmesh: note: --compression {cfg.train.compression} under {cfg.train.optimizer} trains slower per "
            "step than under sgd (an entry sent once in T steps carries T steps of gradient, which inflates Adam's "
            "second moment); a dense warm-up narrows the gap (topk:ratio=K,start=N), and powersgd:rank=R suits Adam "
            "better (see docs/benchmarks.md, convergence under compression)",
            file=sys.stderr,
        )


def check_train(
    cfg: configuration.Config, nproc: int, device: str = "cpu", memory_ranks: int | None = None
) -> Path | None:
    """Every check that can fail before a worker starts, in the order a user meets them (a UsageError
    names the first problem; NothingToDo when a resumed run is already done). Writes nothing but
    the run directory itself, and that only once everything else passed; returns it (None: a new
    default one is made at launch). `memory_ranks`: the ranks that share one machine's memory
    (default: all `nproc`)."""
    from gradmesh import workloads

    world = nproc * cfg.launch.nnodes
    meta_model = functools.cache(lambda: workloads.meta_model(cfg))
    plan = job_plan(cfg, nproc, world, meta_model)
    faults, chaos = parse_inject(cfg.fault.inject)
    check_ranks(faults, world)
    check_memory_faults(faults, cfg.train.balance)
    check_chaos(chaos, cfg.train.max_steps, cfg.fault.recovery, cfg.fault.explicit_timeout)
    _check_recovery(cfg, plan)
    _check_trace(cfg)
    workloads.check_inputs(cfg)
    check_memory(cfg, plan, meta_model, memory_ranks or nproc, device)
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


def _check_recovery(cfg: configuration.Config, plan: registry.Plan) -> None:
    if cfg.fault.on_nonfinite == "rollback" and not plan.runs_lockstep:
        raise UsageError(
            f"--on-nonfinite rollback needs ranks that step together; {plan.label}'s parameter servers "
            "check every push instead: use --on-nonfinite stop or skip"
        )
    if cfg.fault.recovery == "inplace" and (not plan.inplace_recovery or cfg.launch.nnodes > 1):
        accepted = ", ".join(row.name for row in registry.ROWS if row.inplace_recovery)
        raise UsageError(
            f"--recovery inplace supports --strategy {accepted} on one machine (a lost rank's shard of "
            "sharded, tensor- or pipeline-parallel state is gone); use --recovery restart"
        )


def _check_trace(cfg: configuration.Config) -> None:
    first = parse_trace_steps(cfg.monitor.trace_steps)
    if first and first[0] > cfg.train.max_steps:  # a trace that silently never starts
        raise UsageError(
            f"--trace-steps {cfg.monitor.trace_steps}: the run ends at step {cfg.train.max_steps} "
            f"(train.max_steps); trace steps up to {cfg.train.max_steps}"
        )


def _check_port_free(port: int) -> None:
    """Rank 0 serves Prometheus there after launch: a port in use must fail now, not mid-run."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise UsageError(
                f"--prometheus-port {port}: 127.0.0.1:{port} is not free ({exc.strerror}); "
                "choose another port, or 0 for no Prometheus endpoint"
            ) from None


def _check_resume(cfg: configuration.Config, run_dir: Path) -> None:
    from gradmesh import workloads
    from gradmesh.fault import checkpoint
    from gradmesh.worker import run_info

    if not checkpoint.complete_checkpoints(run_dir):
        raise UsageError(
            f"--resume: no complete checkpoint in {str(run_dir / 'checkpoints')!r}; run without --resume first"
        )
    latest = checkpoint.latest_good_checkpoint(run_dir, warn=lambda text: print(text, file=sys.stderr))
    if latest is None:
        raise UsageError(
            f"--resume: every checkpoint in {str(run_dir / 'checkpoints')!r} is damaged; start a fresh run"
        )
    problems = checkpoint.shape_mismatches(checkpoint.saved_shapes(latest), workloads.model_shapes(cfg))
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise UsageError(f"--resume: {latest} does not fit this model: " + "; ".join(problems[:4]) + more)
    state = checkpoint.read_state(latest)
    saved = state.get("run", {})
    now = run_info(cfg)
    diffs = [f"{key}: checkpoint {saved.get(key)!r} vs now {now[key]!r}" for key in now if saved.get(key) != now[key]]
    if diffs:
        raise UsageError(f"--resume: config incompatible with {latest}: " + "; ".join(diffs))
    _check_steps_left(cfg, run_dir, state["step"])


def _check_steps_left(cfg: configuration.Config, run_dir: Path, step: int) -> None:
    """A checkpoint past train.max_steps cannot be trained back to it; one at it is a finished run,
    and resuming it again (a scheduler's retry) has nothing to do rather than failing."""
    max_steps = cfg.train.max_steps
    if step > max_steps:
        raise UsageError(
            f"--resume: the latest checkpoint of {str(run_dir)!r} is at step {step}, past "
            f"--max-steps {max_steps}; give --max-steps above {step} to train on"
        )
    if step == max_steps:
        raise NothingToDo(
            f"{str(run_dir)!r} is already at step {step} = --max-steps: nothing to train (give "
            f"--max-steps above {step} to go on; `gradmesh export {run_dir} --out FILE` writes its weights)"
        )


def _launch(cfg: configuration.Config, nproc: int, run_dir: Path | None, prediction: dict | None = None) -> int:
    """Settle what the checks left open, write config.toml and start the workers."""
    if run_dir is None:
        run_dir = rundir.new_default_run_dir()
        cfg.run.dir = str(run_dir)
    with RunLock(run_dir, _job_key(cfg)):  # taken before anything in the folder is touched
        return _start(cfg, nproc, run_dir, prediction)


def _start(cfg: configuration.Config, nproc: int, run_dir: Path, prediction: dict | None = None) -> int:
    from gradmesh.launch import run_workers

    inplace = cfg.fault.recovery == "inplace"
    critical = registry.critical_ranks(cfg, nproc * cfg.launch.nnodes) if inplace else frozenset()
    going_back = cfg.fault.recovery == "restart" or bool(critical) or cfg.fault.on_nonfinite == "rollback"
    config_path = write_run_config(cfg, run_dir, going_back, prediction)
    restarts = cfg.fault.max_restarts if cfg.fault.recovery != "none" else 0
    timeout = collective_timeout(cfg)
    if not inplace and timeout:
        env.set_collective_timeout(timeout)
    return run_workers(
        cfg.launch,
        nproc,
        ["-m", "gradmesh.worker", str(config_path)],
        max_restarts=restarts,
        inplace=(cfg.fault.explicit_timeout or INPLACE_COLLECTIVE_TIMEOUT) if inplace else 0.0,
        critical=critical,
    )


def write_run_config(
    cfg: configuration.Config, run_dir: Path, going_back: bool, prediction: dict | None = None
) -> Path:
    """What every launcher does before its workers start (run lock held): a checkpoint cadence where
    the job may go back to one, a fresh run directory unless resuming, and config.toml (its path)."""
    if going_back and not cfg.checkpoint.every:
        cfg.checkpoint.every = RESTART_CHECKPOINT_EVERY  # a restart or rollback must have something recent to load
    if not cfg.checkpoint.resume:
        _start_fresh(run_dir, cfg.run.overwrite, cfg.run.quiet)
    auto.write_prediction(run_dir, prediction)
    config_path = run_dir / "config.toml"
    atomic_write(config_path, cfg.to_toml())
    return config_path


def collective_timeout(cfg: configuration.Config) -> float | None:
    """Seconds a collective may wait, where the step watchdog's own timeout is set past torch's
    default and must report first; None: torch's default."""
    if cfg.fault.explicit_timeout > AUTO_TIMEOUT_CAP:
        return cfg.fault.explicit_timeout + COLLECTIVE_MARGIN_S
    return None


def _start_fresh(run_dir: Path, overwrite: bool, quiet: bool) -> None:
    if rundir.start_fresh(run_dir, overwrite) and not quiet:
        print(
            f"gradmesh: starting a fresh run in {run_dir} (the previous run's files were replaced; "
            "--resume continues a run instead)",
            file=sys.stderr,
        )
