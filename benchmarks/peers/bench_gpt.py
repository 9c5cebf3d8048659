"""Benchmark: gradmesh against DeepSpeed, side by side, on the GPT of benchmarks/bench_ddp.py.

    .venv/bin/python benchmarks/peers/bench_gpt.py                        # table + benchmarks/results/peers-gpt.json
    .venv/bin/python benchmarks/peers/bench_gpt.py --rounds 1 --steps 15 --out /tmp/smoke.json  # every row, once

Every system trains the same model (gradmesh's plain GPT, 4 layers x 128, 4 heads, block 128),
on the same corpus in the same sample order, with the same global batch (32 over 2 workers,
one thread each), AdamW (lr 2e-3) and gradient clipping at 1.0, in fp32 on 2 CPU processes
over gloo:

- plain torch DDP: benchmarks/plain_ddp.py under torchrun (the baseline; ratios are to it);
- gradmesh ddp, zero1 and fsdp: `gradmesh train --strategy X`, run as bench_ddp.py runs it,
  with its lr warm-up and decay off (CONSTANT_LR) to train exactly what the others train;
- DeepSpeed ZeRO-0, 1, 2 and 3: benchmarks/peers/deepspeed_gpt.py under torchrun, through
  deepspeed.initialize (fp32, no offload, DeepSpeed's defaults but for ZeRO-3's persistence
  threshold, 0 so that every parameter is sharded as FSDP shards it).

The pairs to read: gradmesh ddp against plain DDP and ZeRO-0 (replicated everything), gradmesh
zero1 against ZeRO-1 (sharded optimizer state), gradmesh fsdp against ZeRO-3 (sharded
parameters too); ZeRO-2 (sharded gradients) has no gradmesh twin and sits between.

DeepSpeed runs in its own venv (benchmarks/peers/.venvs/deepspeed, made on first use with the
pins in DEEPSPEED_INSTALLS; its CPU shared-memory comm op is JIT-built once, before the rounds)
and imports gradmesh's model and corpus from this checkout. Runs alternate inside one
invocation (each round in the reverse order of the one before) so that machine noise hits
every system alike; each run's throughput is measured over its steady state (the steps after
the first `--warmup`, from per-step wall-clock stamps) and the reported figure is the median
over rounds. The last step's loss (mean over the global batch) shows the work is the same;
plain_ddp.py records no loss. A run that fails is shown as failed with its last error line.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(REPO / "benchmarks")]
from bench_ddp import SIZE  # noqa: E402  the model size bench_ddp.py measures
from common import ensure_venv, median, steady_rate  # noqa: E402

DEEPSPEED_INSTALLS = [["torch==2.13.0"], ["--no-build-isolation", "deepspeed==0.19.8"]]
"""torch first (2.13.0 is the CPU wheel on this machine's disk), then DeepSpeed built against
it: DeepSpeed ships an sdist whose setup imports torch, and an isolated build would fetch another."""
CONSTANT_LR = ["train.warmup_steps=0", "train.min_lr=2e-3"]
"""bench_ddp.py's sets plus these: gradmesh's default warm-up and cosine decay off, so that it
runs the constant lr 2e-3 of plain_ddp.py and deepspeed_gpt.py and their last-step losses agree
(the schedule costs nothing per step; without this the losses differ and prove nothing)."""
NPROC = 2
THREADS = 1  # per worker: 2 processes on 2 cores


@dataclass(frozen=True)
class System:
    label: str
    kind: str  # "plain", "gradmesh" or "deepspeed"
    arg: str = ""  # gradmesh strategy or ZeRO stage
    group: str = ""  # which pair it belongs to


SYSTEMS = (
    System("plain torch DDP", "plain", group="replicated"),
    System("gradmesh ddp", "gradmesh", "ddp", "replicated"),
    System("DeepSpeed ZeRO-0", "deepspeed", "0", "replicated"),
    System("gradmesh zero1", "gradmesh", "zero1", "sharded optimizer state"),
    System("DeepSpeed ZeRO-1", "deepspeed", "1", "sharded optimizer state"),
    System("DeepSpeed ZeRO-2", "deepspeed", "2", "sharded optimizer state"),
    System("gradmesh fsdp", "gradmesh", "fsdp", "sharded parameters"),
    System("DeepSpeed ZeRO-3", "deepspeed", "3", "sharded parameters"),
)
BASELINE = "plain torch DDP"
PAIRS = (
    ("gradmesh ddp", "plain torch DDP"),
    ("gradmesh ddp", "DeepSpeed ZeRO-0"),
    ("gradmesh zero1", "DeepSpeed ZeRO-1"),
    ("gradmesh fsdp", "DeepSpeed ZeRO-3"),
)


@dataclass
class Outcome:
    rate: float | None = None
    loss: float | None = None
    error: str | None = None  # the last error line of a failed run
    stderr_tail: list[str] | None = None
    wall_s: float = 0.0
    extra: dict | None = None


def _env(**more: str) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(THREADS)
    env.update(more)
    return env


def _peer_env(python: Path) -> dict:
    return _env(
        DS_ACCELERATOR="cpu",
        # The shm comm op's JIT build lives with the venv (rebuilt with it), not in ~/.cache.
        TORCH_EXTENSIONS_DIR=str(python.parent.parent / "torch_extensions"),
        # torch 2.13 warns at every all_gather_into_tensor / reduce_scatter_tensor DeepSpeed calls.
        PYTHONWARNINGS="ignore::FutureWarning",
    )


LAUNCHER_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d")  # torchrun's agent's own log lines
LAUNCHER_FAILED = re.compile(r"elastic/multiprocessing/api\.py:\d+\] failed|ChildFailedError")


def _last_error(stderr: str) -> str:
    """The line that says why a run failed: the workers' last error line, not torchrun's summary
    (which follows it and names no cause), else the last line with words in it."""
    lines = stderr.splitlines()
    cut = next((i for i, line in enumerate(lines) if LAUNCHER_FAILED.search(line)), len(lines))
    ours = [line.strip() for line in lines[:cut] if re.search(r"[A-Za-z]", line) and not LAUNCHER_LOG.match(line)]
    errors = [line for line in ours if re.search(r"Error\b|Exception\b|error:|Killed|Segmentation", line)]
    found = errors or ours or [line.strip() for line in lines if re.search(r"[A-Za-z]", line)]
    return found[-1][:300] if found else "no output"


def _run(cmd: list[str], env: dict, timeout: float, read) -> Outcome:
    """Run one training job; `read()` (called after a clean exit) gives (stamps, loss, extra)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun and gradmesh pass it on to their workers (each in its own
        # session, so killing the launcher alone would leave them training).
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        return Outcome(error=f"timed out after {timeout:.0f} s", stderr_tail=stderr.splitlines()[-20:],
                       wall_s=time.perf_counter() - start)
    wall = time.perf_counter() - start
    tail = stderr.splitlines()[-20:]
    if proc.returncode != 0:
        return Outcome(error=f"exit {proc.returncode}: {_last_error(stderr or stdout)}", stderr_tail=tail, wall_s=wall)
    try:
        stamps, loss, extra = read()
        return Outcome(rate=steady_rate(stamps, ARGS.global_batch_size, ARGS.warmup), loss=loss, wall_s=wall,
                       extra=extra)
    except Exception as exc:  # a clean exit that left no usable record is a failure too
        return Outcome(error=f"no result: {type(exc).__name__}: {exc}", stderr_tail=tail, wall_s=wall)


def run_plain(tmp: Path) -> Outcome:
    out = tmp / "plain.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           str(REPO / "benchmarks" / "plain_ddp.py"), "--steps", str(ARGS.steps),
           "--global-batch-size", str(ARGS.global_batch_size), "--out", str(out)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in SIZE.items()]
    return _run(cmd, _env(), ARGS.timeout, lambda: (json.loads(out.read_text())["time"], None, None))


def run_gradmesh(tmp: Path, strategy: str) -> Outcome:
    run_dir = tmp / f"gradmesh-{strategy}"
    sets = [f"model.{k}={v}" for k, v in SIZE.items()] + ["train.sample_chars=0", "train.eval_batches=1"]
    sets += CONSTANT_LR
    cmd = [sys.executable, "-m", "gradmesh", "train", "--nproc", str(NPROC), "--max-steps", str(ARGS.steps),
           "--global-batch-size", str(ARGS.global_batch_size), "--run-dir", str(run_dir), "--quiet",
           "--strategy", strategy]
    for item in sets:
        cmd += ["--set", item]

    def read():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["time"] for r in rows], rows[-1].get("loss"), None

    return _run(cmd, _env(), ARGS.timeout, read)


