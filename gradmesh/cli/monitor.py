"""`gradmesh monitor` (a live dashboard) and `gradmesh report` (static HTML): both read a run directory."""

import argparse
import sys

from gradmesh.cli.options import existing_run_dir, port_type


def add_parser(subparsers) -> None:
    monitor = subparsers.add_parser(
        "monitor",
        help="live web dashboard of a run directory",
        description="Serve a live dashboard of RUN_DIR: loss, throughput, where each rank's step "
        "time goes, memory per rank, and straggler and divergence alerts. Works while "
        "the run trains (updates every second) and after it has finished. Stop with Ctrl-C.",
    )
    monitor.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a gradmesh train run")
    monitor.add_argument("--port", type=port_type, default=8265, metavar="P", help="port to listen on (default 8265)")
    monitor.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="H",
        help="address to listen on (default 127.0.0.1, this machine only; ::1 for IPv6; 0.0.0.0 "
        "exposes the dashboard to the network)",
    )
    report = subparsers.add_parser(
        "report",
        help="write a static HTML report with plots of a run directory",
        description="Write RUN_DIR/report.html with PNG plots in RUN_DIR/report/: loss, throughput, "
        "step-time breakdown and memory per rank, a summary table and the alerts. "
        "Prints the path of report.html.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a gradmesh train run")


def cmd_monitor(args: argparse.Namespace) -> int:
    from gradmesh.monitor.dashboard import serve
    from gradmesh.monitor.listener import is_loopback

    run_dir = existing_run_dir(args.run_dir)

    def ready(url: str) -> None:
        # Warned only once listening: a host or port it cannot listen on stays a one-line error.
        if not is_loopback(args.host):
            print(
                f"gradmesh monitor: warning: --host {args.host} lets anyone who can reach this machine read the "
                "dashboard (no authentication); the default 127.0.0.1 keeps it to this machine",
                file=sys.stderr,
                flush=True,
            )
        print(f"gradmesh monitor: {run_dir} at {url} (Ctrl-C to stop)", flush=True)

    serve(run_dir, args.host, args.port, on_ready=ready)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from gradmesh.monitor.report import write_report

    print(write_report(existing_run_dir(args.run_dir)))
    return 0
