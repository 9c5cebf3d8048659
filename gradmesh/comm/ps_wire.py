"""The parameter-server wire: a fixed integer header, then a flat tensor, point to point (the
actor-learner engine's trajectories and weights travel on it too).

Written here because torch offers no parameter-server transport but its RPC framework, which
is in maintenance mode (and pickles). A message is a header of HEADER int64 values (two of
them float64 bit patterns) on a gloo group of its own, where a server receives from any
source, then, for pushes and parameters, a payload that is a range of a pre-allocated flat
buffer, on the job's group (gloo on CPU, NCCL on GPU, where only named sources exist, which is
why the header travels apart). Between two ranks messages arrive in the order sent, so a
payload always follows its header. Nothing is pickled.

A header is checked where it is received, before anything acts on it: here its kind and the
fields no message may have negative (`Message.decode`), by the receiver the fields it acts on
(`gradmesh.engine.ps.accept` on a server; the worker checks its answers). A header that fails
is a `WireError`, one line naming the sender's rank and the field, which ends that rank with it.

Code builds and reads messages through their typed records (`gradmesh.comm.ps_records`), whose
fields are named for what each kind means by them; `Message` is the header they travel as.
"""

import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, cast

import torch
import torch.distributed as dist

HEADER = 9
COUNTS = ("clock", "chunk", "samples", "bucket", "oldest")
"""Fields that count or index something: negative in no message (`version` may be: a pull for
step c under ssp:K asks for at least c - K)."""


class Kind(IntEnum):
    PUSH = 1
    """worker -> server: one bucket of a gradient (payload follows)."""
    COMMIT = 2
    """worker -> server: every bucket of a share is pushed (its samples, loss and gradient norm)."""
    PULL = 3
    """worker -> server: send me your shard once your version is at least `version`."""
    TAKE = 4
    """worker -> dispatcher: give me the next share to compute (`version` 1: and your shard with
    it, if the staleness bound lets you, which saves the pull's round trip)."""
    TASK = 5
    """dispatcher -> worker: the share (clock, chunk) is yours (`version` 1: my PARAMS follow)."""
    PARAMS = 6
    """server -> worker: my shard at `version`, after `clock` updates (payload follows)."""
    DONE = 7
    """dispatcher -> worker: no share is left in this segment (sync: `norm_sq`, the squared global
    gradient norm of its last step, which a hybrid worker clips its own step by)."""
    RETRY = 8
    """server -> worker, instead of PARAMS: give your share back and take another (an earlier
    share, lost with a worker, must be done first; waiting for it would wait forever)."""
    CANCEL = 9
    """worker -> server: forget my waiting PULL (answered RETRY if it was still waiting)."""
    RETURN = 10
    """worker -> dispatcher: I did not start the share (clock, chunk); hand it out again."""
    ROWS = 11
    """worker -> server: these `samples` rows (payload: their ids in the tables' one id space),
    once the server's version is at least `version`; the server answers ROWS with the rows
    (payload), its version and (the dispatcher, sync) the global norm of step `clock` - 1."""
    GRADS = 12
    """worker -> server: gradients of `samples` rows (payloads: their ids, then the rows)."""
    FINISHED = 13
    """worker -> server: my evaluation is done (the server stops answering its row requests)."""
    TRAJECTORY = 14
    """actor -> learner: trajectory number `clock` of this actor, acted by policy `version`, of
    `samples` environment steps (payload follows; `gradmesh.engine.actor_learner`). An actor's
    PULL carries the trajectories it has sent so far in `clock`, answered by PARAMS or STOP."""
    STOP = 15
    """learner -> actor, instead of PARAMS: the run is over. actor -> learner, its last message: I
    stopped, having sent `clock` trajectories in all."""


ANSWERS = 1
"""The tag of the dispatcher's answers to TAKE (TASK, DONE): apart from every other message, so a
worker may ask for its next share early (static dispatch) and still read its pull's answer,
which the dispatcher may send after that TASK, first."""


class WireError(Exception):
    """A header its receiver cannot act on. Not a RuntimeError: those are a peer that died in the
    middle of a message, which the engine survives by going on without it; this ends the job."""

    def __init__(self, sender: int, kind: "Kind | None", field: str, value, accepted: str):
        what = f"a {kind.name} message" if kind is not None else "a message"
        value = value.name if isinstance(value, Kind) else value
        super().__init__(
            f"parameter-server wire: rank {sender} sent {what} with {field}={value}, which is "
            f"not accepted here (accepted: {accepted})"
        )


