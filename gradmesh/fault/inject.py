"""Fault injection for testing recovery and monitoring: `--inject kill:rank=1,step=7` (and hang, slow, diverge,
memory, nan).

Off unless asked for. Each kill or hang fires once per run, whatever the restarts: before it
fires, the worker appends it to RUN_DIR/faults.jsonl, and a restarted worker skips what that
file already lists, so a restart replays the steps after the checkpoint without being killed
at the same step again (and a second fault later in the run still fires).
"""

import json
import os
import signal
import time
from pathlib import Path

from gradmesh.files import open_append, read_jsonl
from gradmesh.specs import Fault, check_ranks, parse_faults  # noqa: F401 (re-exported)


class Injector:
    """This rank's faults; `before_step` and `at_checkpoint` fire them.

    `position()` gives (rank, world size) now — chaos faults aim at a rank, not at a worker.
    `spare_last`: in-place recovery, where the last worker standing must not be killed."""

    def __init__(
        self,
        faults: list[Fault],
        identity: int,
        run_dir: Path | None,
        position=None,
        pace: float = 0.0,
        spare_last: bool = False,
    ):
        self.log = Path(run_dir) / "faults.jsonl" if run_dir else None
        fired = self._fired()
        self.faults = [f for f in faults if (f.chaos >= 0 or f.rank == identity) and f.label not in fired]
        self.rank, self.pace, self.spare_last = identity, pace, spare_last
        self.position = position or (lambda: (identity, identity + 1))
        self.step = 0

    def _fired(self) -> set[str]:
        return {entry["fault"] for entry in self._entries()}

    def _entries(self) -> list[dict]:
        return [entry for entry in read_jsonl(self.log) if "fault" in entry] if self.log else []

    def _record(self, fault: Fault, step: int) -> None:
        if self.log:
            with open_append(self.log) as f:
                f.write(json.dumps({"fault": fault.label, "rank": self.rank, "step": step, "time": time.time()}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        print(f"gradmesh: injecting {fault.label}", flush=True)

    def _due_chaos(self, step: int, at: str) -> Fault | None:
        """The earliest chaos fault due by `step` that has not fired, when it is aimed at this rank.

        At most one fires per step: none once the log shows one fired at this step (a rank reading
        the log before that entry was written sees the same fault first, aimed at another rank).
        Under in-place recovery a kill or hang while one worker is left is held back until a
        replacement has joined (the last worker's death would end the run)."""
        if not any(f.chaos >= 0 for f in self.faults):
            return None
        rank, world = self.position()
        entries = self._entries()
        if (self.spare_last and world < 2) or any(
            e["fault"].startswith("chaos#") and e.get("step") == step for e in entries
        ):
            return None
        fired = {entry["fault"] for entry in entries}
        due = [f for f in self.faults if f.chaos >= 0 and f.kind != "slow" and f.step <= step and f.label not in fired]
        first = min(due, key=lambda f: f.step, default=None)
        if first is None or first.rank % world != rank:
            return None
        when = first.at if first.step == step else "step"  # held back past its checkpoint: before a step
        return first if when == at else None

    def _fire(self, fault: Fault, step: int) -> None:
        self._record(fault, step)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: never return, as a deadlocked worker would not
            time.sleep(3600)

    def before_step(self, step: int, explicit: bool = True) -> None:
        self.step = step
        if explicit:
            self.reached(step, exact=True)
        if (chaos := self._due_chaos(step, "step")) is not None:
            self._fire(chaos, step)

    def reached(self, step: int, exact: bool = False) -> None:
        """Work on `step` starts: a kill or hang at it fires (not exact: at it or before it, for
        a rank that skipped the step itself, as a parameter-server worker may)."""
        for fault in self.faults:
            if (
                fault.kind in ("kill", "hang")
                and fault.chaos < 0
                and fault.at == "step"
                and (fault.step == step if exact else fault.step <= step)
            ):
                self._fire(fault, step)

    def at_checkpoint(self, step: int) -> None:
        for fault in self.faults:
            if fault.kind == "kill" and fault.chaos < 0 and fault.at == "checkpoint" and fault.step == step:
                self._fire(fault, step)
        if (chaos := self._due_chaos(step, "checkpoint")) is not None:
            self._fire(chaos, step)

    def after_step(self, step: int, model) -> None:
        """diverge: nudge this replica's first parameter after the step (the replica check must see it)."""
        for fault in self.faults:
            if fault.kind == "diverge" and fault.step == step:
                import torch

                self._record(fault, step)
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] += 1e-3

    def spoil(self, losses, step: int | None = None):
        """nan: this rank's losses turn NaN at its steps (logged once, as the run first meets it);
        `step`: the step being worked on, where it is not the one started last (parameter servers)."""
        step = self.step if step is None else step
        for fault in self.faults:
            if fault.kind == "nan" and fault.step <= step < fault.step + max(fault.steps, 1):
                if fault.label not in self._fired():
                    self._record(fault, step)
                return losses * float("nan")
        return losses

    def slow_down(self, elapsed: float) -> float:
        """A straggler: `factor` times the step's own time (`elapsed`, measured without the
        injected delay, so it does not grow step on step), plus `delay` seconds (while its window
        of steps lasts, if it has one), plus a chaos
        slow-down and the chaos pace; returns the delay."""
        active = [
            f
            for f in self.faults
            if f.kind == "slow"
            and f.chaos < 0
            and f.step <= self.step
            and (not f.steps or self.step < f.step + f.steps)
        ]
        factor, delay = max([f.factor for f in active], default=1.0), max([f.delay for f in active], default=0.0)
        seconds = (factor - 1) * elapsed + delay + self.pace + self._chaos_delay()
        if seconds > 0:
            time.sleep(seconds)
        return seconds

    def free_memory(self) -> int | None:
        """memory: the bytes this rank is told it has free (a rank with less memory than the others)."""
        limits = [f.free_mb for f in self.faults if f.kind == "memory"]
        return int(min(limits) * 2**20) if limits else None

    def _chaos_delay(self) -> float:
        """A chaos slow-down's delay while it lasts on the rank it aims at (logged when it starts)."""
        rank, world = self.position()
        active = [
            f
            for f in self.faults
            if f.kind == "slow" and f.chaos >= 0 and f.step <= self.step < f.step + f.steps and f.rank % world == rank
        ]
        for fault in active:
            if fault.step == self.step and fault.label not in self._fired():
                self._record(fault, self.step)
        return max([f.delay for f in active], default=0.0)
