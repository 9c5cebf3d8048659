"""Shared test helpers: run the real CLI in a subprocess and compare weights."""

import atexit
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

# A small model so multi-process runs finish in seconds on two cores.
TINY = ["--set", "model.n_layer=2", "--set", "model.n_head=2", "--set", "model.n_embd=32",
        "--set", "model.block_size=32", "--set", "data.max_chars=60000",
        "--set", "train.eval_batches=1", "--set", "train.sample_chars=0",
        "--set", "train.warmup_steps=2"]


def python_m_gradmesh(*args: str, timeout: float = 240, cwd=None) -> subprocess.CompletedProcess:
    """`python -m gradmesh ARGS` in a new interpreter: the entry point exactly as a user runs it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "gradmesh", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


class _Zygote:
    """Client of tests/zygote.py, started on first use and gone with the session."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="gradmesh-zygote-"))
        self.path, self.calls = str(self.dir / "socket"), itertools.count()
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py")), self.path],
                                       stdout=subprocess.PIPE, text=True)
        assert self.server.stdout.readline().strip() == "ready", "the test zygote did not start"
        atexit.register(self.close)

    def run(self, argv: list[str], cwd, timeout: float) -> subprocess.CompletedProcess:
        call = next(self.calls)
        out, err = self.dir / f"{call}.out", self.dir / f"{call}.err"
        request = {"argv": argv, "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err),
                   "env": dict(os.environ, PYTHONUNBUFFERED="1")}
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(self.path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            replies = conn.makefile()
            pid = json.loads(replies.readline())["pid"]
            conn.settimeout(timeout)
            try:
                code = json.loads(replies.readline())["code"]
            except (TimeoutError, socket.timeout):
                stacks = _stacks_of_tree(pid)  # before the kill: where a hung run waits is the clue
                os.kill(pid, signal.SIGKILL)  # its workers follow it (they die with their launcher)
                raise _TimeoutExpired(["gradmesh", *argv], timeout, output=out.read_text(),
                                                stderr=err.read_text() + stacks) from None
        result = subprocess.CompletedProcess(["gradmesh", *argv], code, out.read_text(), err.read_text())
        out.unlink(), err.unlink()
        return result

    def close(self) -> None:
        self.server.kill()
        self.server.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _tree(pid: int) -> list[int]:
    """pid and every process below it (read from /proc: a launcher's workers and theirs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def _stacks_of_tree(pid: int) -> str:
    """Every thread's stack (Python and native) in a hung run's processes, by py-spy (the test extra has it)."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return "\n(py-spy not installed: no stacks of the hung processes)"
    dumps = []
    for each in _tree(pid):
        done = subprocess.run([spy, "dump", "--native", "--pid", str(each)], capture_output=True, text=True, timeout=60)
        if done.returncode:  # native frames are a bonus: the Python ones without them
            done = subprocess.run([spy, "dump", "--pid", str(each)], capture_output=True, text=True, timeout=60)
        dumps.append(f"\n--- process {each}: py-spy dump ---\n{done.stdout}{done.stderr}")
    return "".join(dumps)


class _TimeoutExpired(subprocess.TimeoutExpired):
    def __str__(self) -> str:  # pytest shows this: the run's own output and the hung stacks with it
        return f"{super().__str__()}\n--- stdout ---\n{self.output}\n--- stderr ---\n{self.stderr}"


_zygote: _Zygote | None = None


def gradmesh(*args: str, timeout: float = 240, cwd=None) -> subprocess.CompletedProcess:
    """`gradmesh ARGS` in a fresh process forked from a warm one (tests/zygote.py): the CLI's own
    code in a process of its own, without a second of torch import per call."""
    global _zygote
    if _zygote is None:
        _zygote = _Zygote()
    return _zygote.run(list(args), cwd, timeout)


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
    """||a - b|| / ||b|| over all parameters together (contract 2)."""
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


def listening_sockets(pids=None) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state, from /proc/net/tcp and tcp6; with
    `pids`, only those the processes hold open."""
    import ipaddress

    inodes = None
    if pids is not None:
        inodes = set()
        for pid in pids:
            for fd in Path(f"/proc/{pid}/fd").glob("*"):
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue  # closed while we looked
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or (inodes is not None and fields[9] not in inodes):
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found