@dataclass(frozen=True)
class Message:
    kind: Kind
    clock: int = 0
    """The global step (batch) the message is about."""
    chunk: int = 0
    """Which share of that batch."""
    version: int = 0
    samples: int = 0
    bucket: int = 0
    oldest: int = 0
    """COMMIT: the lowest version over the servers the share was computed from."""
    loss: float = 0.0
    norm_sq: float = 0.0

    def encode(self) -> torch.Tensor:
        head = torch.tensor(
            [int(self.kind), self.clock, self.chunk, self.version, self.samples, self.bucket, self.oldest, 0, 0],
            dtype=torch.int64,
        )
        head[7:].view(torch.float64).copy_(torch.tensor([self.loss, self.norm_sq], dtype=torch.float64))
        return head

    @classmethod
    def decode(cls, head: torch.Tensor, sender: int) -> "Message":
        """The message in a received header from rank `sender`; WireError: an unknown kind, a
        negative count or index, a negative squared norm (a NaN one is let through)."""
        whole = head[:7].tolist()
        loss, norm_sq = head[7:].view(torch.float64).tolist()
        if whole[0] not in Kind._value2member_map_:
            raise WireError(sender, None, "kind", whole[0], f"{min(Kind)}..{max(Kind)}")
        kind, clock, chunk, version, samples, bucket, oldest = whole
        message = cls(Kind(kind), clock, chunk, version, samples, bucket, oldest, loss, norm_sq)
        for name in COUNTS:
            message.check(sender, name, getattr(message, name) >= 0, "0 or more")
        message.check(sender, "norm_sq", not norm_sq < 0, "0 or more")
        return message

    def check(self, sender: int, field: str, accepted: bool, what: str) -> None:
        """WireError naming `field` unless `accepted` (`what`: the values that would be)."""
        if not accepted:
            raise WireError(sender, self.kind, field, getattr(self, field), what)

    def expect(self, sender: int, *kinds: Kind) -> "Message":
        """This message, if it is of one of `kinds` (what the receiver waits for); else WireError."""
        self.check(sender, "kind", self.kind in kinds, " or ".join(kind.name for kind in kinds))
        return self


class Wire:
    """One rank's end of the wire. Sends never block; their works are kept until `settle`."""

    def __init__(self, header_group, payload_group, counter=None) -> None:
        self.header_group, self.payload_group, self.counter = header_group, payload_group, counter
        self.pending: list = []
        self.incoming: tuple[Any, torch.Tensor, threading.Event, list[RuntimeError]] | None = None
        """A receive from anyone still posted: (work, header buffer, event set once it completed,
        the error it failed with)."""

    def send(self, dst: int, message: Message, payload: torch.Tensor | None = None) -> None:
        head = message.encode()
        tag = ANSWERS if message.kind in (Kind.TASK, Kind.DONE) else 0
        self.pending.append((dist.isend(head, dst, group=self.header_group, tag=tag), head, dst))  # lives until sent
        nbytes = head.numel() * head.element_size()
        if payload is not None:
            self.pending.append((dist.isend(payload, dst, group=self.payload_group), payload, dst))
            nbytes += payload.numel() * payload.element_size()
        if self.counter is not None:
            self.counter.add(nbytes)

    def send_payload(self, dst: int, payload: torch.Tensor) -> None:
        """A further payload after a message's first (GRADS: the rows after their ids)."""
        self.pending.append((dist.isend(payload, dst, group=self.payload_group), payload, dst))
        if self.counter is not None:
            self.counter.add(payload.numel() * payload.element_size())

    def receive_any(self, lookout=None) -> tuple[int, Message] | None:
        """Blocks for the next header from anyone: (sender's rank, message).

        `lookout`: a callable, true once a peer is lost. gloo cannot cancel a posted receive nor
        wake a thread blocked in one, so the receive is waited for in a helper thread and this
        returns None as soon as the lookout sees a loss; the receive stays posted, and the next
        call goes on waiting for it."""
        if self.incoming is None:
            head = torch.zeros(HEADER, dtype=torch.int64)
            posted: Any = dist.irecv(head, group=self.header_group)  # a receive from anyone: never None
            arrived, errors = threading.Event(), cast(list[RuntimeError], [])
            self.incoming = (posted, head, arrived, errors)
            if lookout is not None:
                threading.Thread(target=_wait_then_set, args=(posted, arrived, errors), daemon=True).start()
        work, head, arrived, errors = self.incoming
        if lookout is None:
            work.wait()
        else:
            while not arrived.wait(0.05):
                if lookout():
                    return None
        self.incoming = None
        if errors:
            raise errors[0]
        source = work._source_rank()
        return source, Message.decode(head, source)

    def receive_from(self, source: int) -> Message:
        inbox = torch.zeros(HEADER, dtype=torch.int64)
        dist.recv(inbox, source, group=self.header_group)
        return Message.decode(inbox, source)

    def expect(self, source: int, answer: bool = False) -> tuple[torch.Tensor, Any]:
        """Post a receive of the next header from `source` (`answer`: TASK or DONE): (buffer, work).
        A send completes only once its receive is posted, so one posted early lets the sender go on."""
        head = torch.zeros(HEADER, dtype=torch.int64)
        return head, dist.irecv(head, source, group=self.header_group, tag=ANSWERS if answer else 0)

    def payload_from(self, source: int, into: torch.Tensor):
        """Post a receive of a payload from `source` straight into `into` (a range of a flat buffer)."""
        return dist.irecv(into, source, group=self.payload_group)

    def settle(self, tolerant: bool = False) -> set[int]:
        """Wait for every send issued so far (a buffer they read from may be reused after).

        `tolerant`: a send to a peer that died fails; carry on and return those peers' ranks."""
        failed = set()
        for work, _, dst in self.pending:
            try:
                work.wait()
            except RuntimeError:
                if not tolerant:
                    raise
                failed.add(dst)
        self.pending = []
        return failed


def _wait_then_set(work, arrived: threading.Event, errors: list) -> None:
    """A helper thread's wait (a gloo work is waited for once: a second wait blocks)."""
    try:
        work.wait()
    except RuntimeError as err:
        errors.append(err)
    arrived.set()
