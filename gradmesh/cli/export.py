"""`gradmesh export`: one unsharded safetensors file from a checkpoint of any strategy and world size."""

import argparse
from pathlib import Path

from gradmesh.cli.options import integer
from gradmesh.errors import UsageError


def add_parser(subparsers) -> None:
    exporter = subparsers.add_parser("export", help="write one unsharded .safetensors file from a checkpoint",
                                     description="Export a checkpoint (any strategy, any world size) as one unsharded safetensors file.")
    exporter.add_argument("run_dir", metavar="RUN_DIR")
    exporter.add_argument("--step", type=integer, metavar="N", help="checkpoint step (default: the latest)")
    exporter.add_argument("--out", required=True, metavar="FILE.safetensors")


def cmd_export(args: argparse.Namespace) -> int:
    if not Path(args.run_dir).is_dir():
        raise UsageError(f"run dir {args.run_dir!r} does not exist")
    from gradmesh.export import export  # torch: only once the input is known to be good

    path, count = export(args.run_dir, args.out, args.step)
    print(f"wrote {count} tensors from {path} to {args.out}")
    return 0
