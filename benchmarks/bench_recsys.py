"""Benchmark: the recsys workload by data parallelism and by parameter servers at 10^5, 10^6 and 10^7 table rows.

    .venv/bin/python benchmarks/bench_recsys.py      # prints a table, writes benchmarks/results/recsys.json

2 ranks of ddp, 8 tables x 16 dimensions, global batch 512, a 200,000-sample click log: the
tables' gradients are dense, so every step all-reduces the whole of every table however few
rows the batch touched. Per size: samples/s (median step time after the first `--warmup`
steps), the bytes each rank sends per step (what the reducer all-reduces, times the ring's
2(n-1)/n, beside the formula 2(n-1)/n x 4P), the rows a step actually touches (what a
parameter server would move instead), and each rank's peak memory beside the tables' bytes.
The same for tables on 2 ranks (`--strategy tables`: each rank holds half of every table's rows,
the rows a batch looks up and their gradients cross by all-to-all; bytes are what rank 0 hands
its collectives: the dense gradient to the all-reduce and the rows and gradients it sends the
other rank), ps sync, 1 and 2 servers + 2 workers (`--strategy ps`, the tables row-sharded on
the servers), and hybrid sync, 1 and 2 servers + 2 workers (`--strategy hybrid`: the tables on the servers,
the dense layers all-reduced between the workers): bytes are what every rank sent per step (the
`wire_bytes` column of metrics.jsonl; hybrid's all-reduce counted as the buffer handed to it).
Memory per rank two ways, over the training steps: peak RSS (what each rank reports; it counts
in full the shared libraries every rank maps, torch's above all) and peak private memory (the
pages the rank holds itself, sampled from /proc/PID/smaps_rollup every 50 ms).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from rich.console import Console
from rich.table import Table


HERE = Path(__file__).parent
SIZES = (10**5, 10**6, 10**7)
TABLES, DIM, BATCH = 8, 16, 512


def touched_rows(rows: int, samples: int = 20 * BATCH) -> float:
    """Distinct rows per step (all tables), over the first steps' batches of the log."""
    import torch

    from gradmesh.data.clicks import ClickSpec, generate

    train_split, _ = generate(ClickSpec(rows=(rows // TABLES,) * TABLES, samples=samples + 1))
    per_step = [sum(len(torch.unique(train_split.ids[i:i + BATCH, t])) for t in range(TABLES))
                for i in range(0, samples - BATCH + 1, BATCH)]
    return statistics.fmean(per_step)


def params(rows: int) -> int:
    from gradmesh import workloads
    from gradmesh.cli import build_parser
    from gradmesh.cli.options import resolve_config

    cfg = resolve_config(build_parser().parse_args(["train", "--model", "recsys", "--set", f"model.rows={rows}"]))
    return sum(p.numel() for p in workloads.meta_model(cfg).parameters())


def private_bytes(pid: int) -> int:
    """What a process holds itself (USS: its private pages), without the shared libraries every
    rank maps (torch's, which its RSS counts in full)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[key].split()[0]) * 1024 for key in ("Private_Clean", "Private_Dirty"))


def workers_of(run_dir: str, launcher: int) -> dict[int, int]:
    """rank -> pid of the job's worker processes: those whose environment names their RANK (a
    worker started as a fresh interpreter), else the launcher's forked children, which share its
    command line and environment, in the order they were forked (rank order; ascending pids)."""
    found, forked = {}, []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or run_dir not in (proc / "cmdline").read_bytes().decode(errors="replace"):
                continue
            env = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode().split("\0") if "=" in item)
            if "RANK" in env:
                found[int(env["RANK"])] = int(proc.name)
            elif int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                forked.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return found or dict(enumerate(sorted(forked)))


def train(nproc: int, steps: int, *extra: str) -> tuple[list[dict], list[int]]:
    """Metrics rows of a run, and each rank's peak private memory sampled every 50 ms until its
    last step's row is written (the final export, which collects whole tables on rank 0, after)."""
    with tempfile.TemporaryDirectory() as run_dir:
        metrics, peaks = Path(run_dir) / "metrics.jsonl", [0] * nproc
        cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(nproc), "--max-steps", str(steps),
               "--global-batch-size", str(BATCH), "--run-dir", run_dir, "--quiet", *extra]
        job, stop = subprocess.Popen(cmd), threading.Event()

        def sample():
            while not stop.wait(0.05):
                if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                    return
                for rank, pid in workers_of(run_dir, job.pid).items():
                    try:
                        peaks[rank] = max(peaks[rank], private_bytes(pid))
                    except (OSError, KeyError, ValueError):
                        pass

        sampler = threading.Thread(target=sample)
        sampler.start()
        if job.wait():
            raise subprocess.CalledProcessError(job.returncode, cmd)
        stop.set()
        sampler.join()
        return [json.loads(line) for line in metrics.read_text().splitlines()], peaks


def measure(rows: int, way: tuple[str, int], args) -> dict:
    """One run: `way` is (strategy, servers) — 2 workers, plus the servers."""
    strategy, servers = way
    nproc = 2 + servers
    extra = ("--ps-servers", str(servers)) if servers else ()
    found, private = train(nproc, args.steps, "--model", "recsys", "--set", f"model.rows={rows}", "--set",
                           "model.samples=200000", "--strategy", strategy, *extra)
    steady = found[args.warmup:]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    ring = 2 * (2 - 1) / 2
    if strategy in ("ddp", "tables"):  # collectives: what rank 0 hands them (ddp's all-reduce: x the ring's share)
        sent = statistics.median(r["breakdown"]["comm_bytes"][0] for r in steady) * (ring if strategy == "ddp" else 1)
    else:
        sent = statistics.median(r["wire_bytes"] for r in steady)
    return {"rows": rows, "strategy": strategy + (f", {servers} server{'s' * (servers > 1)}" if servers else ""),
            "samples_per_s": BATCH / step_s, "step_s": step_s, "sent_bytes": sent,
            "formula_bytes": ring * 4 * params(rows), "table_bytes": 4 * rows * DIM,
            "peak_bytes": [max(r["peak_memory_bytes"][i] for r in steady) for i in range(nproc)],
            "private_bytes": private,
            "touched_rows": touched_rows(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="total table rows (default 10^5 10^6 10^7)")
    parser.add_argument("--servers", type=int, nargs="+", default=(1, 2), help="parameter servers (default 1 and 2)")
    args = parser.parse_args()
    ways = [("ddp", 0), ("tables", 0)] + [(name, servers) for servers in args.servers for name in ("ps", "hybrid")]
    result = [measure(rows, way, args) for rows in args.sizes for way in ways]
    table = Table(title="recsys, ddp on 2 ranks (dense table gradients), ps and hybrid sync (1 server + 2 workers), "
                        "batch 512")
    for column in ("table rows", "strategy", "samples/s", "vs ddp", "bytes/step", "ddp formula 2(n-1)/n x 4P",
                   "rows touched/step", "peak memory/rank", "private/rank", "tables"):
        table.add_column(column, justify="right")
    for row in result:
        ddp = next(r for r in result if r["rows"] == row["rows"] and r["strategy"] == "ddp")
        table.add_row(f"{row['rows']:,}", row["strategy"], f"{row['samples_per_s']:,.0f}",
                      f"{row['samples_per_s'] / ddp['samples_per_s']:.1f}x", f"{row['sent_bytes'] / 1e6:,.2f} MB",
                      f"{row['formula_bytes'] / 1e6:,.1f} MB", f"{row['touched_rows']:,.0f}",
                      ", ".join(f"{b / 2**20:,.0f}" for b in row["peak_bytes"]) + " MiB",
                      ", ".join(f"{b / 2**20:,.0f}" for b in row["private_bytes"]) + " MiB",
                      f"{row['table_bytes'] / 2**20:,.0f} MiB")
    Console().print(table)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "recsys.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
