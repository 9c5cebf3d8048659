"""Workers forked from the launcher instead of started as fresh interpreters.

A fresh worker spends most of a second importing torch and gradmesh before it trains; forked
from the launcher, which has imported them already, it starts at once. torch elastic does the
forking (its function entry point with the "fork" start method), so rendezvous, monitoring,
restarts and tear-down stay torch's. Where it is not safe the launcher starts fresh workers:
CUDA cannot be forked into once initialised, and a fork of a process whose OpenMP pool has run
hangs in its first parallel region with more than one thread (so forked workers have one thread
each: the case of more workers than cores, as in the test suite).
"""

import os
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic import multiprocessing as elastic_mp
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

WORKER = ["-m", "gradmesh.worker"]


def forkable(device: str, threads: int, target: list[str]) -> bool:
    return target[: len(WORKER)] == WORKER and device == "cpu" and threads == 1


class _EveryFailure(MultiprocessContext):
    """torch's function-entry context reports only the first failed worker it finds; the
    subprocess one reports every worker that had failed by then, which the launcher needs to
    name a rank killed from outside rather than a peer that aborted after it. Every exit status
    is read as the failure is found, before the context stops the rest."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._exited: dict[int, tuple[int, int]] = {}

    def close(self, *args, **kwargs) -> None:
        if self._pc is not None:
            self._exited = {rank: (p.pid, p.exitcode) for rank, p in enumerate(self._pc.processes) if p.exitcode}
        super().close(*args, **kwargs)

    def _poll(self):
        result = super()._poll()
        if result is not None and result.is_failed():
            for rank, (pid, code) in self._exited.items():
                if rank not in result.failures:
                    result.failures[rank] = ProcessFailure(rank, pid, code, self.error_files[rank])
        return result


def _flush_streams() -> None:
    """Before each fork: text the launcher has buffered would otherwise be written again by
    every worker that inherits the buffer."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


os.register_at_fork(before=_flush_streams)  # this module is imported once per launcher that forks


def run(args, target: list[str]) -> None:
    """`torchrun.run(args)` with `gradmesh.worker.forked` as the workers' entry point."""
    from torch.distributed.launcher.api import elastic_launch

    from gradmesh import worker

    if args.rdzv_backend == "static" and args.master_port is None:
        args.master_port = 29500  # as torchrun.run sets it
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    elastic_mp.MultiprocessContext = _EveryFailure  # type: ignore[misc]  # start_processes builds it by this name
    elastic_launch(config=config, entrypoint=worker.forked)(*target[len(WORKER) :])
