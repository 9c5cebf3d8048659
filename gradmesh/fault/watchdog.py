"""Hang detection: a step that does not finish within `--step-timeout` seconds (by default `auto`:
max(300 s, 20 x the slowest step so far), at most 25 minutes, below torch's own 30-minute
collective timeout; the first step after a start is allowed the 25 minutes).

torch's own collective timeouts default to 30 minutes and say nothing about who is missing.
Here every rank publishes its progress (step, micro-batch, phase) to the job's c10d store as it
goes; a thread on each rank watches its own progress. When it has not moved for the timeout,
the thread raises the alarm in the store, every rank writes all of its threads' Python stacks
to RUN_DIR/stacks-rank{R}.txt, and the ranks whose progress is behind the others' — those that
never arrived where the rest are waiting — are named in the log and in RUN_DIR/faults.jsonl.
Then the workers exit (code 3), so torch elastic ends the job or, under `--recovery restart`,
restarts it from the latest checkpoint.
"""

import faulthandler
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from gradmesh import env, manifest
from gradmesh.config.fault import AUTO_STEP_TIMEOUT, AUTO_TIMEOUT_CAP, auto_timeout
from gradmesh.errors import EXIT_HANG
from gradmesh.fault import inplace
from gradmesh.files import open_append
from gradmesh.topology import job_store

PHASES = ("started", "forward done", "backward done", "optimizer done")
REGROUPING = 9_999
"""In-place recovery: this rank's part of the step failed and it waits for the next group — ahead
of every phase of the step, so a rank that hung anywhere in it is the one behind."""


def describe(progress: int) -> str:
    step, rest = divmod(progress, 10_000)
    if rest == REGROUPING:
        return f"step {step}, waiting to regroup"
    micro, phase = divmod(rest, 10)
    where = PHASES[phase] if phase < len(PHASES) else f"phase {phase}"
    return f"step {step}, micro-batch {micro}, {where}"


STAND_BY_LIMIT = 5


