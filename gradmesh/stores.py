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

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


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
