"""The parameter-server wire: a fixed integer header, then a flat tensor, point to point.

Written here because torch offers no parameter-server transport but its RPC framework, which
is in maintenance mode (and pickles). A message is a header of HEADER int64 values (two of
them float64 bit patterns) on a gloo group of its own, where a server receives from any
source, then, for pushes and parameters, a payload that is a range of a pre-allocated flat
buffer, on the job's group (gloo on CPU, NCCL on GPU, where only named sources exist, which is
why the header travels apart). Between two ranks messages arrive in the order sent, so a
payload always follows its header. Nothing is pickled.
"""

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

HEADER = 8


class Kind(IntEnum):
    PUSH = 1
    """worker -> server: one bucket of a gradient (payload follows)."""
    COMMIT = 2
    """worker -> server: every bucket of a share is pushed (its samples, loss and gradient norm)."""
    PULL = 3
    """worker -> server: send me your shard once your version is at least `version`."""
    TAKE = 4
    """worker -> dispatcher: give me the next share to compute."""
    TASK = 5
    """dispatcher -> worker: the share (clock, chunk) is yours."""
    PARAMS = 6
    """server -> worker: my shard at `version` (payload follows)."""
    DONE = 7
    """dispatcher -> worker: no share is left in this segment."""


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
    loss: float = 0.0
    norm_sq: float = 0.0

    def encode(self) -> torch.Tensor:
        head = torch.tensor([int(self.kind), self.clock, self.chunk, self.version, self.samples, self.bucket, 0, 0],
                            dtype=torch.int64)
        head[6:].view(torch.float64).copy_(torch.tensor([self.loss, self.norm_sq], dtype=torch.float64))
        return head

    @classmethod
    def decode(cls, head: torch.Tensor) -> "Message":
        whole = head[:6].tolist()
        loss, norm_sq = head[6:].view(torch.float64).tolist()
        return cls(Kind(whole[0]), *whole[1:], loss=loss, norm_sq=norm_sq)


class Wire:
    """One rank's end of the wire. Sends never block; their works are kept until `settle`."""

    def __init__(self, header_group, payload_group, counter=None):
        self.header_group, self.payload_group, self.counter = header_group, payload_group, counter
        self.inbox = torch.zeros(HEADER, dtype=torch.int64)
        self.pending: list = []

    def send(self, dst: int, message: Message, payload: torch.Tensor | None = None) -> None:
        head = message.encode()
        self.pending.append((dist.isend(head, dst, group=self.header_group), head))  # the tensor lives until sent
        nbytes = head.numel() * head.element_size()
        if payload is not None:
            self.pending.append((dist.isend(payload, dst, group=self.payload_group), payload))
            nbytes += payload.numel() * payload.element_size()
        if self.counter is not None:
            self.counter.add(nbytes)

    def receive_any(self) -> tuple[int, Message]:
        """Blocks for the next header from anyone: (sender's rank, message)."""
        source = dist.recv(self.inbox, group=self.header_group)
        return source, Message.decode(self.inbox)

    def receive_from(self, source: int) -> Message:
        dist.recv(self.inbox, source, group=self.header_group)
        return Message.decode(self.inbox)

    def expect(self, source: int) -> tuple[torch.Tensor, object]:
        """Post a receive of the next header from `source`: (buffer, work)."""
        head = torch.zeros(HEADER, dtype=torch.int64)
        return head, dist.irecv(head, source, group=self.header_group)

    def payload_from(self, source: int, into: torch.Tensor):
        """Post a receive of a payload from `source` straight into `into` (a range of a flat buffer)."""
        return dist.irecv(into, source, group=self.payload_group)

    def settle(self) -> None:
        """Wait for every send issued so far (a buffer they read from may be reused after)."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []
