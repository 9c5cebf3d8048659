"""Start workers through torch.distributed.elastic, the agent behind torchrun.

gradmesh does not keep a process pool of its own: it turns its options into torchrun's and
hands them to `torch.distributed.run`, so rendezvous, multi-node launch, worker monitoring and
tear-down on failure are torch's. What it adds is the choice of thread count per worker and a
short, clear report when a worker fails.
"""

import contextlib
import logging
import signal
import sys
import uuid

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from gradmesh import env, lifeline, stores
from gradmesh.config import LaunchConfig
from gradmesh.errors import EXIT_HANG, EXIT_NONFINITE
from gradmesh.launch import network
from gradmesh.topology import resolve_device, threads_per_worker


def single_machine(launch: LaunchConfig) -> bool:
    return launch.nnodes == 1 and not launch.rdzv_endpoint


def _flags(**options) -> list[str]:
    """torchrun's options as its command line: --name value, in the order given."""
    return [part for name, value in options.items() for part in (f"--{name.replace('_', '-')}", str(value))]


def torchrun_args(launch: LaunchConfig, nproc: int, max_restarts: int = 0) -> list[str]:
    args = _flags(
        nproc_per_node=nproc,
        nnodes=launch.nnodes,
        max_restarts=max_restarts,
        monitor_interval="0.1",
        shutdown_timeout=lifeline.GRACE_S,
    )
    if single_machine(launch):
        # torchrun's --standalone, with the workers' store address on loopback too (--local-addr):
        # run_workers makes every store server listen there only.
        return args + _flags(
            rdzv_backend="c10d",
            rdzv_endpoint=f"{stores.LOOPBACK}:0",
            rdzv_id=uuid.uuid4().hex,
            local_addr=stores.LOOPBACK,
        )
    backend = launch.rdzv_backend or ("static" if launch.node_rank >= 0 else "c10d")
    node = network.node_settings(launch.rdzv_endpoint, launch.iface, launch.local_addr, launch.rdzv_conf, backend)
    args += _flags(
        rdzv_backend=backend, rdzv_endpoint=launch.rdzv_endpoint, rdzv_id=launch.rdzv_id, local_addr=node["local_addr"]
    )
    if node["rdzv_conf"]:
        args += _flags(rdzv_conf=node["rdzv_conf"])
    if launch.node_rank >= 0:
        args += _flags(node_rank=launch.node_rank)
    return args


def root_failure(err: ChildFailedError):
    """(rank, failure) of the worker that failed first. A rank killed from outside (SIGKILL: the OOM
    killer, an injected fault) is the cause when there is one: its peers then abort on the broken
    connection (gloo's SIGABRT), and under load one of them could be reaped before it."""
    killed = [(rank, f) for rank, f in err.failures.items() if f.exitcode == -signal.SIGKILL]
    return min(killed, key=lambda item: item[1].timestamp) if killed else err.get_first_failure()


def describe_failure(err: ChildFailedError, watched: bool = True) -> str:
    """watched: gradmesh's own workers, whose step watchdog exits with EXIT_HANG (a user's script
    under `gradmesh run` may exit with that code for reasons of its own)."""
    rank, failure = root_failure(err)
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    elif failure.exitcode == EXIT_HANG and watched:
        return f"gradmesh: the run hung (rank {rank} exited after the step watchdog fired; see the hang report above)"
    else:
        how = f"exited with code {failure.exitcode}"
    return f"gradmesh: worker rank {rank} (pid {failure.pid}) {how}; its traceback, if it left one, is above"


def _quiet_agent_warnings() -> None:
    """The agent's warnings repeat what gradmesh says in one line (a stop, a failure). Its loggers
    each carry their own level, so the parent's level alone does not reach them."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            # Its "failed (exitcode: N)" error line, too: describe_failure says it (or the worker did).
            logger.setLevel(logging.CRITICAL if name.endswith("multiprocessing.api") else logging.ERROR)


def _cheap_rendezvous_event_names() -> None:
    """torch's dynamic rendezvous names each event it logs by its caller, found with
    `inspect.stack()`, which reads the source lines of every frame on the stack: most of a second
    of each launch on a small machine, before any worker starts. The same name, read from the
    frame itself (`sys._getframe`, as `inspect.stack()[depth]` counts)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a shallower stack, as torch's own says
            return "no_method_name"

    dynamic_rendezvous.get_method_name = method_name


def _prepare_environment(launch: LaunchConfig, nproc: int) -> None:
    """The workers' environment: threads, the launcher's mark, and the network interface."""
    # torchrun's own default is one thread per worker; dividing the cores is faster when
    # fewer workers than cores run here. A user's OMP_NUM_THREADS wins.
    env.set_omp_threads(threads_per_worker(nproc))
    env.mark_launcher()
    if single_machine(launch):
        env.keep_on_interface(stores.loopback_interface())
    else:  # the interface that reaches the other machines (a named --iface wins over the environment)
        iface = network.node_settings(launch.rdzv_endpoint, launch.iface, launch.local_addr, "", "")["iface"]
        if iface:
            env.keep_on_interface(iface, override=bool(launch.iface))
        env.fresh_store_each_round()


def _launch(args, launch: LaunchConfig, nproc: int, target: list[str]) -> None:
    """torchrun.run(args), with gradmesh's own workers forked from this process where that is safe."""
    from gradmesh.launch import forked

    if forked.forkable(resolve_device(launch.device), threads_per_worker(nproc), target):
        forked.run(args, target)
    else:
        torchrun.run(args)


def run_workers(
    launch: LaunchConfig,
    nproc: int,
    target: list[str],
    max_restarts: int = 0,
    inplace: float = 0.0,
    critical: frozenset[int] = frozenset(),
) -> int:
    """Run `target` (['-m', module, ...] or [script, ...]) on nproc local workers; exit code.

    `inplace` > 0: in-place recovery's launcher, collectives waiting at most that many seconds;
    `critical` ranks' loss restarts every rank (max_restarts times) instead of being replaced."""
    _prepare_environment(launch, nproc)
    if inplace:
        from gradmesh.launch.inplace import run_inplace

        if critical:
            return run_inplace(nproc, target, inplace, critical=critical, restarts=max_restarts)
        return run_inplace(nproc, target, collective_timeout=inplace, replacements=max_restarts)
    _quiet_agent_warnings()
    _cheap_rendezvous_event_names()
    args = torchrun.parse_args(torchrun_args(launch, nproc, max_restarts) + target)
    try:
        with stores.loopback_servers() if single_machine(launch) else contextlib.nullcontext():
            _launch(args, launch, nproc, target)
    except ChildFailedError as err:
        if "gradmesh.worker" in target and root_failure(err)[1].exitcode == EXIT_NONFINITE:
            return EXIT_NONFINITE  # rank 0 has said which step, rank and values, in one line
        print(describe_failure(err, watched="gradmesh.worker" in target), file=sys.stderr, flush=True)
        return 1
    except SignalException as err:  # the agent has passed the signal on and reaped every worker
        print(lifeline.stopped_line(err.sigval, nproc), file=sys.stderr, flush=True)
        return lifeline.exit_code(err.sigval)
    return 0
