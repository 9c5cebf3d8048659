"""`gradmesh plan [train options]`: every strategy this job could run with, predicted and ranked.

Takes `gradmesh train`'s options for what to train and on how many workers, calibrates (or reads
the cached calibration), and prints a ranked table: step time and its bottleneck, samples/s,
speed-up over one worker and its efficiency, memory per rank, time and cost to train the data
volume. Writes the whole prediction to `plan.json` (`--out`).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from gradmesh import config as configuration
from gradmesh.cli.options import integer, launch_shape, nproc_type, number, resolve_config
from gradmesh.cli.train_options import add_job_options
from gradmesh.errors import UsageError
from gradmesh.files import atomic_write
from gradmesh.paths import checked
from gradmesh.plan.hardware import DEVICES, LINK_SYNTAX, Cluster, Link, cluster, device, parse_link

MARK = "gradmesh plan"
"""plan.json's "written_by": a file without it is not ours to replace."""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="predict and rank every strategy for a job before running it",
        description="Predict the step time, memory, speed-up and cost of every strategy the registry allows "
        "for this model and worker count, from a short calibration on this machine (cached), and rank them.",
    )
    add_job_options(parser)
    volume = parser.add_argument_group("what the plan answers")
    volume.add_argument("--samples", type=integer, metavar="N", help="data volume to train (default: steps x batch)")
    volume.add_argument("--epochs", type=number, metavar="E", help="data volume as passes over the training data")
    volume.add_argument("--price-per-hour", type=number, metavar="P", help="price of one worker per hour, for cost")
    volume.add_argument("--memory-per-rank", type=number, metavar="MB", help="memory one rank may use, in MiB")
    volume.add_argument("--refresh", action="store_true", help="calibrate again instead of using the cached one")
    volume.add_argument("--top", type=integer, metavar="K", help="rows shown (default 12; plan.json has all)")
    volume.add_argument("--out", default="plan.json", metavar="FILE", help="where the prediction goes (plan.json)")
    launch = parser.add_argument_group("where")
    launch.add_argument(
        "--nproc", type=nproc_type, metavar="N", help="workers per machine (default: as gradmesh train)"
    )
    launch.add_argument("--nnodes", "--nodes", type=integer, metavar="N", help="machines (default 1)")
    launch.add_argument("--device", choices=configuration.DEVICES)
    launch.add_argument(
        "--hardware",
        choices=DEVICES,
        metavar="NAME",
        help=f"plan for a hypothetical cluster of these GPUs instead of this machine: {', '.join(DEVICES)} "
        "(nothing is calibrated or started; --nproc defaults to the node's GPUs)",
    )
    launch.add_argument(
        "--link",
        metavar="BW[,LATENCY]",
        help=f"the network between nodes (with --nodes 2 or more: hosts like this one; with --hardware: "
        f"the cluster's): {LINK_SYNTAX}",
    )
    parser.set_defaults(run_dir=None, resume=None)


def _volume(args: argparse.Namespace, cfg: configuration.Config) -> int:
    if args.samples is not None and args.epochs is not None:
        raise UsageError("--samples and --epochs both give the data volume; give one")
    if args.samples is not None:
        return args.samples
    if args.epochs is not None:
        from gradmesh import workloads

        return math.ceil(args.epochs * workloads.train_size(cfg))
    return cfg.train.max_steps * cfg.train.global_batch_size


def _check_out(text: str) -> Path:
    path = checked(text, "--out", "a path for plan.json", missing_ok=True)
    if path.exists():
        try:
            ours = json.loads(path.read_text()).get("written_by") == MARK
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise UsageError(f"--out {text}: the file exists and gradmesh did not write it; give another path")
    return path


