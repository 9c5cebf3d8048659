"""Fault injection for testing recovery and monitoring: `--inject kill:rank=1,step=7` (and hang, slow, diverge).

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

from gradmesh.files import read_jsonl
from gradmesh.specs import Fault, check_ranks, parse_faults  # noqa: F401 (re-exported)

class Injector:
    """This rank's faults; `before_step` and `at_checkpoint` fire them."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: Path | None):
        self.log = Path(run_dir) / "faults.jsonl" if run_dir else None
        fired = {entry["fault"] for entry in read_jsonl(self.log) if "fault" in entry} if self.log else set()
        self.faults = [f for f in faults if f.rank == rank and f.label not in fired]
        self.rank = rank
        self.slow_factor = max([f.factor for f in self.faults if f.kind == "slow"], default=1.0)
        self.slow_delay = max([f.delay for f in self.faults if f.kind == "slow"], default=0.0)

    def _record(self, fault: Fault, step: int) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"fault": fault.label, "rank": self.rank, "step": step, "time": time.time()}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        print(f"gradmesh: injecting {fault.label}", flush=True)

    def _fire(self, fault: Fault, step: int) -> None:
        self._record(fault, step)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: never return, as a deadlocked worker would not
            time.sleep(3600)

    def before_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.kind in ("kill", "hang") and fault.at == "step" and fault.step == step:
                self._fire(fault, step)

    def at_checkpoint(self, step: int) -> None:
        for fault in self.faults:
            if fault.kind == "kill" and fault.at == "checkpoint" and fault.step == step:
                self._fire(fault, step)

    def after_step(self, step: int, model) -> None:
        """diverge: nudge this replica's first parameter after the step (the replica check must see it)."""
        for fault in self.faults:
            if fault.kind == "diverge" and fault.step == step:
                import torch

                self._record(fault, step)
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] += 1e-3

    def slow_down(self, elapsed: float) -> float:
        """A straggler: `factor` times the step's own time (`elapsed`, measured without the
        injected delay, so it does not grow step on step), plus `delay` seconds; returns the delay."""
        seconds = (self.slow_factor - 1) * elapsed + self.slow_delay
        if seconds > 0:
            time.sleep(seconds)
        return seconds
