"""The launcher of in-place recovery: workers that outlive a failed peer, and their replacements.

torch elastic's agent stops every worker when one fails (and restarts them all); in-place
recovery needs the opposite policy, which the agent does not offer. So under
`--recovery inplace` gradmesh starts the workers of this one machine itself and hosts the job's
c10d store in the launcher — in no worker, so the loss of rank 0 does not take the store with
it. When a worker dies, the launcher does not stop the others: it publishes the new membership
(the identities still alive) under a new generation in the store, and the survivors build a
new process group from it (`gradmesh.fault.inplace`) and carry on. It then starts a
replacement worker (up to `replacements` in a run), which builds its model, says it is ready,
and is added by the next generation; the members admit it between two steps and hand it their
state.
"""

import signal
import subprocess
import sys
import time

from gradmesh import env, lifeline, stores
from gradmesh.fault.inplace import evictions_requested, joining_key, publish_members


def _describe(identity: int, code: int) -> str:
    if code < 0:
        return f"worker rank {identity} was killed by {signal.Signals(-code).name}"
    return f"worker rank {identity} exited with code {code}"


class _Launcher:
    evictions: int
    """Eviction requests seen so far (`run` starts the count)."""
    evicted: set[int]
    """Identities stopped for a hang, so they are not stopped twice."""

    def __init__(
        self,
        nproc: int,
        target: list[str],
        collective_timeout: float,
        replacements: int,
        critical: frozenset[int] = frozenset(),
        restart: int = 0,
    ):
        self.store = stores.loopback_store()
        self.members = list(range(nproc))
        publish_members(self.store, self.members)
        self.target, self.replacements, self.critical = target, replacements, critical
        self.fatal: str | None = None
        """Why the survivors cannot go on (a critical rank or every non-critical one was lost)."""
        self.env = dict(
            env.environment(),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.store.port),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            TORCHELASTIC_USE_AGENT_STORE="True",
            GRADMESH_INPLACE="1",
            TORCHELASTIC_RESTART_COUNT=str(restart),
            GRADMESH_COLLECTIVE_TIMEOUT=str(collective_timeout),
        )
        self.workers: dict[int, subprocess.Popen] = {}
        self.local_rank: dict[int, int] = {}
        self.waiting: list[int] = []  # replacements started, not yet admitted
        for identity in range(nproc):
            self._spawn(identity, identity)
        self.finished = 0

    def _spawn(self, identity: int, local_rank: int, join: bool = False) -> None:
        child_env = dict(self.env, RANK=str(identity), LOCAL_RANK=str(local_rank), GRADMESH_JOIN="1" if join else "0")
        # A session of its own, as under torch elastic: the terminal's Ctrl-C reaches the launcher,
        # which stops the workers, rather than every worker at once (a lost worker to replace).
        worker = subprocess.Popen([sys.executable, *self.target], env=child_env, start_new_session=True)
        self.workers[identity], self.local_rank[identity] = worker, local_rank

    def _lost(self, identity: int, code: int) -> set[int]:
        """Publish the survivors; start a replacement if any are left. The workers started."""
        if self.critical and (identity in self.critical or set(self.members) - {identity} <= self.critical):
            self.fatal = _describe(identity, code)
            return set()
        if identity in self.waiting:
            self.waiting.remove(identity)
        if identity in self.members:
            self.members.remove(identity)
            publish_members(self.store, self.members)
        carry = f"ranks {', '.join(map(str, self.members))} carry on in place" if self.members else "no worker is left"
        if not self.members:  # nobody is left to admit a replacement (or hand it the state)
            for waiting in self.waiting:
                self.workers[waiting].terminate()
        replacing, started = "", set()
        if self.replacements > 0 and self.members:
            self.replacements -= 1
            newcomer = max(self.workers) + 1
            self._spawn(newcomer, self.local_rank[identity], join=True)
            self.waiting.append(newcomer)
            started.add(newcomer)
            replacing = f"; replacement worker rank {newcomer} is starting"
        print(f"gradmesh: {_describe(identity, code)}; {carry}{replacing}", file=sys.stderr, flush=True)
        return started

    def _admit_ready(self) -> None:
        ready = [w for w in self.waiting if self.store.check([joining_key(w)])]
        if ready and self.members:
            self.waiting = [w for w in self.waiting if w not in ready]
            self.members += ready
            publish_members(self.store, self.members)

    def _evict(self, alive: set[int]) -> None:
        """Kill the workers a peer found hanging (a parameter server's --step-timeout): their loss
        is then handled like any other."""
        self.evictions, hung = evictions_requested(self.store, self.evictions, sorted(alive - self.evicted))
        for identity in hung:
            self.evicted.add(identity)
            print(
                f"gradmesh: worker rank {identity} made no progress for --step-timeout: stopping it",
                file=sys.stderr,
                flush=True,
            )
            self.workers[identity].kill()

    def run(self) -> int:
        alive = set(self.workers)
        self.evictions, self.evicted = 0, set()
        while alive:
            time.sleep(0.02)
            self._evict(alive)
            if self.waiting:
                self._admit_ready()
            exited = {identity: self.workers[identity].poll() for identity in alive}
            # The critical first: a server's death makes its workers fail too, and it is the cause.
            for identity in sorted(alive, key=lambda i: (i not in self.critical, i)):
                code = exited[identity]
                if code is None:
                    continue
                alive.discard(identity)
                if code == 0:
                    self.finished += 1
                    if identity in self.members:
                        self.members.remove(identity)  # left at the end of the run, not lost
                    continue
                alive |= self._lost(identity, code)
                if self.fatal:
                    self.stop(signal.SIGKILL)  # nothing of theirs is needed: the restart resumes a checkpoint
                    return 1
        if self.finished == 0:
            print("gradmesh: every worker failed; their tracebacks, if they left any, are above", file=sys.stderr)
            return 1
        return 0

    def stop(self, signum: int) -> int:
        """Pass the signal on, give the workers a grace period, then SIGKILL; how many were running."""
        running = [w for w in self.workers.values() if w.poll() is None]
        for worker in running:
            worker.send_signal(signum)
        deadline = time.monotonic() + lifeline.GRACE_S
        for worker in running:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        return len(running)


def run_inplace(
    nproc: int,
    target: list[str],
    collective_timeout: float,
    replacements: int = 0,
    critical: frozenset[int] = frozenset(),
    restarts: int = 0,
) -> int:
    """Run `target` on nproc local workers; a failed worker is dropped (and replaced), not fatal.

    The loss of a `critical` rank (or of every other one) stops every worker and starts them
    all again, resuming the last checkpoint, up to `restarts` times."""
    restart = 0
    with lifeline.stop_on_signals():
        try:
            while True:
                launcher = _Launcher(nproc, target, collective_timeout, replacements, critical, restart)
                code = launcher.run()
                if launcher.fatal is None:
                    return code
                if restart == restarts:
                    print(
                        f"gradmesh: {launcher.fatal}; the others cannot go on without it and no restart is left "
                        f"(--max-restarts {restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                restart += 1
                print(
                    f"gradmesh: {launcher.fatal}; the others cannot go on without it: every rank restarts from "
                    f"the last checkpoint (restart {restart} of {restarts})",
                    file=sys.stderr,
                    flush=True,
                )
        except lifeline.Stopped as stop:
            lifeline.ignore_stop_signals()  # a second Ctrl-C must not abandon the workers half-stopped
            stopped = launcher.stop(stop.signum)
            print(lifeline.stopped_line(stop.signum, stopped), file=sys.stderr, flush=True)
            return lifeline.exit_code(stop.signum)
