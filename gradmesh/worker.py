"""What each worker of `gradmesh train` runs: `python -m gradmesh.worker RUN_DIR/config.toml`."""

if __name__ == "__main__":  # first, before a second of imports: a stop or a dead launcher during them is handled too
    from gradmesh import lifeline

    lifeline.tie_to_launcher()

import json
import os
import signal
import sys
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from gradmesh import config as configuration
from gradmesh import env, workloads
from gradmesh.fault import inplace
from gradmesh.files import atomic_write
from gradmesh.loop.nonfinite import EXIT_NONFINITE, NonFiniteError
from gradmesh.loop.trainer import Trainer, init
from gradmesh.parallel import registry
from gradmesh.parallel.registry import mesh_for
from gradmesh.topology import local_device


class RankPrefixed:
    """A text stream that starts every line with '[rankN]: ' (the prefix torch uses for tracebacks)."""

    def __init__(self, stream, rank: int):
        self.stream, self.prefix, self.at_line_start = stream, f"[rank{rank}]: ", True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            # torch's own excepthook already prefixes traceback lines the same way.
            if self.at_line_start and not piece.startswith(self.prefix[:-1]):
                self.stream.write(self.prefix)
            self.stream.write(piece)
            self.at_line_start = piece.endswith("\n")
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run_info(cfg: configuration.Config) -> dict:
    """What a checkpoint must match to be resumed: everything that shapes the model and the data."""
    return {
        "model": vars(cfg.model).copy(),
        "data": vars(cfg.data).copy(),
        "global_batch_size": cfg.train.global_batch_size,
        "seed": cfg.train.seed,
    }


def _trainer(cfg: configuration.Config, session, workload, run_dir: Path) -> Trainer:
    return Trainer(
        session,
        workload.model,
        workload.loss_fn,
        workload.train_data,
        train=cfg.train,
        checkpointing=cfg.checkpoint,
        run_dir=run_dir,
        eval_fn=workload.eval_fn,
        quiet=cfg.run.quiet,
        run_info=run_info(cfg),
        criterion=workload.criterion,
        faults=cfg.fault,
        monitor=cfg.monitor,
        ps=cfg.ps,
        optimizer=workload.optimizer,
    )


def _write_results(trainer: Trainer, workload, run_dir: Path, summary: dict) -> None:
    """Rank 0's end of a run: a sample from the model, vocab.json, summary.json and the table."""
    sample = workload.finish(trainer.final_weights)
    extra = {"sample": sample} if sample else {}
    if "vocab" in workload.info:
        atomic_write(run_dir / "vocab.json", json.dumps(workload.info["vocab"]))
    summary.update(extra)
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=1))
    trainer.print_summary(sample)


def train(cfg: configuration.Config) -> dict:
    if registry.get(cfg.train.strategy).experience:  # no dataset, no Trainer: actors and learners
        from gradmesh.loop.actor_learner import train_actor_learner

        return train_actor_learner(cfg, run_info(cfg))
    world_size = env.placement().world_size
    workload = None
    if inplace.joining():  # a replacement builds its model first: the members pause only for the hand-over
        workload = workloads.build(cfg, local_device(cfg.launch.device))
    try:
        session = init(
            device=cfg.launch.device, seed=cfg.train.seed, mesh=mesh_for(cfg.train.strategy, world_size, cfg.train.mesh)
        )
    except inplace.RunFinished:
        print(
            f"gradmesh: the run finished before the replacement for rank {env.placement().rank} could join",
            file=sys.stderr,
        )
        return {}
    if session.identity != 0:
        sys.stdout, sys.stderr = RankPrefixed(sys.stdout, session.identity), RankPrefixed(sys.stderr, session.identity)
    run_dir = Path(cfg.run.dir)
    row = registry.get(cfg.train.strategy)
    remote = row.has_servers or row.shards_tables  # no rank makes a whole sparse table
    workload = workload or workloads.build(cfg, session.device, remote_tables=remote)
    trainer = _trainer(cfg, session, workload, run_dir)
    summary = trainer.fit()
    if session.rank == 0:
        _write_results(trainer, workload, run_dir, summary)
    session.close()
    return summary


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _train_from(config_path: str) -> None:
    cfg = configuration.build([configuration.load_toml(config_path)])
    try:
        train(cfg)
    except NonFiniteError:  # every rank stops here together; rank 0 has said why in one line
        _flush()
        os._exit(EXIT_NONFINITE)
    _flush()


@record
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _train_from(argv[0])
    # Leave without interpreter finalisation: process-group objects still referenced from
    # Python (FSDP modules, the device mesh, the checkpoint group) were seen to abort the
    # process in their C++ destructors at exit ("terminate called without an active
    # exception"), turning a finished run into a failed one. All files are closed by now.
    os._exit(0)


def forked(config_path: str) -> None:
    """A worker forked from its launcher (gradmesh.launch.forked): as `main`, but it returns
    (torch's process context takes the return value, then the process leaves without
    finalisation) and prints its own traceback, as an unforked worker's interpreter would."""
    from gradmesh import lifeline

    for sig in (signal.SIGHUP, signal.SIGQUIT):  # the agent's handlers are its own, not the worker's
        signal.signal(sig, signal.SIG_DFL)
    lifeline.tie_to_launcher()
    try:
        _train_from(config_path)
    except Exception:
        traceback.print_exc()
        _flush()
        raise


if __name__ == "__main__":
    main()