class Watchdog:
    def __init__(self, timeout: float, rank: int, world_size: int, run_dir: Path | None, poll: float = 0.25):
        """timeout: seconds, or AUTO_STEP_TIMEOUT (a limit that follows the slowest step so far)."""
        self.auto = timeout == AUTO_STEP_TIMEOUT
        self.timeout = AUTO_TIMEOUT_CAP if self.auto else timeout
        self.rank, self.world_size, self.poll = rank, world_size, poll
        self.slowest = 0.0
        self.run_dir = Path(run_dir) if run_dir else None
        self.progress, self.moved, self.published = 0, time.monotonic(), -1
        self.store, self.watch_store = job_store(timedelta(seconds=5)), job_store(timedelta(seconds=5))
        # Keys of one attempt: the store outlives a restart, and an old alarm must not fire again.
        self.prefix = f"gradmesh/watchdog/{env.restart_count()}/"
        self.inplace = inplace.enabled()
        self.ranks = list(range(world_size))
        """Original ranks still in the job (in-place recovery drops lost ones)."""
        self.standing: tuple[dict, int] = ({}, 0)
        """(everyone's progress, how many timeouts in a row it has not changed) while standing by."""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="gradmesh-watchdog", daemon=True)
        self.thread.start()

    def beat(self, step: int, phase: int, micro: int = 0) -> None:
        # The watching thread publishes it: a store round trip per phase cost the step itself.
        self.progress, self.moved = step * 10_000 + micro * 10 + phase, time.monotonic()

    def completed(self, seconds: float) -> None:
        """A step took `seconds`: auto's limit is max(300 s, 20 x the slowest), within the cap."""
        self.slowest = max(self.slowest, seconds)
        if self.auto:
            self.timeout = auto_timeout(self.slowest)

    def _publish(self) -> None:
        progress = self.progress
        if self.watch_store and progress != self.published:
            try:
                self.watch_store.set(f"{self.prefix}progress/{self.rank}", str(progress))
                self.published = progress
            except Exception:  # the store went away with the job
                pass

    def regrouping(self, step: int) -> None:
        """In-place recovery waits for the next group (it has a timeout of its own): published as
        ahead of the step, and the clock stopped."""
        self.progress = step * 10_000 + REGROUPING
        if self.store:
            self.store.set(f"{self.prefix}progress/{self.rank}", str(self.progress))
        self.pause()

    def pause(self) -> None:
        """Not in a step (evaluation, checkpoint at the end): the clock stops."""
        self.moved = float("inf")

    def stop(self) -> None:
        self.stopped.set()

    def _alarm_raised(self) -> bool:
        try:
            return self.watch_store is not None and self.watch_store.check([f"{self.prefix}alarm"])
        except Exception:  # the store went away with the job
            return False

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll):
            self._publish()
            stalled = time.monotonic() - self.moved > self.timeout
            if self.inplace:  # no job-wide alarm: the survivors must stay
                if stalled:
                    self._stand_by_or_leave()
            elif stalled or self._alarm_raised():
                self._report(first=stalled and not self._alarm_raised())
                return

    def _stand_by_or_leave(self) -> None:
        """In-place recovery: the ranks that did not arrive leave; the rest wait to regroup.

        A regroup comes within a collective timeout (the step timeout, in this mode). A rank
        that has stood by for STAND_BY_LIMIT timeouts while no rank moved leaves too: it is the
        stuck one (alone, or behind a rank whose progress it cannot see), and the launcher then
        replaces it or ends the run — a job must not hang."""
        progress = self._others()
        if self.progress < max(progress.values()) or self._stood_by_too_long(progress):
            self._report(first=True)
        self.moved = time.monotonic()  # waiting on the missing rank: re-arm

    def _stood_by_too_long(self, progress: dict[int, int]) -> bool:
        if progress != self.standing[0]:
            self.standing = (progress, 0)
        self.standing = (progress, self.standing[1] + 1)
        return self.standing[1] > STAND_BY_LIMIT

    def _others(self) -> dict[int, int]:
        progress = {self.rank: self.progress}
        if self.watch_store is None:
            return progress  # outside a launched job no other rank's progress can be read
        for rank in self.ranks:
            try:
                progress[rank] = int(self.watch_store.get(f"{self.prefix}progress/{rank}"))
            except Exception:
                pass  # a rank that never reported: counted as not arrived below
        return progress

    def _report(self, first: bool) -> None:
        if self.run_dir:
            manifest.record_new(self.run_dir / f"stacks-rank{self.rank}.txt")
            with open(self.run_dir / f"stacks-rank{self.rank}.txt", "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        if first and self.watch_store and not self.inplace:
            self.watch_store.set(f"{self.prefix}alarm", str(self.rank))
        if first:
            progress = self._others() if self.watch_store else {self.rank: self.progress}
            ahead = max(progress.values())
            behind = sorted(r for r in self.ranks if progress.get(r, -1) < ahead)
            named = (
                ", ".join(f"rank {r} (at {describe(progress[r]) if r in progress else 'no step yet'})" for r in behind)
                or "none: every rank is stuck at the same point"
            )
            setting = "--step-timeout auto: 20x the slowest step, at least 300 s" if self.auto else "--step-timeout"
            line = (
                f"gradmesh: hang detected by rank {self.rank}: no progress for {self.timeout:g} s "
                f"({setting}) at {describe(self.progress)}; did not arrive: {named}; "
                f"Python stacks of every rank in {self.run_dir}/stacks-rank*.txt"
            )
            print(line, file=sys.stderr, flush=True)
            if self.run_dir:
                with open_append(self.run_dir / "faults.jsonl") as f:
                    f.write(
                        json.dumps(
                            {
                                "event": "hang",
                                "detected_by": self.rank,
                                "did_not_arrive": behind,
                                "progress": {str(r): describe(p) for r, p in progress.items()},
                                "time": time.time(),
                            }
                        )
                        + "\n"
                    )
        time.sleep(2.0)  # let the other ranks see the alarm and write their stacks
        os._exit(EXIT_HANG)
