"""The parameter-server messages as typed records: one per kind, each field named for what it
means in that kind, so the code that builds or reads a message never reuses a header field
under another meaning.

The wire still carries the fixed integer header (`gradmesh.comm.ps_wire.Message`, whose
generic fields the receivers' checks name in their errors); each record says how its fields
map onto that header (`message`) and back (`read`). Kinds without fields (RETRY, CANCEL,
FINISHED) and those whose header fields already mean one thing (PUSH, COMMIT, RETURN) are
records too, so every message is built the same way.
"""

from dataclasses import dataclass

from gradmesh.comm.ps_wire import Kind, Message


@dataclass(frozen=True)
class Push:
    """worker -> server: one bucket of a share's gradient (payload: the bucket)."""

    clock: int
    chunk: int
    pulled: int
    """The version of this server's shard the share was computed from."""
    bucket: int

    def message(self) -> Message:
        return Message(Kind.PUSH, clock=self.clock, chunk=self.chunk, version=self.pulled, bucket=self.bucket)


@dataclass(frozen=True)
class Commit:
    """worker -> every server: every bucket of the share (clock, chunk) is pushed."""

    clock: int
    chunk: int
    pulled: int
    """The version of this server's shard the share was computed from."""
    samples: int
    oldest: int
    """The lowest version over the servers the share was computed from."""
    loss: float
    """The share's summed loss."""
    norm_sq: float
    """The square of the share's gradient norm (hybrid: see `gradmesh.engine.ps.hybrid`)."""

    def message(self) -> Message:
        return Message(
            Kind.COMMIT, clock=self.clock, chunk=self.chunk, version=self.pulled, samples=self.samples,
            oldest=self.oldest, loss=self.loss, norm_sq=self.norm_sq,
        )  # fmt: skip

    @classmethod
    def read(cls, message: Message) -> "Commit":
        return cls(
            message.clock, message.chunk, message.version, message.samples, message.oldest, message.loss,
            message.norm_sq,
        )  # fmt: skip


@dataclass(frozen=True)
class Pull:
    """worker -> server: your shard, once your frontier reaches `least`, for a share of `clock`."""

    clock: int
    least: int
    """The least version wanted (`Mode.least_version`; may be negative early in a run)."""

    def message(self) -> Message:
        return Message(Kind.PULL, clock=self.clock, version=self.least)

    @classmethod
    def read(cls, message: Message) -> "Pull":
        return cls(message.clock, message.version)


@dataclass(frozen=True)
class Take:
    """worker -> dispatcher: my next share (`with_params`: and your shard, if you may send it)."""

    with_params: bool

    def message(self) -> Message:
        return Message(Kind.TAKE, version=int(self.with_params))

    @classmethod
    def read(cls, message: Message) -> "Take":
        return cls(with_params=bool(message.version))


@dataclass(frozen=True)
class Task:
    """dispatcher -> worker: the share (clock, chunk) is yours (`params_follow`: my PARAMS next)."""

    clock: int
    chunk: int
    params_follow: bool

    def message(self) -> Message:
        return Message(Kind.TASK, clock=self.clock, chunk=self.chunk, version=int(self.params_follow))

    @classmethod
    def read(cls, message: Message) -> "Task":
        return cls(message.clock, message.chunk, bool(message.version))


@dataclass(frozen=True)
class Params:
    """server -> worker: my shard (payload), as of `version`, after `updates` updates."""

    version: int
    """What the worker's share counts as computed from (`Mode.reported_version`)."""
    updates: int
    """Updates applied to the shard so far (weight prediction's measure)."""

    def message(self) -> Message:
        return Message(Kind.PARAMS, clock=self.updates, version=self.version)

    @classmethod
    def read(cls, message: Message) -> "Params":
        return cls(version=message.version, updates=message.clock)


@dataclass(frozen=True)
class SegmentDone:
    """dispatcher -> worker: no share is left in this segment (DONE)."""

    norm_sq: float
    """Lockstep: the square of the global gradient norm of the segment's last step (else 0)."""

    def message(self) -> Message:
        return Message(Kind.DONE, norm_sq=self.norm_sq)


@dataclass(frozen=True)
class Return:
    """worker -> dispatcher: I did not start the share (clock, chunk); hand it out again."""

    clock: int
    chunk: int

    def message(self) -> Message:
        return Message(Kind.RETURN, clock=self.clock, chunk=self.chunk)


@dataclass(frozen=True)
class RowsWanted:
    """worker -> server: the rows of `count` ids (payload), once the frontier reaches `least`."""

    clock: int
    least: int
    count: int

    def message(self) -> Message:
        return Message(Kind.ROWS, clock=self.clock, version=self.least, samples=self.count)

    @classmethod
    def read(cls, message: Message) -> "RowsWanted":
        return cls(message.clock, message.version, message.samples)


@dataclass(frozen=True)
class Rows:
    """server -> worker: the `count` rows asked for (payload), as of `version`."""

    count: int
    version: int
    norm_sq: float
    """Lockstep: the square of the global norm of the step before the request's."""

    def message(self) -> Message:
        return Message(Kind.ROWS, samples=self.count, version=self.version, norm_sq=self.norm_sq)

    @classmethod
    def read(cls, message: Message) -> "Rows":
        return cls(message.samples, message.version, message.norm_sq)


@dataclass(frozen=True)
class Grads:
    """worker -> server: the gradients of `count` rows (payloads: their ids, then the rows)."""

    count: int

    def message(self) -> Message:
        return Message(Kind.GRADS, samples=self.count)

    @classmethod
    def read(cls, message: Message) -> "Grads":
        return cls(message.samples)


def bare(kind: Kind) -> Message:
    """A message of a kind with no fields: RETRY, CANCEL, FINISHED."""
    assert kind in (Kind.RETRY, Kind.CANCEL, Kind.FINISHED), kind
    return Message(kind)
