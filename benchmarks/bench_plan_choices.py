"""Benchmark: the two choices issue 27 names, planned and then measured.

    .venv/bin/python benchmarks/bench_plan_choices.py     # root and iproute2 for the link; writes benchmarks/results/plan-choices.json

(a) gpt-char 4x wide (n_embd 512) on two hosts joined by 200 Mbit/s: `gradmesh plan --nodes 2
    --nproc 1 --link 200mbit` predicts from this machine's calibration (one thread per worker:
    the two namespace hosts share this machine's cores, OMP_NUM_THREADS=1), then the plan ranked
    first and ddp with none, fp16 and powersgd:rank=4 train on two network-namespace hosts whose
    egress is shaped to 200 Mbit/s (`gradmesh.netns.Hosts`), one worker each.
(b) recsys with 10^6 rows per table (8 tables x 16) on 3 local ranks: `gradmesh plan --nproc 3`,
    then the plan ranked first, ddp, ps and hybrid train here.

For each: predicted and measured steady step (median after `--warmup`), whether the plan ranked
first is of the kind the issue expects (compression; a table-sharding strategy) and how far it is
from the measured best. Calibrations are measured afresh (a cache folder of this run's own).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gradmesh.netns import Hosts

HERE = Path(__file__).parent
COMMON = ["--set", "train.sample_chars=0", "--set", "train.eval_batches=1"]
WIDE = ["--set", "model.n_embd=512", "--set", "model.n_head=8", "--global-batch-size", "16", *COMMON]
ROWS = ["--model", "recsys", "--set", "model.rows=1000000", "--set", "model.samples=60000",
        "--global-batch-size", "510", *COMMON]  # fmt: skip
"""510: divisible by 3 ranks and by 2 workers beside a server."""


def planned(flags: list[str], out: Path, env: dict) -> list[dict]:
    cmd = [sys.executable, "-m", "gradmesh", "plan", "--out", str(out), *flags]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return [p for p in json.loads(out.read_text())["ranked"] if p["fits"]]


def steady(run_dir: Path, warmup: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[warmup:])


def on_two_hosts(label: str, steps: int, warmup: int) -> float:
    """One run of `label` on 2 namespace hosts behind a 200 Mbit/s link; its steady step."""
    with tempfile.TemporaryDirectory() as run_dir, Hosts(2, "200mbit") as hosts:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint",
               f"{hosts.addresses[0]}:29400", "--rdzv-id", "choices", "--run-dir", run_dir, "--quiet",
               "--max-steps", str(steps), *WIDE, *label.split()]  # fmt: skip
        nodes = [hosts.start(node, cmd, env=env) for node in range(2)]
        for node in nodes:
            _, err = node.communicate(timeout=1800)
            if node.returncode:
                raise SystemExit(f"a node failed ({label}):\n{err[-3000:]}")
        return steady(Path(run_dir), warmup)


def here(label: str, steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", "3", "--run-dir", run_dir, "--quiet",
               "--max-steps", str(steps), *ROWS, *label.split()]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return steady(Path(run_dir), warmup)


def choice(name: str, ranked: list[dict], wanted: list[str], run, expected, args) -> dict:
    """The first-ranked plan and `wanted` (those the ranking has), measured by `run`."""
    by_label = {p["candidate"]["label"]: p for p in ranked}
    labels = list(dict.fromkeys([ranked[0]["candidate"]["label"], *(w for w in wanted if w in by_label)]))
    rows = []
    for label in labels:
        measured = run(label, args.steps, args.warmup)
        rows.append({"label": label, "predicted_s": by_label[label]["step_s"], "measured_s": measured})
        print(f"  {name} {label}: predicted {rows[-1]['predicted_s'] * 1000:.0f} ms, measured {measured * 1000:.0f} ms",
              file=sys.stderr)
    best = min(r["measured_s"] for r in rows)
    return {"scenario": name, "first": labels[0], "first_is_expected": expected(ranked[0]["candidate"]),
            "first_within": rows[0]["measured_s"] / best - 1, "rows": rows}


def show(results: list[dict]) -> None:
    console = Console(width=150)
    for found in results:
        table = Table(title=found["scenario"], header_style="bold")
        for column in ("plan", "predicted ms", "measured ms", "error"):
            table.add_column(column, justify="left" if column == "plan" else "right")
        for r in found["rows"]:
            table.add_row(r["label"], f"{r['predicted_s'] * 1000:,.0f}", f"{r['measured_s'] * 1000:,.0f}",
                          f"{r['predicted_s'] / r['measured_s'] - 1:+.0%}")
        console.print(table)
        console.print(f"ranked first: {found['first']} (the expected kind: {found['first_is_expected']}), "
                      f"{found['first_within']:.1%} from the measured best")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "plan-choices.json"))
    parser.add_argument("--only", choices=("link", "rows"), help="one scenario (default: both)")
    args = parser.parse_args()
    if args.only != "rows" and Hosts.unavailable():
        raise SystemExit(f"the 200 Mbit/s scenario needs network namespaces: {Hosts.unavailable()}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, XDG_CACHE_HOME=tmp)  # calibrations of this run's own
        os.environ["XDG_CACHE_HOME"] = tmp  # and the launches find them (their predicted rows)
        if args.only != "rows":
            ranked = planned(["--nodes", "2", "--nproc", "1", "--link", "200mbit", *WIDE], Path(tmp) / "a.json",
                             dict(env, OMP_NUM_THREADS="1"))
            results.append(choice("gpt-char 4x wide, 2 hosts, 200 Mbit/s", ranked,
                                  ["--strategy ddp", "--strategy ddp --compression fp16",
                                   "--strategy ddp --compression powersgd:rank=4"],
                                  on_two_hosts, lambda c: c["compression"] != "none", args))
        if args.only != "link":
            ranked = planned(["--nproc", "3", *ROWS], Path(tmp) / "b.json", env)
            results.append(choice("recsys, 10^6 rows per table, 3 ranks", ranked,
                                  ["--strategy ddp", "--strategy ps", "--strategy hybrid"],
                                  here, lambda c: c["strategy"] in ("hybrid", "ps"), args))
    show(results)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))


if __name__ == "__main__":
    main()
