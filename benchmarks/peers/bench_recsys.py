"""Benchmark: gradmesh's recsys workload against TorchRec's DistributedModelParallel, side by side.

    .venv/bin/python benchmarks/peers/bench_recsys.py    # prints a table, writes benchmarks/results/peers-recsys.json
    .venv/bin/python benchmarks/peers/bench_recsys.py --rounds 1 --steps 60 --rows 100000   # a quick look

The same work on both sides: the DLRM of `--model recsys` (8 tables x 16 dimensions, the rows
split evenly over them; bottom MLP, pairwise dot interaction, top MLP) on the same synthetic
click log (gradmesh's default spec for `--set model.rows=N`: 3 x 10^6 samples, Zipf 1.1), the
same samples in the same order (gradmesh's global order, each rank a contiguous half of every
global batch of 512), the tables by row-wise Adagrad at train.table_lr and the dense layers by
AdamW at train.lr on gradmesh's warm-up + cosine schedule, from the same initial weights.
Per table-row count (--rows, default 10^5 and 10^6), per round, one run each of:

  TorchRec table-wise   DMP, 2 processes, every table whole on one rank (benchmarks/peers/torchrec_dlrm.py)
  TorchRec row-wise     DMP, 2 processes, every table's rows split over both ranks
  gradmesh ddp          2 workers (the tables' gradients dense, all-reduced whole)
  gradmesh hybrid       2 workers + 1 parameter server holding the tables (as benchmarks/bench_recsys.py runs it)
  gradmesh tables       2 processes, the tables sharded (only where `gradmesh train --help` lists the strategy)
  gradmesh tables (table-wise)   the same, every table whole on one rank (--table-sharding table)

The runs alternate inside each round, in reverse order every other round, so that machine
noise and drift hit every system alike. Each run's throughput is its steady state: samples/s
over the steps after the first --warmup, from per-step wall-clock stamps (gradmesh's
metrics.jsonl "time"; torchrec_dlrm.py's own, taken once the step's loss is read). Hybrid is
the exception: the parameter-server engine runs and reports its steps a segment at a time, so
its rows' "time" stamps are bunched at each segment's end and say nothing of one step; its
rate is the same steps' samples over the sum of their metrics.jsonl "step_time_s" (each step's
share of its segment's wall time; on ddp the two ways agree within a few percent, and both
are kept in the JSON for every gradmesh run). The table gives the median over rounds, its
ratio to TorchRec's better plan at that size, the per-round figures, and, from the last round
that ran, the last step's training loss and the held-out AUC after the run (both sides score
the whole held-out split). A run that fails shows as failed, with its last error line.

What differs between the sides (torchrec_dlrm.py's docstring has the details): TorchRec's
fused optimizer updates the tables inside the backward pass, so only the dense gradients are
clipped to 1.0 (gradmesh clips the norm of all of them); TorchRec's table gradients are the sum
of the ranks' local-mean gradients (2x gradmesh's global mean, which row-wise Adagrad cancels
up to eps); TorchRec offers row-wise sharding on CUDA only, so its sharder is subclassed to
allow it on CPU. Every process runs one thread (OMP_NUM_THREADS=1, what gradmesh gives each of
2 workers on 2 cores; the hybrid's 3 processes share the cores). Pure throughput, not accuracy:
a run is far too short to train the model, and loss and AUC are there to show both sides learn
the same thing at the same pace.

TorchRec runs in its own venv (benchmarks/peers/.venvs/torchrec, made on first use by
common.ensure_venv): torch 2.13.0, then torchrec 1.8.0 and fbgemm-gpu-cpu 1.8.0 without their
declared dependencies (fbgemm-gpu-cpu 1.9 wants torch 2.14; torchrec declares fbgemm-gpu, the
CUDA build), then exactly the packages their imports need, pinned (torchmetrics and tqdm, which
torchrec declares, are imported only by torchrec.metrics, not used here); tomli-w for
gradmesh's config.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, REPO, ensure_venv, median, steady_rate

ROWS = (10**5, 10**6)
BATCH = 512
TORCHREC_INSTALLS = [
    ["torch==2.13.0"],
    ["--no-deps", "torchrec==1.8.0", "fbgemm-gpu-cpu==1.8.0"],
    # what `import torchrec.distributed` and fbgemm_gpu need (found by importing them), and tomli-w
    # for gradmesh's config; --no-deps, so none of them can swap the torch above
    ["--no-deps", "tensordict==0.15.3", "pyvers==0.2.3", "cloudpickle==3.1.3", "numpy==2.4.6",
     "pyre-extensions==0.0.32", "typing-inspect==0.9.0", "mypy-extensions==1.2.0", "tomli-w==1.2.0"],
]
PEER_VERSIONS = ("torch", "torchrec", "fbgemm-gpu-cpu")
RUN_TIMEOUT_S = 900


def systems(tables_available: bool) -> list[dict]:
    found = [
        {"name": "TorchRec table-wise", "side": "torchrec", "sharding": "table", "processes": 2},
        {"name": "TorchRec row-wise", "side": "torchrec", "sharding": "row", "processes": 2},
        {"name": "gradmesh ddp", "side": "gradmesh", "args": ["--strategy", "ddp"], "processes": 2},
        # the parameter-server engine reports its steps a segment at a time: their "time" stamps
        # are bunched at the segment's end, so its rate comes from the steps' own seconds
        {"name": "gradmesh hybrid", "side": "gradmesh", "args": ["--strategy", "hybrid", "--ps-servers", "1"],
         "processes": 3, "stamps": False},
        {"name": "gradmesh tables", "side": "gradmesh", "args": ["--strategy", "tables"], "processes": 2},
        {"name": "gradmesh tables (table-wise)", "side": "gradmesh",
         "args": ["--strategy", "tables", "--table-sharding", "table"], "processes": 2},
    ]
    return [s for s in found if tables_available or not s["name"].startswith("gradmesh tables")]


def gradmesh_strategies() -> list[str]:
    """The strategies `gradmesh train --help` lists."""
    text = subprocess.run([sys.executable, "-m", "gradmesh", "train", "--help"], capture_output=True, text=True,
                          cwd=REPO, env=_env()).stdout
    found = re.search(r"--strategy \{([^}]*)\}", text)
    return found[1].split(",") if found else []


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def last_line(stderr: str) -> str:
    """The line that says why a run failed: the last exception line ("Name: message"; torchrun's
    own ChildFailedError, which only says that a rank failed, passed over for the rank's), else
    the last line that is not decoration (torchrun closes its report with a rule of '=')."""
    lines = [line.strip() for line in stderr.splitlines() if re.search(r"[A-Za-z0-9]", line)]
    bare = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in lines]  # torchrun's prefix on a rank's lines
    errors = [line for line, text in zip(lines, bare)
              if re.search(r"\w(Error|Exception|Interrupt|Exit)\b", text) and "ChildFailedError" not in text
              and not text.startswith(("File ", "raise "))]
    return (errors or lines or ["(no stderr)"])[-1][:300]


def run(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess | None, str]:
    """The finished process, or None and why not."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if done.returncode:
        return None, f"exit {done.returncode}: {last_line(done.stderr)}"
    return done, ""


def run_torchrec(peer: Path, system: dict, rows: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "torchrec.json"
        cmd = [str(peer), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE / "torchrec_dlrm.py"), "--rows", str(rows), "--sharding", system["sharding"],
               "--steps", str(args.steps), "--global-batch-size", str(BATCH), "--out", str(out)]
        done, why = run(cmd, RUN_TIMEOUT_S)
        if done is None or not out.exists():
            return {"failed": why or "wrote no result"}
        try:
            found = json.loads(out.read_text())
            return {"samples_per_s": steady_rate(found["time"], BATCH, args.warmup), "loss": found["loss"],
                    "auc": found["eval"]["auc"], "eval_loss": found["eval"]["loss"]}
        except (KeyError, IndexError, ValueError, ZeroDivisionError) as error:
            return {"failed": f"unreadable result: {type(error).__name__}: {error}"}


def run_gradmesh(system: dict, rows: int, args) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "gradmesh", "train", "--model", "recsys", "--set", f"model.rows={rows}",
               "--nproc", str(system["processes"]), "--max-steps", str(args.steps), "--global-batch-size",
               str(BATCH), "--run-dir", run_dir, "--quiet", *system["args"]]
        done, why = run(cmd, RUN_TIMEOUT_S)
        if done is None:
            return {"failed": why}
        try:
            metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
            summary = json.loads((Path(run_dir) / "summary.json").read_text())
            by_stamps = steady_rate([r["time"] for r in metrics], BATCH, args.warmup)
            steady = metrics[args.warmup + 1 :]  # the steps the stamps' rate spans
            by_step_time = BATCH * len(steady) / sum(r["step_time_s"] for r in steady)
            return {"samples_per_s": by_stamps if system.get("stamps", True) else by_step_time,
                    "rate_by_stamps": by_stamps, "rate_by_step_time": by_step_time,
                    "loss": summary["final_loss"], "auc": summary["eval"]["auc"],
                    "eval_loss": summary["eval"]["loss"], "auc_ceiling": summary["eval"].get("auc_ceiling")}
        except (OSError, KeyError, IndexError, ValueError, ZeroDivisionError) as error:
            return {"failed": f"unreadable result: {type(error).__name__}: {error}"}


