"""`gradmesh export`: one unsharded safetensors file from a checkpoint of any strategy and world size."""

import argparse
import sys

from gradmesh.cli.options import existing_run_dir, integer
from gradmesh.paths import checked


def add_parser(subparsers) -> None:
    exporter = subparsers.add_parser(
        "export",
        help="write one unsharded .safetensors file from a checkpoint",
        description="Export a checkpoint (any strategy, any world size) as one unsharded safetensors file.",
    )
    exporter.add_argument("run_dir", metavar="RUN_DIR")
    exporter.add_argument("--step", type=integer, metavar="N", help="checkpoint step (default: the latest)")
    exporter.add_argument("--out", required=True, metavar="FILE.safetensors")


def cmd_export(args: argparse.Namespace) -> int:
    run_dir = existing_run_dir(args.run_dir)
    # Written after the checkpoint is read: a folder, FIFO or device there must fail first.
    checked(args.out, "--out", "a path for the new .safetensors file", missing_ok=True)
    from gradmesh.export import export  # torch: only once the input is known to be good

    path, count = export(run_dir, args.out, args.step, warn=lambda note: print(note, file=sys.stderr))
    print(f"wrote {count} tensors from {path} to {args.out}")
    return 0
