"""The `gradmesh` command: `train` and `run` check everything, then start workers; `export`,
`monitor` and `report` read a run directory. One module per command, each with `add_parser` and
its `cmd_*`; what they share is in `options`.

All input is validated here, before any worker starts: a bad value prints one line naming it
and what is accepted, and exits with code 2. Nothing here imports torch until a command runs:
`gradmesh --help` and a usage error would otherwise wait a second for it.
"""

import functools
import sys

from gradmesh.cli import export, k8s, monitor, plan, ray, run, slurm, train
from gradmesh.cli.options import Parser
from gradmesh.errors import EXIT_USAGE, NothingToDo, UsageError

COMMANDS = {
    "train": train.cmd_train,
    "plan": plan.cmd_plan,
    "run": run.cmd_run,
    "export": export.cmd_export,
    "k8s": k8s.cmd_k8s,
    "slurm": slurm.cmd_slurm,
    "ray": ray.cmd_ray,
    "monitor": monitor.cmd_monitor,
    "report": monitor.cmd_report,
}


@functools.cache
def build_parser() -> Parser:
    """Built once per process (argparse reads it, never changes it): a few milliseconds a call,
    which an in-process caller of `main` (the tests' fuzzing, a launcher's zygote) pays per call."""
    parser = Parser(prog="gradmesh", description="Distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for command in (train, plan, run, export, monitor, slurm, k8s, ray):  # the order `gradmesh --help` lists them in
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        code = COMMANDS[args.command](args)
    except UsageError as err:
        print(f"gradmesh: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except NothingToDo as done:
        print(f"gradmesh: {done}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print("gradmesh: interrupted", file=sys.stderr)
        return 130
    return code
