"""`gradmesh k8s`: write the Kubernetes manifests that run a `gradmesh train` job (Kubeflow
Trainer's TrainJob; with --kind pytorchjob, the training operator's v1 PyTorchJob)."""

import argparse
import re
import sys

from gradmesh.cli.options import integer
from gradmesh.errors import UsageError
from gradmesh.files import atomic_write

LAUNCH_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-backend", "--run-dir")
NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A Kubernetes object name (an RFC 1123 label, as the operators need for their services)."""


def add_parser(subparsers) -> None:
    k8s = subparsers.add_parser(
        "k8s",
        help="write Kubernetes manifests (Kubeflow TrainJob or PyTorchJob) for a training job",
        description="Write a Kubeflow Trainer TrainJob (or a v1 PyTorchJob) whose pods run `gradmesh train` with "
        "the options after `--`; each pod reads its place in the job from the PET_* variables the operator sets. "
        "Example: gradmesh k8s --nodes 2 --image registry/me/gradmesh:1 --run-dir /shared/run -- --strategy fsdp",
    )
    k8s.add_argument("--nodes", type=integer, required=True, metavar="N", help="pods (nodes) in the job")
    k8s.add_argument("--image", required=True, metavar="IMAGE", help="container image with gradmesh installed")
    k8s.add_argument(
        "--nproc-per-node", type=integer, metavar="N", help="workers per pod (default: the runtime's auto)"
    )
    k8s.add_argument("--gpus-per-node", type=integer, default=0, metavar="G", help="GPUs each pod requests (default 0)")
    k8s.add_argument("--name", default="gradmesh", metavar="NAME", help="the job's name (default gradmesh)")
    k8s.add_argument("--run-dir", required=True, metavar="DIR", help="run directory on a volume every pod mounts")
    k8s.add_argument(
        "--kind",
        choices=("trainjob", "pytorchjob"),
        default="trainjob",
        help="trainjob: Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1); pytorchjob: kubeflow.org/v1",
    )
    k8s.add_argument("--runtime", default="torch-distributed", metavar="NAME", help="TrainJob's runtime")
    k8s.add_argument("--out", metavar="FILE.yaml", help="write here (default: standard output)")
    k8s.add_argument("train", nargs=argparse.REMAINDER, metavar="-- TRAIN OPTIONS",
                     help="gradmesh train's options, after --")  # fmt: skip


def train_options(given: list[str], command: str, source: str, launch_flags=LAUNCH_FLAGS) -> list[str]:
    """The options after `--`, checked as `gradmesh train` would check them (one line, exit 2);
    the launch flags `command` sets itself from `source` are refused."""
    options = given[1:] if given[:1] == ["--"] else given
    from gradmesh.cli import build_parser

    for launch_flag in launch_flags:
        if any(o == launch_flag or o.startswith(launch_flag + "=") for o in options):
            raise UsageError(f"{command} sets {launch_flag} itself ({source}); leave it out")
    build_parser().parse_args(["train", *options])
    return options


def cmd_k8s(args: argparse.Namespace) -> int:
    from gradmesh.launch.k8s import JobSpec, pytorchjob, trainjob

    if not NAME.fullmatch(args.name):
        raise UsageError(f"--name {args.name!r}: lower-case letters, digits and '-', at most 63, as Kubernetes names")
    if args.nodes < 1 or args.gpus_per_node < 0 or (args.nproc_per_node is not None and args.nproc_per_node < 1):
        raise UsageError("--nodes and --nproc-per-node must be >= 1, --gpus-per-node >= 0")
    options = train_options(args.train, "gradmesh k8s", "the operator's PET_* variables", ("--nproc", *LAUNCH_FLAGS))
    command = ["gradmesh", "train", *options, "--run-dir", args.run_dir, "--resume-if-any"]
    spec = JobSpec(name=args.name, image=args.image, nodes=args.nodes, procs_per_node=args.nproc_per_node,
                   gpus_per_node=args.gpus_per_node, command=command, runtime=args.runtime)  # fmt: skip
    import yaml

    text = yaml.safe_dump((trainjob if args.kind == "trainjob" else pytorchjob)(spec), sort_keys=False)
    if args.out:
        atomic_write(args.out, text)
        print(f"wrote {args.out}: kubectl apply -f {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
