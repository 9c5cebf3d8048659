"""A real one-node Slurm cluster for the tests: Debian's munged, slurmctld and slurmd, configured
in a temporary folder and started by the test setup (installed with apt-get if missing, as the
dashboard test installs chromium). Nodes are emulated as srun tasks on the one node: the packaged
slurmd runs one node per host."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")


APT = threading.Lock()
"""One apt-get at a time in this process: chromium's install (conftest) may run beside this one,
and a second apt-get fails on dpkg's lock instead of waiting."""


def install(log: list[str]) -> None:
    with APT:
        _apt(log)


def _apt(log: list[str]) -> None:
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        log.append(f"$ {' '.join(cmd)} -> {done.returncode}\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
        if done.returncode:
            return


_install: threading.Thread | None = None
_log: list[str] = []


def start_install() -> None:
    """In the background (at collection), where a selected test needs Slurm and it is missing."""
    global _install
    if not installed() and shutil.which("apt-get") and _install is None:
        _install = threading.Thread(target=install, args=(_log,), daemon=True)
        _install.start()


def wait_installed() -> str:
    """'' once the daemons are installed, else what the install printed."""
    if _install is not None:
        _install.join(timeout=900)
    return "" if installed() else "\n".join(_log) or "apt-get is not available"


def installed() -> bool:
    return all(shutil.which(tool) for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CONF = """ClusterName=gmtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    """Started on enter, stopped (jobs cancelled, daemons killed, folder removed) on exit."""

    def __enter__(self) -> "SlurmCluster":
        self.dir = Path(tempfile.mkdtemp(prefix="gradmesh-slurm-"))
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        conf = self.dir / "slurm.conf"
        conf.write_text(CONF.format(host=socket.gethostname(), ctld=_free_port(), slurmd=_free_port(),
                                    dir=self.dir, cpus=os.cpu_count() or 2))
        self.env = dict(os.environ, SLURM_CONF=str(conf))
        self.daemons: list[subprocess.Popen] = []
        self._start(["munged", "-F", "-f", "-S", f"{self.dir}/munge.sock", f"--key-file={key}",
                     f"--log-file={self.dir}/munged.log", f"--pid-file={self.dir}/munged.pid",
                     f"--seed-file={self.dir}/munged.seed"])
        time.sleep(0.5)
        self._start(["slurmctld", "-D", "-i"])
        self._start(["slurmd", "-D"])
        self._wait_idle()
        return self

    def _start(self, cmd: list[str]) -> None:
        self.daemons.append(subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True))

    def _wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%t").stdout.strip()
            if state.startswith("idle"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test's Slurm node did not come up: sinfo says {state!r}")

    def run(self, *cmd: str, cwd=None) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, cwd=cwd, timeout=60)

    def job_field(self, job: str, field: str) -> str:
        text = self.run("scontrol", "show", "job", job).stdout
        return next((part.split("=", 1)[1] for part in text.split() if part.startswith(f"{field}=")), "")

    def wait_done(self, job: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_field(job, "JobState")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(1)
        self.run("scancel", job)
        return "still running after the test's timeout"

    def __exit__(self, *exc) -> None:
        self.run("scancel", "--full", "--user", "root")
        for proc in reversed(self.daemons):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
