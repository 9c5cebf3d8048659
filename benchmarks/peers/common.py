"""What the peer benchmarks share: a virtual environment per peer, made on first use, and the
steady-state throughput of a run from its per-step wall-clock stamps.

Each peer (DeepSpeed, TorchRec) pins packages that clash with gradmesh's own environment, so
each gets its own venv under benchmarks/peers/.venvs/NAME (git-ignored), built once from the
package registry with the exact pins given; a stamp file holding the pins marks it complete, so
an interrupted install is redone rather than trusted.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
VENVS = HERE / ".venvs"


def ensure_venv(name: str, installs: list[list[str]]) -> Path:
    """The python of venv `name`, made on first use: each entry of `installs` is one
    `pip install` argument list (run in order, e.g. [["torch==2.13.0"], ["--no-deps", "x==1"]])."""
    root = VENVS / name
    python = root / "bin" / "python"
    stamp = root / "gradmesh-installed.json"
    if stamp.exists() and json.loads(stamp.read_text()) == installs and python.exists():
        return python
    print(f"peers: installing {name} into {root} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    for args in installs:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)
    stamp.write_text(json.dumps(installs))
    return python


def steady_rate(stamps: list[float], batch: int, warmup: int) -> float:
    """Samples/s over the steps after the first `warmup` (wall-clock stamp after each step)."""
    return batch * (len(stamps) - 1 - warmup) / (stamps[-1] - stamps[warmup])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
