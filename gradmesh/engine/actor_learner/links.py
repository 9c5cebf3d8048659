"""How trajectories and weights travel between an actor and its learner.

Over the parameter servers' wire (`gradmesh.comm.ps_wire`: an integer header on a gloo group of
its own, then a flat float32 payload; nothing pickled). A learner receives from each of its
actors by name, in a thread per actor, rather than from any source: gloo's receive from any
source cannot be cancelled, and a receive named for a peer that died fails on its own (the
connection closes), which tells the learner that this actor is lost while the others go on.
Between two ranks messages arrive in the order sent, so an actor's trajectories arrive in the
order it numbered them, a PULL after every trajectory sent before it, and its last message,
STOP with the number it sent in all, after all of them.

With one process (`--nproc 1`) the rank is its own actor: `LocalLink` passes the same messages
without a wire, so the single-process run is the same algorithm on the same code path.
"""

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from gradmesh.comm.ps_wire import Kind, Message, Wire, WireError

Arrival = tuple[int, Message | None, torch.Tensor | None]
"""(actor rank, message or None: the actor was lost, payload of a TRAJECTORY)."""


class LearnerEnd:
    """A learner's end of the wire to its actors."""

    def __init__(self, wire: Wire, actors: list[int], payload_size: int):
        self.wire, self.payload_size = wire, payload_size
        self.inbox: queue.Queue = queue.Queue()
        for rank in actors:
            threading.Thread(target=self._listen, args=(rank,), daemon=True, name=f"actor-{rank}").start()

    def _listen(self, rank: int) -> None:
        try:
            while True:
                message = self.wire.receive_from(rank).expect(rank, Kind.TRAJECTORY, Kind.PULL, Kind.STOP)
                payload = None
                if message.kind == Kind.TRAJECTORY:
                    payload = torch.empty(self.payload_size)
                    self.wire.payload_from(rank, payload).wait()
                self.inbox.put((rank, message, payload))
                if message.kind == Kind.STOP:  # the actor's last message
                    return
        except WireError as error:  # a message no actor sends: ends the learner with it
            self.inbox.put((rank, error, None))
        except RuntimeError:  # the connection closed: the actor is gone
            self.inbox.put((rank, None, None))

    def next(self, timeout: float) -> Arrival | None:
        """The next arrival from any actor, or None after `timeout` seconds of none."""
        try:
            rank, message, payload = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(message, WireError):
            raise message
        return rank, message, payload

    def answer(self, rank: int, version: int, params: torch.Tensor | None) -> None:
        """PARAMS (the weights at `version`) or, with no params, STOP."""
        if params is None:
            self.wire.send(rank, Message(Kind.STOP))
        else:
            self.wire.send(rank, Message(Kind.PARAMS, version=version), params)

    def settle(self) -> set[int]:
        """Sends finished; the ranks a send to failed (lost actors)."""
        return self.wire.settle(tolerant=True)


class ActorEnd:
    """An actor's end of the wire to its learner. A pull is asked for (`start`) and taken up at
    the first trajectory boundary after its answer arrived (`ready`, `finish`): the actor acts
    meanwhile instead of waiting for a learner busy with an update. gloo cannot say whether a
    posted receive has completed without waiting for it, so a thread waits for the answer; the
    receives are posted with the request, so the learner's answer is sent at once (a gloo send
    completes once its receive is posted)."""

    def __init__(self, wire: Wire, learner: int, size: int):
        self.wire, self.learner = wire, learner
        self.staging = torch.empty(size)
        self.arrived = threading.Event()
        self.answer: Message | Exception | None = None

    def send(self, sequence: int, version: int, steps: int, payload: torch.Tensor) -> None:
        self.wire.send(self.learner, Message(Kind.TRAJECTORY, clock=sequence, version=version, samples=steps), payload)

    def start(self, sent: int) -> None:
        """Ask for the learner's current weights, having sent `sent` trajectories (all of them out first)."""
        self.wire.settle()
        head, work = self.wire.expect(self.learner)
        payload = self.wire.payload_from(self.learner, self.staging)
        self.arrived.clear()
        threading.Thread(target=self._await, args=(head, work, payload), daemon=True).start()
        self.wire.send(self.learner, Message(Kind.PULL, clock=sent))

    def _await(self, head: torch.Tensor, work: Any, payload: Any) -> None:
        try:
            work.wait()
            answer = Message.decode(head, self.learner).expect(self.learner, Kind.PARAMS, Kind.STOP)
            if answer.kind == Kind.PARAMS:  # after STOP nothing follows: that receive stays posted
                payload.wait()
            self.answer = answer
        except (RuntimeError, WireError) as error:  # the learner is gone, or said what no learner says
            self.answer = error
        self.arrived.set()

    def ready(self) -> bool:
        return self.arrived.is_set()

    def finish(self, into: torch.Tensor) -> int | None:
        """The weights asked for by `start` (waiting for them), into `into`: their version, or
        None (STOP: the run is over)."""
        self.arrived.wait()
        answer = self.answer
        if isinstance(answer, Exception):
            raise answer
        assert answer is not None
        if answer.kind == Kind.STOP:
            return None
        into.copy_(self.staging)
        return answer.version

    def leave(self, sent: int) -> None:
        """Tell the learner this actor has stopped, having sent `sent` trajectories in all."""
        self.wire.send(self.learner, Message(Kind.STOP, clock=sent))
        self.wire.settle()


class LocalLink:
    """One process that is both actor and learner: the actor's messages handed over in memory.

    The learner side asks `next`, which runs the actor (`produce`, one trajectory) when nothing
    is waiting; the actor's PULL is answered at once by the learner's `on_pull` (and read by the
    actor at its next trajectory, as over the wire)."""

    RANK = 0

    def __init__(self, on_pull: Callable[[int, Message], tuple[int, torch.Tensor | None]]):
        self.on_pull = on_pull
        self.produce: Callable[[], bool] = lambda: False
        self.waiting: deque = deque()
        self.answered: tuple[int, torch.Tensor | None] = (0, None)

    # the learner's side
    def next(self, timeout: float) -> Arrival | None:
        if not self.waiting:
            self.produce()
        return self.waiting.popleft() if self.waiting else None

    def answer(self, rank: int, version: int, params: torch.Tensor | None) -> None:
        raise AssertionError("a local actor's pull is answered by on_pull")

    def settle(self) -> set[int]:
        return set()

    # the actor's side
    def send(self, sequence: int, version: int, steps: int, payload: torch.Tensor) -> None:
        self.waiting.append(
            (self.RANK, Message(Kind.TRAJECTORY, clock=sequence, version=version, samples=steps), payload)
        )

    def start(self, sent: int) -> None:
        self.answered = self.on_pull(self.RANK, Message(Kind.PULL, clock=sent))

    def ready(self) -> bool:
        return True

    def finish(self, into: torch.Tensor) -> int | None:
        version, params = self.answered
        if params is None:
            return None
        into.copy_(params)
        return version

    def leave(self, sent: int) -> None:
        self.waiting.append((self.RANK, Message(Kind.STOP, clock=sent), None))
