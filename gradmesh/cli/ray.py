"""`gradmesh ray`: `gradmesh train` on the actors of a Ray cluster, one worker per actor
(`gradmesh.ray` says how and why)."""

import argparse
import sys

from gradmesh.cli.options import integer
from gradmesh.cli.train_options import add_train_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ray",
        help="train on a Ray cluster, one worker per Ray actor",
        description="Train as `gradmesh train` does, on --num-workers Ray actors placed one per bundle of a placement "
        "group (spread over the nodes); a lost actor restarts the whole group from the latest checkpoint in the "
        "run directory (storage every node shares). Example: gradmesh ray --address auto --num-workers 4 "
        "--use-gpu --run-dir /shared/runs/gpt --strategy fsdp",
    )
    add_train_options(parser)
    group = parser.add_argument_group("Ray")
    group.add_argument("--num-workers", type=integer, required=True, metavar="N", help="workers (one Ray actor each)")
    group.add_argument(
        "--address",
        metavar="ADDR",
        help="the Ray cluster to join: auto (the one `ray start` started here), HOST:PORT or ray://HOST:PORT "
        "(default: a Ray of gradmesh's own on this machine, on 127.0.0.1)",
    )
    group.add_argument("--use-gpu", action="store_true", help="one GPU per worker (CUDA and NCCL)")
    group.add_argument(
        "--cpus-per-worker", type=integer, default=1, metavar="C", help="CPUs per worker: its bundle and its threads"
    )
    group.add_argument(
        "--max-failures",
        type=integer,
        default=3,
        metavar="K",
        help="restarts of the group after a lost worker (default 3)",
    )


def cmd_ray(args: argparse.Namespace) -> int:
    from gradmesh import lifeline
    from gradmesh.cli.options import resolve_config
    from gradmesh.errors import UsageError
    from gradmesh.ray.driver import Shape
    from gradmesh.ray.job import launch

    if args.recovery is not None or args.max_restarts is not None:
        raise UsageError("gradmesh ray restarts the whole group itself on a lost worker: use --max-failures K "
                         "instead of --recovery and --max-restarts")  # fmt: skip
    shape = Shape(workers=args.num_workers, cpus=args.cpus_per_worker, gpu=args.use_gpu)
    cfg = resolve_config(args)
    try:
        with lifeline.stop_on_signals():
            code, message, _ = launch(cfg, shape, args.address, args.max_failures)
    except lifeline.Stopped as stop:  # the group's actors (and their workers) were killed on the way out
        print(lifeline.stopped_line(stop.signum, shape.workers), file=sys.stderr, flush=True)
        return lifeline.exit_code(stop.signum)
    if message:
        print(message, file=sys.stderr, flush=True)
    return code