def peer_versions(peer: Path) -> dict:
    code = ("import json; from importlib.metadata import version; "
            f"print(json.dumps({{n: version(n) for n in {PEER_VERSIONS!r}}}))")
    return json.loads(subprocess.run([str(peer), "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of each run's rate")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="total table rows (default 10^5 10^6)")
    parser.add_argument("--out", default=str(HERE.parent / "results" / "peers-recsys.json"))
    parser.add_argument("--only", nargs="+", metavar="SYSTEM", choices=[s["name"] for s in systems(True)],
                        help="run these systems alone (names as in the table), e.g. one epoch of the best of each side")
    args = parser.parse_args()
    if args.steps < args.warmup + 2:
        parser.error(f"--steps must be at least --warmup + 2 ({args.warmup + 2})")

    peer = ensure_venv("torchrec", TORCHREC_INSTALLS)
    strategies = gradmesh_strategies()
    tables_available = "tables" in strategies
    chosen = [s for s in systems(tables_available) if not args.only or s["name"] in args.only]
    runs: list[dict] = []
    started = time.time()
    for rows in args.rows:
        for round_ in range(args.rounds):
            order = chosen if round_ % 2 == 0 else chosen[::-1]
            for system in order:
                print(f"{rows:,} rows, round {round_ + 1}/{args.rounds}: {system['name']}", file=sys.stderr, flush=True)
                began = time.time()
                if system["side"] == "torchrec":
                    found = run_torchrec(peer, system, rows, args)
                else:
                    found = run_gradmesh(system, rows, args)
                runs.append({"rows": rows, "system": system["name"], "processes": system["processes"],
                             "round": round_, "wall_s": time.time() - began, **found})

    figures = []
    for rows in args.rows:
        for system in (s for s in systems(True) if not args.only or s["name"] in args.only):
            mine = sorted((r for r in runs if r["rows"] == rows and r["system"] == system["name"]),
                          key=lambda r: r["round"])
            rates = [r["samples_per_s"] for r in mine if "samples_per_s" in r]
            last = next((r for r in reversed(mine) if "samples_per_s" in r), {})
            figures.append({
                "rows": rows, "system": system["name"], "processes": system["processes"],
                "available": bool(mine), "samples_per_s": median(rates) if rates else None,
                "per_round": [r.get("samples_per_s") for r in mine],
                "failures": [r["failed"] for r in mine if "failed" in r],
                "loss": last.get("loss"), "auc": last.get("auc"), "eval_loss": last.get("eval_loss"),
                "auc_ceiling": last.get("auc_ceiling"),
            })
    for figure in figures:
        peers = [f["samples_per_s"] for f in figures
                 if f["rows"] == figure["rows"] and f["system"].startswith("TorchRec") and f["samples_per_s"]]
        best = max(peers) if peers else None
        figure["vs_torchrec_best"] = figure["samples_per_s"] / best if best and figure["samples_per_s"] else None

    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/peers/bench_recsys.py", *sys.argv[1:]]),
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "global_batch_size": BATCH,
        "rows": list(args.rows), "cpu_count": os.cpu_count(), "threads_per_process": 1,
        "versions": {"torchrec_venv": peer_versions(peer), "gradmesh_torch": _torch_version(),
                     "torchrec_installs": TORCHREC_INSTALLS},
        "gradmesh_strategies": strategies, "wall_s": time.time() - started,
        "figures": figures, "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    show(figures, args)
    print(f"wrote {args.out}")


def _torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


def show(figures: list[dict], args) -> None:
    table = Table(title=f"recsys throughput, gradmesh vs TorchRec DMP: batch {BATCH}, {args.steps} steps "
                        f"(rate after {args.warmup}), median of {args.rounds} alternating round(s), 1 thread/process")
    for column in ("table rows", "system", "processes", "samples/s", "vs TorchRec best", "per round",
                   "last loss", "AUC"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for f in figures:
        rows = f"{f['rows']:,}"
        if not f["available"]:
            table.add_row(rows, f["system"], str(f["processes"]), "not available", "", "", "", "")
            continue
        rate = (f"{f['samples_per_s']:,.0f}" if f["samples_per_s"]
                else escape(f"failed: {f['failures'][-1][:60]}"))
        ratio = f"{f['vs_torchrec_best']:.2f}x" if f["vs_torchrec_best"] else ""
        rounds = ", ".join(f"{r / 1e3:.1f}k" if r else "failed" for r in f["per_round"])
        loss = f"{f['loss']:.4f}" if f["loss"] is not None else ""
        auc = f"{f['auc']:.4f}" if f["auc"] is not None else ""
        table.add_row(rows, f["system"], str(f["processes"]), rate, ratio, rounds, loss, auc)
    console = Console()
    if not console.is_terminal:  # piped or captured: wide enough for every column
        console = Console(width=170)
    console.print(table)
    for f in figures:
        for why in f["failures"]:
            print(f"failed: {f['rows']:,} rows, {f['system']}: {why}")
    ceilings = {f["rows"]: f["auc_ceiling"] for f in figures if f.get("auc_ceiling")}
    if ceilings:
        print("held-out AUC ceiling (the true click probabilities): "
              + ", ".join(f"{rows:,} rows {c:.4f}" for rows, c in ceilings.items()))


if __name__ == "__main__":
    main()
