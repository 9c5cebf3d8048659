"""A Ray job from a config, as `gradmesh train` launches one: checks first, then Ray, the run
directory's lock and config.toml, then the groups of workers (`gradmesh.ray.driver`)."""

import sys
from pathlib import Path

from gradmesh import config as configuration
from gradmesh import lifeline, rundir
from gradmesh.cli.auto import AUTO
from gradmesh.errors import UsageError
from gradmesh.ray import check_reachable, connect, need_ray
from gradmesh.ray.driver import Shape, check_room, run_job
from gradmesh.runlock import RunLock


def check_shape(shape: Shape, max_failures: int) -> None:
    if shape.workers < 1 or shape.cpus < 1 or max_failures < 0:
        raise UsageError(
            f"--num-workers {shape.workers}, --cpus-per-worker {shape.cpus}, --max-failures {max_failures}: "
            "workers and CPUs per worker must be >= 1, failures >= 0"
        )


def placed(cfg: configuration.Config, shape: Shape) -> configuration.Config:
    """The config the workers run: one worker per actor (the launch section says how many and on
    what device: config.toml then also resumes on one machine with `gradmesh train --resume`)."""
    if cfg.train.strategy == AUTO:
        raise UsageError(
            "--strategy auto plans for this machine's hardware; give a strategy (gradmesh plan ranks them)"
        )
    if cfg.fault.recovery == "inplace":
        raise UsageError(
            "--recovery inplace: gradmesh ray restarts the whole group from the latest checkpoint on a lost "
            "worker (--max-failures K); leave --recovery out"
        )
    if cfg.data.path and not Path(cfg.data.path).is_absolute():
        raise UsageError(
            f"--data {cfg.data.path!r}: the workers run on other nodes, in other folders; give an absolute "
            "path on storage every node shares"
        )
    device = "cuda" if shape.gpu else "cpu"
    cfg.launch = configuration.LaunchConfig(
        nproc=shape.workers, device=device, memory_per_rank_mb=cfg.launch.memory_per_rank_mb
    )
    return cfg


def _checked(cfg: configuration.Config, shape: Shape) -> None:
    """`gradmesh train`'s checks, each worker's memory counted as one machine's (a bundle each; a
    driver without a GPU checks a GPU job's model against its own memory)."""
    from gradmesh.cli.train import check_train
    from gradmesh.topology import resolve_device

    device = resolve_device("auto") if shape.gpu else "cpu"
    check_train(cfg, shape.workers, device, memory_ranks=1)


def _settle_run_dir(cfg: configuration.Config) -> Path:
    """The run directory as an absolute path (the workers' folders are not the driver's)."""
    if not cfg.checkpoint.resume and Path(cfg.run.dir) == rundir.DEFAULT_ROOT / rundir.LATEST:
        cfg.run.dir = str(rundir.new_default_run_dir())
    cfg.run.dir = str(Path(cfg.run.dir).resolve())
    return Path(cfg.run.dir)


def launch(cfg: configuration.Config, shape: Shape, address: str | None, max_failures: int) -> tuple[int, str, Path]:
    """(exit code, what to say when it failed, run directory)."""
    from gradmesh.cli.train import collective_timeout, write_run_config

    check_shape(shape, max_failures)
    cfg = placed(cfg, shape)
    ray = need_ray(address)
    if address:
        check_reachable(address)
    _checked(cfg, shape)
    started = connect(ray, address)
    lifeline.rearm_stop_signals()  # `gradmesh ray`'s own way to stop, not Ray's (no-op in the Python API)
    try:
        check_room(ray, shape)
        run_dir = _settle_run_dir(cfg)
        with RunLock(run_dir):
            config_path = write_run_config(cfg, run_dir, going_back=True)
            settings = {"threads": shape.cpus, "collective_timeout": collective_timeout(cfg)}
            code, message = run_job(ray, str(config_path), shape, max_failures, settings)
    finally:
        if started:
            ray.shutdown()
    if code == 0 and not cfg.run.quiet:
        print(f"gradmesh: {shape.workers} Ray workers finished; results in {run_dir}", file=sys.stderr)
    return code, message, run_dir
