"""The peer benchmarks (benchmarks/peers/: gradmesh against DeepSpeed and others) stay runnable:
every script compiles, and each benchmark's --help exits 0 with the project's python.

Nothing here installs a peer venv or trains: the benchmarks themselves do both, and are run
by hand (their docstrings say how); --help returns before either."""

import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"
SCRIPTS = sorted(PEERS.glob("*.py"))


def test_peer_scripts_exist():
    assert (PEERS / "bench_gpt.py") in SCRIPTS and (PEERS / "common.py") in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_peer_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.parametrize("name", ["bench_gpt.py", "bench_recsys.py"])
def test_peer_benchmark_help(name):
    script = PEERS / name
    if not script.exists():
        pytest.skip(f"benchmarks/peers/{name} is not written yet")
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
