"""Where a parameter-server rank's time goes, by role (the step breakdown of ranks that do not
step together is kept per segment, not per step).

worker: data (fetching its shares' samples), compute (forward and backward, pushes issued as it
runs), push (waiting for its pushes to leave), pull (waiting for the servers' shards, including
a pull the ssp bound holds back), wait (asking the dispatcher for work).
server: receive (gradient payloads arriving), apply (summing shares and the optimizer step),
send (waiting for parameters to leave before they change), idle (waiting for any message).
"""

import time
from contextlib import contextmanager

from gradmesh.parallel.strategy import SERVER_ROLE, WORKER_ROLE

PHASES = {"worker": ("data", "compute", "push", "pull", "wait"), "server": ("receive", "apply", "send", "idle")}
ROLES = ("worker", "server")
SLOTS = 5
"""Phase slots per rank in the gathered figures (the longer role's count)."""


class RoleClock:
    def __init__(self, role: str):
        self.role = role
        self.seconds = dict.fromkeys(PHASES[role], 0.0)
        self.samples = self.updates = 0
        """worker: samples computed; server: updates applied."""
        self.current: list | None = None
        """[phase, since when] of the innermost phase running."""

    @contextmanager
    def phase(self, name: str):
        """Time spent in `name`; a phase inside another (a pull that waits in the middle of a
        forward) takes its time from the outer one."""
        outer, start = self.current, time.perf_counter()
        if outer:
            self.seconds[outer[0]] += start - outer[1]
        self.current = [name, start]
        try:
            yield
        finally:
            end = time.perf_counter()
            self.seconds[name] += end - self.current[1]
            self.current = [outer[0], end] if outer else None

    def take(self) -> list[float]:
        """[role, phase seconds (SLOTS), samples, updates] since the last take; starts anew."""
        figures = [float(ROLES.index(self.role)), *self.seconds.values()]
        figures += [0.0] * (1 + SLOTS - len(figures)) + [float(self.samples), float(self.updates)]
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.samples = self.updates = 0
        return figures


def roles_row(gathered: list[list[float]], steps: int) -> dict:
    """The metrics row's `roles`: per role, the ranks and each phase's seconds per step (the
    segment's mean), samples per step (workers) or updates per step (servers)."""
    found = {}
    for role_index, role in enumerate(ROLES):
        ranks = [r for r, figures in enumerate(gathered) if int(figures[0]) == role_index]
        if not ranks:
            continue
        entry: dict[str, list] = {"ranks": ranks}
        for i, phase in enumerate(PHASES[role]):
            entry[phase] = [round(gathered[r][1 + i] / steps, 6) for r in ranks]
        count = "samples" if role == WORKER_ROLE else "updates"
        index = 1 + SLOTS + (role == SERVER_ROLE)
        entry[count] = [round(gathered[r][index] / steps, 3) for r in ranks]
        found[role] = entry
    return found
