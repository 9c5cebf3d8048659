"""Where a step's time goes on this rank: data, forward, backward, communication, optimizer, idle.

The trainer brackets each phase (`StepClock.phase`). Communication is measured where it runs:
the job's gradient reducer (`gradmesh.comm`) marks each bucket's all-reduce as it is issued and as it completes.
DDP overlaps those all-reduces with the backward pass, so the backward is split at the moment
the last bucket is issued: before it is computation (`backward`), after it the rank only waits
for the all-reduces to finish (`comm`, the communication the overlap did not hide, and the
time a fast rank waits there for a slow one). `comm_busy_s` is the time collectives were in
flight at all, hidden or not. `idle` is what no phase covers (step bookkeeping, the metrics
gather, an injected delay outside the phases); the phases sum to the step time.

Writing this by hand: the PyTorch profiler records all of this and more, but at a cost per op
that a run cannot leave on (it is a tool for a few steps); these are a handful of clock reads
per step, cheap enough to stay on for every step of every run.
"""

import threading
import time
from contextlib import contextmanager

PHASES = ("data", "forward", "backward", "comm", "optimizer", "idle")
FIGURES = PHASES + ("step_s", "comm_busy_s", "comm_bytes", "collectives")
"""Per-rank figures of one step, in the order the step reporter gathers them."""


class StepClock:
    """Per-step phase timer of one rank; cheap enough to run on every step."""

    def __init__(self, trace: tuple[int, int] | None = None, counter=None):
        """counter: the job's gradmesh.comm.CommCounter (bytes and collectives of the step)."""
        self.trace_range = trace
        self.counter = counter
        self.events: list[dict] = []
        """Chrome-trace events of the traced steps (phases and collectives, this rank)."""
        self.lock = threading.Lock()
        self.step = 0
        self._reset()

    def _reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.comm_busy = 0.0
        self.last_issue: float | None = None
        self.nested = 0.0  # waits inside a phase counted as comm instead (pipeline send/recv)

    def traces(self, step: int) -> bool:
        return self.trace_range is not None and self.trace_range[0] <= step <= self.trace_range[1]

    @property
    def tracing(self) -> bool:
        return self.traces(self.step)

    def begin(self, step: int) -> None:
        self.step = step
        self._reset()
        self.started = time.perf_counter()

    def event(self, name: str, start: float, end: float, track: str) -> None:
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "ts": (start + self.wall_offset) * 1e6,
                "dur": (end - start) * 1e6,
                "tid": track,
                "args": {"step": self.step},
            }
        )

    wall_offset = time.time() - time.perf_counter()
    """perf_counter -> wall-clock seconds: the ranks' traces line up on one time axis."""

    @contextmanager
    def phase(self, name: str):
        start, nested = time.perf_counter(), self.nested
        try:
            yield
        finally:
            end = time.perf_counter()
            self.seconds[name] += end - start - (self.nested - nested)
            if self.tracing:
                self.event(name, start, end, "phases")

    def span(self, name: str, start: float, end: float) -> None:
        """A phase timed by its caller (an own loop's forward: from its batch to its backward)."""
        self.seconds[name] += end - start
        if self.tracing:
            self.event(name, start, end, "phases")

    def backward(self, run) -> None:
        """Run a backward pass, splitting its time at the last gradient bucket's issue."""
        start = time.perf_counter()
        self.last_issue = None
        run()
        end = time.perf_counter()
        split = self.last_issue if self.last_issue is not None else end
        self.seconds["backward"] += split - start
        self.seconds["comm"] += end - split
        if self.tracing:
            self.event("backward", start, split, "phases")
            if end > split:
                self.event("comm (wait)", split, end, "phases")

    def collective(self, name: str):
        """Mark a collective issued now; returns the callback to call when it completes."""
        issued = time.perf_counter()
        self.last_issue = issued
        tracing = self.tracing

        def completed() -> None:
            done = time.perf_counter()
            with self.lock:
                self.comm_busy += done - issued
                if tracing:
                    self.event(name, issued, done, "collectives")

        return completed

    def waited(self, name: str, start: float, end: float) -> None:
        """A blocking wait on communication inside a phase (a pipeline stage's send/recv): it
        counts as comm, not as the phase around it."""
        self.seconds["comm"] += end - start
        self.nested += end - start
        self.comm_busy += end - start
        if self.tracing:
            self.event(name, start, end, "collectives")

    def finish(self) -> tuple[float, ...]:
        """End the step: its FIGURES (idle = the step time no phase covers)."""
        step_s = time.perf_counter() - self.started
        self.seconds["idle"] = max(0.0, step_s - sum(v for k, v in self.seconds.items() if k != "idle"))
        if self.tracing:
            self.event(f"step {self.step}", self.started, self.started + step_s, "steps")
        nbytes, calls = self.counter.take() if self.counter is not None else (0, 0)
        return (*(self.seconds[p] for p in PHASES), step_s, self.comm_busy, float(nbytes), float(calls))


class NullClock:
    """Monitoring off: the same calls, nothing timed."""

    def begin(self, step: int) -> None:
        pass

    @contextmanager
    def phase(self, name: str):
        yield

    def span(self, name: str, start: float, end: float) -> None:
        pass

    def backward(self, run) -> None:
        run()

    def waited(self, name: str, start: float, end: float) -> None:
        pass