def _cluster(args: argparse.Namespace) -> Cluster | None:
    """The hypothetical cluster `--hardware` asks for (and --nproc's default from it); None without."""
    if args.hardware is None:
        return None
    gpu = device(args.hardware)
    args.nproc = args.nproc or gpu.per_node
    inter = parse_link(args.link, gpu.inter) if args.link is not None else gpu.inter
    # The nodes are the cluster's, not a launch's: kept out of the config, which would ask for a rendezvous
    nodes, args.nnodes = 1 if args.nnodes is None else args.nnodes, None
    if nodes < 1:
        raise UsageError(f"--nodes must be >= 1, got {nodes}")
    return cluster(gpu, nodes, args.nproc, inter)


HOST_LATENCY_S = 50e-6
"""An Ethernet hop between hosts, where `--link` gives no latency (an assumption)."""


def _hosts(args: argparse.Namespace) -> tuple[int, Link] | None:
    """`--link` without `--hardware`: (hosts, the network between them), each host calibrated as
    this machine; None without."""
    if args.link is None:
        return None
    nodes, args.nnodes = args.nnodes or 1, None  # the hosts are the plan's, not a launch's (no rendezvous)
    if nodes < 2:
        raise UsageError(
            f"--link {args.link} is the network between nodes; give --nodes 2 or more with it "
            "(hosts like this one), or --hardware NAME"
        )
    return nodes, parse_link(args.link, Link(bandwidth=1.0, latency_s=HOST_LATENCY_S))


def cmd_plan(args: argparse.Namespace) -> int:
    if args.memory_per_rank is not None:
        args.set = [*args.set, f"launch.memory_per_rank_mb={args.memory_per_rank}"]
    hypothetical = _cluster(args)
    hosts = None if hypothetical is not None else _hosts(args)
    cfg = resolve_config(args)
    if cfg.model.name in configuration.RL_MODELS:  # no global batch, no step to predict
        raise UsageError(
            f"gradmesh plan ranks the strategies of dataset workloads; --model {cfg.model.name} learns from its "
            "actors' experience under --strategy impala only (docs/reinforcement-learning.md)"
        )
    out = _check_out(args.out)
    samples = _volume(args, cfg)
    from gradmesh.cli.plan_table import print_plan, to_json

    if hypothetical is not None:
        planned, machine = _hypothetical(args, cfg, hypothetical, samples)
    else:
        planned, machine = _calibrated(args, cfg, samples, hosts)
    print_plan(planned, machine, args.top or 12)
    atomic_write(out, json.dumps({"written_by": MARK, **to_json(planned, machine)}, indent=1))
    print(f"wrote {os.fspath(out)}", file=sys.stderr)
    return 0


def _calibrated(args: argparse.Namespace, cfg: configuration.Config, samples: int, hosts: tuple[int, Link] | None):
    """The plan for this machine, from its calibration (measured now, or cached); with `hosts`,
    for that many hosts like it joined by the given network."""
    from gradmesh.cli.plan_table import machine_for
    from gradmesh.plan.planner import plan

    device, nproc = launch_shape(cfg.launch)
    machine = machine_for(cfg, nproc, device, args.price_per_hour)
    if hosts is not None:
        machine = dataclasses.replace(machine, nnodes=hosts[0])
    print(
        f"gradmesh plan: calibrating {cfg.model.name} on {nproc} worker(s) (cached after the first time)",
        file=sys.stderr,
    )
    return plan(cfg, machine, samples, refresh=args.refresh, inter=None if hosts is None else hosts[1]), machine


def _hypothetical(args: argparse.Namespace, cfg: configuration.Config, cluster: Cluster, samples: int):
    """`--hardware`: the plan for a cluster from the table, at once (no calibration, no process)."""
    from gradmesh.cli.plan_table import cluster_machine
    from gradmesh.plan.planner import hypothetical_plan

    machine = cluster_machine(cluster, args.price_per_hour, cfg.launch.memory_per_rank_mb)
    print(f"gradmesh plan: {cfg.model.name} on a hypothetical {cluster.describe()}", file=sys.stderr)
    return hypothetical_plan(cfg, machine, cluster, samples), machine
