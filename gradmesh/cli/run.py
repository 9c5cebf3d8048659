"""`gradmesh run`: the user's own torch.distributed script on N workers, launched as torchrun would."""

import argparse

from gradmesh import config as configuration
from gradmesh.cli.options import add_launch_options, flag_layer, launch_shape
from gradmesh.paths import checked


def add_parser(subparsers) -> None:
    script = subparsers.add_parser(
        "run",
        help="run your own torch.distributed script on N workers",
        description="Run SCRIPT.py on N workers, as torchrun would (options before the script).",
    )
    add_launch_options(script)
    script.add_argument("script", metavar="SCRIPT.py")
    script.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...")


def cmd_run(args: argparse.Namespace) -> int:
    checked(args.script, "script", "a Python file: gradmesh run [options] SCRIPT.py [args]")
    from gradmesh.launch import run_workers  # torch: only once the input is known to be good

    launch = configuration.build([flag_layer(args)]).launch
    _, nproc = launch_shape(launch)
    # The script runs under a thin wrapper that ties it to the launcher (gradmesh.lifeline).
    # "--": torchrun's parser would otherwise take the script's own options for its (`--nproc` is an
    # abbreviation of its --nproc-per-node); argparse drops that first "--" and keeps any later one.
    return run_workers(launch, nproc, ["-m", "gradmesh.lifeline", "--", args.script, *args.script_args])
