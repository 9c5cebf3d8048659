"""What a parameter server accepts from the wire: every header field it acts on, checked before
it acts on it.

A field out of range would otherwise index a list (a bucket past the shard's), divide (a commit
of zero samples), take the square root of a negative norm, or queue a share the segment does not
have; each of those fails far from its cause, or not at all. A failed check is a `WireError`
naming the sender and the field (`Message.decode` has already checked the kind and that no count
is negative). The rows a message's ids name are checked once its payload is here
(`ServerTables.message`).
"""

from gradmesh.comm.ps_wire import Kind, Message, WireError


def check_message(server, source: int, message: Message) -> None:
    """WireError unless `server` (a `Server` serving a segment) can act on this message."""
    message.check(source, "kind", message.kind in CHECKS, " or ".join(kind.name for kind in CHECKS))
    check_sender(source, message, server.workers)
    CHECKS[message.kind](server, source, message)


def check_lookup(server, source: int, message: Message, workers: int) -> None:
    """Evaluation: a row request (ROWS) or its end (FINISHED) from a worker."""
    message.expect(source, Kind.ROWS, Kind.FINISHED)
    check_sender(source, message, workers)
    if message.kind == Kind.ROWS:
        _rows(server, source, message)


def check_sender(source: int, message: Message, workers: int) -> None:
    """Servers hear from workers only (ranks 0..workers - 1)."""
    if not 0 <= source < workers:
        raise WireError(source, message.kind, "sender", source, f"a worker's rank, 0..{workers - 1}")


def _push(server, source: int, message: Message) -> None:
    count = len(server.buckets)
    message.check(
        source,
        "bucket",
        message.bucket < count,
        f"0..{count - 1}" if count else "none: this server holds no dense parameters",
    )


def _commit(server, source: int, message: Message) -> None:
    server.segment.check_share(source, message)
    samples = len(server.segment.indices(message.clock, message.chunk))
    message.check(source, "samples", message.samples == samples, f"{samples}, the share's samples")
    message.check(source, "version", 0 <= message.version <= server.version, f"0..{server.version}")
    message.check(source, "oldest", message.oldest <= message.version, f"0..{message.version}, the version")


def _pull(server, source: int, message: Message) -> None:
    server.segment.check_share(source, message)


def _rows(server, source: int, message: Message) -> None:
    held = server.tables.rows_held()
    message.check(source, "kind", held > 0, "no ROWS or GRADS: this server holds no table rows")
    message.check(source, "samples", message.samples <= held, f"0..{held}, the rows this server holds")


def _take(server, source: int, message: Message) -> None:
    _dispatcher_only(server, source, message)
    message.check(source, "version", message.version in (0, 1), "0 or 1")


def _return(server, source: int, message: Message) -> None:
    _dispatcher_only(server, source, message)
    server.segment.check_share(source, message)


def _dispatcher_only(server, source: int, message: Message) -> None:
    message.check(source, "kind", server.dispatcher is not None, "no TAKE or RETURN: this server is not the dispatcher")


def _anything(server, source: int, message: Message) -> None:
    pass


CHECKS = {
    Kind.PUSH: _push,
    Kind.COMMIT: _commit,
    Kind.PULL: _pull,
    Kind.ROWS: _rows,
    Kind.GRADS: _rows,
    Kind.TAKE: _take,
    Kind.RETURN: _return,
    Kind.CANCEL: _anything,
}
"""What a server serving a segment takes, and how each is checked (FINISHED: only while it
answers an evaluation's row requests, `Server.serve_lookups`)."""
