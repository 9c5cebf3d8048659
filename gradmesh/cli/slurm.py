"""`gradmesh slurm`: write (and with --submit, submit) the sbatch script of a gradmesh job."""

import argparse
import re
import shutil
import subprocess
import sys

from gradmesh.cli.k8s import train_options
from gradmesh.cli.options import integer, port_type
from gradmesh.errors import UsageError
from gradmesh.files import atomic_write

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def add_parser(subparsers) -> None:
    slurm = subparsers.add_parser(
        "slurm",
        help="write (and submit) a Slurm batch script for a training job",
        description="Write an sbatch script whose srun tasks, one per node, each run `gradmesh train` with the "
        "options after `--`, the first node as rendezvous endpoint; a requeued job resumes from the run "
        "directory's latest checkpoint. Example: gradmesh slurm --nodes 4 --gpus-per-node 8 --partition gpu "
        "--time 12:00:00 --run-dir /shared/runs/gpt --submit -- --strategy fsdp",
    )
    slurm.add_argument("--nodes", type=integer, required=True, metavar="N", help="nodes (one srun task each)")
    slurm.add_argument("--gpus-per-node", type=integer, default=0, metavar="G", help="GPUs per node (default 0)")
    slurm.add_argument("--partition", default="", metavar="P", help="Slurm partition (default: the cluster's)")
    slurm.add_argument("--time", default="", metavar="T", help="time limit, e.g. 12:00:00 (default: the partition's)")
    slurm.add_argument("--run-dir", required=True, metavar="DIR", help="run directory on storage every node shares")
    slurm.add_argument("--name", default="gradmesh", metavar="NAME", help="job name (default gradmesh)")
    slurm.add_argument("--port", type=port_type, default=29500, metavar="PORT", help="rendezvous port on node 0")
    slurm.add_argument(
        "--tasks-per-node",
        type=integer,
        default=1,
        metavar="K",
        help="launchers per node: 1 on a cluster; more stand in for nodes on one machine",
    )
    slurm.add_argument("--out", metavar="FILE.sbatch", help="write here (default: NAME.sbatch, here)")
    slurm.add_argument("--submit", action="store_true", help="submit it with sbatch")
    slurm.add_argument("train", nargs=argparse.REMAINDER, metavar="-- TRAIN OPTIONS",
                       help="gradmesh train's options, after --")  # fmt: skip


def cmd_slurm(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gradmesh.launch.slurm import SbatchSpec, sbatch_script

    if not NAME.fullmatch(args.name):
        raise UsageError(f"--name {args.name!r}: letters, digits, '_', '.', '-', at most 64")
    if args.nodes < 1 or args.tasks_per_node < 1 or args.gpus_per_node < 0:
        raise UsageError("--nodes and --tasks-per-node must be >= 1, --gpus-per-node >= 0")
    options = train_options(args.train, "gradmesh slurm", "srun's task variables")
    if args.gpus_per_node and "--nproc" not in options:
        options = ["--nproc", str(args.gpus_per_node), *options]
    spec = SbatchSpec(name=args.name, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                      gpus_per_node=args.gpus_per_node, partition=args.partition, time=args.time,
                      run_dir=args.run_dir, port=args.port, train=options)  # fmt: skip
    out = Path(args.out or f"{args.name}.sbatch")
    atomic_write(out, sbatch_script(spec))
    print(f"wrote {out}", file=sys.stderr)
    if args.submit:
        if shutil.which("sbatch") is None:
            raise UsageError("--submit needs Slurm's sbatch on PATH; submit the script where Slurm runs")
        done = subprocess.run(["sbatch", "--parsable", out.name], capture_output=True, text=True, cwd=out.parent)
        if done.returncode:
            raise UsageError(f"sbatch refused {out}: {done.stderr.strip().splitlines()[-1] if done.stderr else ''}")
        print(done.stdout.strip().split(";")[0])
    return 0
