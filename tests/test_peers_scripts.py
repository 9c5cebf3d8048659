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
    assert {"bench_gpt.py", "bench_recsys.py", "common.py", "deepspeed_gpt.py", "torchrec_dlrm.py"} <= {
        p.name for p in SCRIPTS
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_peer_script_compiles(script, tmp_path):
    """py_compile raises on a syntax error; the byte code it writes is there and not empty."""
    out = tmp_path / "out.pyc"
    assert py_compile.compile(str(script), cfile=str(out), doraise=True) == str(out)
    assert out.stat().st_size > 0


@pytest.mark.parametrize("name", ["bench_gpt.py", "bench_recsys.py"])
def test_peer_benchmark_help(name):
    script = PEERS / name
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