def run_deepspeed(tmp: Path, python: Path, stage: str) -> Outcome:
    out = tmp / f"deepspeed-{stage}.json"
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           str(HERE / "deepspeed_gpt.py"), "--stage", stage, "--steps", str(ARGS.steps),
           "--global-batch-size", str(ARGS.global_batch_size), "--out", str(out)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in SIZE.items()]

    def read():
        record = json.loads(out.read_text())
        return record["time"], record["loss"], {"config": record["config"]}

    return _run(cmd, _peer_env(python), ARGS.timeout, read)


def prepare_deepspeed() -> tuple[Path | None, str | None, dict]:
    """The DeepSpeed venv's python (made on first use) with its shm op built, and its versions;
    or None and why not."""
    try:
        python = ensure_venv("deepspeed", DEEPSPEED_INSTALLS)
    except Exception as exc:
        return None, f"installing the DeepSpeed venv failed: {exc}", {}
    probe = ("import json, platform, deepspeed, torch\n"
             "from deepspeed.comm.torch import build_shm_op\n"
             "build_shm_op()\n"
             "print(json.dumps({'deepspeed': deepspeed.__version__, 'torch': torch.__version__,"
             " 'python': platform.python_version()}))")
    proc = subprocess.run([str(python), "-c", probe], env=_peer_env(python), capture_output=True, text=True,
                          cwd=REPO)
    if proc.returncode != 0:
        return python, f"DeepSpeed does not import: {_last_error(proc.stderr)}", {}
    versions = json.loads(proc.stdout.strip().splitlines()[-1])
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True).stdout.split()
    return python, None, {**versions, "pip_freeze": freeze}


