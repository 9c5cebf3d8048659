"""Reducers: average a flat gradient buffer over a process group, asynchronously.

`MeanAllReduce` is the arithmetic torch's default DDP hook does (divide by the group size, sum
by all-reduce). What gradmesh needs around any reducer is added by wrappers, installed on every
job whatever is switched on (a wrapper with nothing to report to passes straight through):

- `Counted`: bytes handed to collectives and their number, per step (`CommCounter`);
- `Timed`: the step clock sees each collective issued and completed (monitoring);
- `Guarded`: under in-place recovery the result fails at once when a member is lost, instead
  of blocking until the collective timeout (`gradmesh.fault.inplace.Membership.guard`).

A compression method is one more reducer; parameter-server pushes go through the same chain.
"""

import threading

import torch
import torch.distributed as dist

Future = torch.futures.Future


class Reducer:
    """Averages `tensor` in place over `group`; returns a future of the averaged tensor.

    `parts`: the (parameter name, shape) of each gradient in `tensor`, in order, where the caller
    knows them; reducers that keep state per parameter (error feedback) need them."""

    name = "reduce"
    carries_nonfinite = True
    """A NaN or infinity in any rank's input is in every rank's result (a plain or cast sum): the
    non-finite check can then read the reduced gradients instead of running a collective."""

    def reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, parts=None) -> Future:
        raise NotImplementedError

    def average(self, tensor: torch.Tensor, group: dist.ProcessGroup, parts=None) -> torch.Tensor:
        return self.reduce(tensor, group, parts).wait()

    def wire_bytes(self, tensor: torch.Tensor, parts=None) -> int:
        """Bytes of `tensor` as this reducer puts it on the wire (compressed ones: fewer)."""
        return tensor.numel() * tensor.element_size()

    def collectives(self, tensor: torch.Tensor, parts=None) -> int:
        """Collective calls one reduction of `tensor` makes (each pays the link's start-up latency)."""
        return 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must keep for a resumed run to reduce exactly as this one (this rank's)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class Wrapper(Reducer):
    """Passes state through to the reducer it wraps."""

    inner: Reducer

    @property
    def carries_nonfinite(self) -> bool:  # type: ignore[override]  # a wrapper answers for the reducer it wraps
        return self.inner.carries_nonfinite

    def collectives(self, tensor, parts=None):
        return self.inner.collectives(tensor, parts)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


class MeanAllReduce(Reducer):
    name = "all_reduce"

    def reduce(self, tensor, group, parts=None):
        tensor.div_(group.size())
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda done: done.value()[0])


class CommCounter:
    """Bytes and collectives of the current step, summed over threads (DDP's hooks run on its own)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bytes = self.calls = 0

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.bytes += nbytes
            self.calls += 1

    def take(self) -> tuple[int, int]:
        """This step's (bytes, collectives); starts the next step's count."""
        with self.lock:
            figures, self.bytes, self.calls = (self.bytes, self.calls), 0, 0
        return figures


class Counted(Wrapper):
    def __init__(self, inner: Reducer, counter: CommCounter):
        self.inner, self.counter, self.name = inner, counter, inner.name

    def reduce(self, tensor, group, parts=None):
        self.counter.add(self.inner.wire_bytes(tensor, parts))
        return self.inner.reduce(tensor, group, parts)


class Timed(Wrapper):
    def __init__(self, inner: Reducer, clock=None):
        """clock: gradmesh.monitor.breakdown.StepClock, or None with monitoring off."""
        self.inner, self.clock, self.name = inner, clock, inner.name

    def reduce(self, tensor, group, parts=None):
        if self.clock is None:
            return self.inner.reduce(tensor, group, parts)
        completed = self.clock.collective(self.name)

        def result(done: Future) -> torch.Tensor:
            completed()
            return done.value()  # raises the collective's error into the caller

        return self.inner.reduce(tensor, group, parts).then(result)


class Guarded(Wrapper):
    def __init__(self, inner: Reducer, membership=None):
        """membership: gradmesh.fault.inplace.Membership under in-place recovery, else None."""
        self.inner, self.membership, self.name = inner, membership, inner.name

    def reduce(self, tensor, group, parts=None):
        future = self.inner.reduce(tensor, group, parts)
        return self.membership.guard(future) if self.membership is not None else future


def build_reducer(counter: CommCounter, clock=None, membership=None, base: Reducer | None = None) -> Reducer:
    """The chain every job uses: guard outermost, so a lost member fails the caller at once."""
    return Guarded(Timed(Counted(base or MeanAllReduce(), counter), clock), membership)
