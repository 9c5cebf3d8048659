"""Shared test helpers: run the real CLI in a subprocess and compare weights."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

# A small model so multi-process runs finish in seconds on two cores.
TINY = ["--set", "model.n_layer=2", "--set", "model.n_head=2", "--set", "model.n_embd=32",
        "--set", "model.block_size=32", "--set", "data.max_chars=60000",
        "--set", "train.eval_batches=1", "--set", "train.sample_chars=0",
        "--set", "train.warmup_steps=2"]


def gradmesh(*args: str, timeout: float = 240, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "gradmesh", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def train(run_dir: Path, nproc: int, *extra: str, tiny: bool = True, check: bool = True,
          timeout: float = 240) -> subprocess.CompletedProcess:
    args = ["train", "--nproc", str(nproc), "--run-dir", str(run_dir), "--quiet", *(TINY if tiny else []), *extra]
    result = gradmesh(*args, timeout=timeout)
    if check:
        assert result.returncode == 0, f"gradmesh {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "model.safetensors"))


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all parameters together (DESIGN.md contract 2)."""
    assert a.keys() == b.keys()
    diff = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a)
    norm = sum((b[k].double() ** 2).sum() for k in b)
    return float((diff / norm).sqrt())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