def _git_head() -> str | None:
    proc = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=REPO)
    return proc.stdout.strip() or None


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


ARGS: argparse.Namespace


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one run may take before it counts as failed")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "peers-gpt.json"))
    parser.add_argument("--only", nargs="+", metavar="SYSTEM", choices=[s.label for s in SYSTEMS],
                        help="run these systems alone (labels as in the table), e.g. for an A/B of one pair")
    ARGS = parser.parse_args()
    if ARGS.steps < ARGS.warmup + 2:
        parser.error(f"--steps must be at least --warmup + 2 ({ARGS.warmup + 2}) to leave a steady state to measure")

    import torch  # the project venv's, for the versions only

    console = Console()
    ds_python, ds_error, ds_versions = prepare_deepspeed()
    if ds_error:
        console.print(f"[red]{escape(ds_error)}[/red]")
    systems = tuple(s for s in SYSTEMS if not ARGS.only or s.label in ARGS.only)
    outcomes: dict[str, list[Outcome]] = {s.label: [] for s in SYSTEMS}  # the others stay empty
    orders = []
    for round_ in range(ARGS.rounds):
        order = systems if round_ % 2 == 0 else systems[::-1]
        orders.append([s.label for s in order])
        for system in order:
            console.print(f"round {round_ + 1}/{ARGS.rounds}: {system.label}", highlight=False)
            with tempfile.TemporaryDirectory() as tmp:
                if system.kind == "plain":
                    outcome = run_plain(Path(tmp))
                elif system.kind == "gradmesh":
                    outcome = run_gradmesh(Path(tmp), system.arg)
                elif ds_python is None or ds_error:
                    outcome = Outcome(error=ds_error)
                else:
                    outcome = run_deepspeed(Path(tmp), ds_python, system.arg)
            outcomes[system.label].append(outcome)
            if outcome.error:
                console.print(f"  [red]failed: {escape(outcome.error)}[/red]")

    med = {label: median([o.rate for o in runs if o.rate is not None]) for label, runs in outcomes.items()}
    med = {label: (None if v != v else v) for label, v in med.items()}  # NaN (no run succeeded) -> None
    base = med[BASELINE]

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if med[a] is not None and med[b] is not None else None

    systems = {}
    for system in SYSTEMS:
        runs = outcomes[system.label]
        configs = [o.extra["config"] for o in runs if o.extra]
        systems[system.label] = {
            "kind": system.kind, "arg": system.arg, "group": system.group,
            "samples_per_s": [o.rate for o in runs],
            "median_samples_per_s": med[system.label],
            "over_plain_ddp": ratio(system.label, BASELINE),
            "last_step_loss": [o.loss for o in runs],
            "run_wall_s": [round(o.wall_s, 1) for o in runs],
            "failures": [{"round": i + 1, "error": o.error, "stderr_tail": o.stderr_tail}
                         for i, o in enumerate(runs) if o.error],
            **({"deepspeed_config": configs[0]} if configs else {}),
        }
    result = {
        "model": SIZE, "global_batch_size": ARGS.global_batch_size, "steps": ARGS.steps, "warmup": ARGS.warmup,
        "rounds": ARGS.rounds, "workers": NPROC, "threads_per_worker": THREADS, "cpu_count": os.cpu_count(),
        "systems": systems,
        "pairs": {f"{a} / {b}": ratio(a, b) for a, b in PAIRS},
        "order_per_round": orders,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "gradmesh_commit": _git_head(),
            "deepspeed_venv": ds_versions, "deepspeed_installs": DEEPSPEED_INSTALLS,
        },
        "command": " ".join([str(Path(sys.argv[0]).resolve().relative_to(REPO)), *sys.argv[1:]]),
    }
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(json.dumps(result, indent=1))

    table = Table(title=f"GPT training throughput, 2 workers x 1 thread, median of {ARGS.rounds} alternating "
                        f"round(s) of {ARGS.steps} steps (steady samples/s after {ARGS.warmup})",
                  caption="sections: replicated (DDP, ZeRO-0) | sharded optimizer state (zero1, ZeRO-1; "
                          "ZeRO-2 gradients too) | sharded parameters (fsdp, ZeRO-3)")
    for col in ("system", "samples/s", "/ plain DDP", "per round", "last-step loss"):
        table.add_column(col, justify="left" if col in ("system", "per round") else "right")
    group = None
    for system in SYSTEMS:
        if group is not None and system.group != group:
            table.add_section()
        group = system.group
        runs = outcomes[system.label]
        if not runs:  # left out by --only
            continue
        rounds = ", ".join("[red]failed[/red]" if o.rate is None else f"{o.rate:.1f}" for o in runs)
        errors = [o.error for o in runs if o.error]
        if errors:
            rounds += f"\n[red]{escape(errors[-1])}[/red]"
        losses = sorted({f"{o.loss:.4f}" for o in runs if o.loss is not None})
        table.add_row(system.label,
                      "[red]failed[/red]" if med[system.label] is None else f"{med[system.label]:.1f}",
                      _fmt(ratio(system.label, BASELINE), ".3f") if base else "—",
                      rounds, ", ".join(losses) or "—")
    console.print(table)
    pairs = Table(title="the pairs: gradmesh / its peer (samples/s, medians)")
    pairs.add_column("pair")
    pairs.add_column("ratio", justify="right")
    for a, b in PAIRS:
        pairs.add_row(f"{a} / {b}", _fmt(ratio(a, b), ".3f"))
    console.print(pairs)
    versions = result["versions"]
    console.print(f"python {versions['python']}, torch {versions['torch']}; DeepSpeed venv: deepspeed "
                  f"{ds_versions.get('deepspeed', '?')}, torch {ds_versions.get('torch', '?')}", highlight=False)
    print(f"wrote {ARGS.out}")


if __name__ == "__main__":
    main()
