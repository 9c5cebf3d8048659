"""c10d stores that listen on loopback only, on one machine (contract 8).

torch's TCPStore server listens on every interface whatever host name it is given (it binds
the wildcard address `::`), so a single-machine job's store — which hands out rank 0's address,
decides who joins, and whose values torch elastic unpickles — would be reachable from the
network. The TCPStore accepts an already-listening socket instead (`master_listen_fd`); these
helpers bind one to 127.0.0.1 and hand it over.

`LoopbackTCPStore` is a TCPStore whose servers do that; `loopback_servers()` makes torch elastic
create its stores (the rendezvous store and the store the workers share) as such, in the
launcher of a single-machine job. Multi-node jobs need the store on a routable interface: there
the network must be trusted (docs/multi-node.md#network).
"""

import contextlib
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"

ANSWER_S = 30.0
"""How long one attempt to join a store waits for the server's answer before it connects again
(a join takes milliseconds; where the name service does not answer, torch's lookup of the
socket's host name can add 5 or 10 s)."""
JOIN_S = 300.0
"""The least time a join is given in all, however short the store's `timeout` for its operations."""


def loopback_listener(port: int = 0) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((LOOPBACK, port))
        listener.listen(1024)
    except OSError:
        listener.close()
        raise
    return listener


class LoopbackTCPStore(dist.TCPStore):
    """A TCPStore; as the server, it listens on 127.0.0.1 only (clients are unchanged)."""

    def __init__(self, host_name: str, port: int, *args, **kwargs):
        is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
        if is_master and kwargs.get("master_listen_fd") is None:
            listener = loopback_listener(port)
            port = listener.getsockname()[1]
            kwargs["master_listen_fd"] = listener.detach()  # the store owns (and closes) it now
            host_name = LOOPBACK
        super().__init__(host_name, port, *args, **kwargs)


def client(host: str, port: int, timeout: timedelta, **kwargs) -> dist.TCPStore:
    """A client of the store at host:port, `timeout` its operations' bound; the join itself gets
    that or `JOIN_S`, whichever is longer.

    torch's client constructor sends a ping and waits for the server's answer with no time limit
    of its own (its `timeout` bounds the connect, not that wait): an answer that never comes
    hangs the process for good. That happened here about once in 2,600 worker joins on a loaded
    2-core machine (a 4-rank job stuck before its first step, its other ranks waiting for it). So
    each attempt runs in a thread of its own and gets `ANSWER_S`; one that has not answered by
    then is left behind and a new connection is made, until the join's time is spent."""
    budget = max(timeout.total_seconds(), JOIN_S)
    deadline = time.monotonic() + budget
    while True:
        outcome = _join(host, port, timeout, kwargs, max(0.1, min(ANSWER_S, deadline - time.monotonic())))
        if "error" in outcome:
            raise outcome["error"]
        if "store" in outcome:
            return outcome["store"]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the job's store at {host}:{port} did not answer within {budget:.0f} s")
        print(
            f"gradmesh: the job's store at {host}:{port} did not answer in {ANSWER_S:.0f} s; joining it again",
            file=sys.stderr,
            flush=True,
        )


def _join(host: str, port: int, timeout: timedelta, kwargs: dict, wait_s: float) -> dict:
    """One attempt, in a thread given `wait_s`: {"store": ...}, {"error": ...} or, still waiting, {}
    (the thread is left to its wait, writing only to its own dict)."""
    outcome: dict = {}

    def join(into: dict) -> None:
        try:
            into["store"] = dist.TCPStore(host, port, is_master=False, timeout=timeout, **kwargs)
        except Exception as error:  # raised in the caller's thread
            into["error"] = error

    thread = threading.Thread(target=join, args=(outcome,), name="gradmesh-store-join", daemon=True)
    thread.start()
    thread.join(wait_s)
    return dict(outcome)


def loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux)."""
    names = dict(socket.if_nameindex())
    return next((name for name in names.values() if name.startswith("lo")), "lo")


def loopback_store(**kwargs) -> dist.TCPStore:
    """A store server on 127.0.0.1 at a free port (`.port`)."""
    return LoopbackTCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False, **kwargs)


@contextlib.contextmanager
def loopback_servers():
    """While open, torch elastic's rendezvous creates its store servers on loopback only.

    Its modules look the class up as `torch.distributed.TCPStore` or import the name itself
    (c10d and static rendezvous): both are pointed at `LoopbackTCPStore`, a subclass, so its
    isinstance checks still hold."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    owners = (dist, c10d_rendezvous_backend, static_tcp_rendezvous)
    saved = [owner.TCPStore for owner in owners]
    for owner in owners:
        owner.TCPStore = LoopbackTCPStore
    try:
        yield
    finally:
        for owner, original in zip(owners, saved):
            owner.TCPStore = original
