"""Which interface and address a node of a multi-node job uses, and whether it hosts the store.

Two things torch leaves to the host name go wrong on machines whose host name does not resolve
to the address the nodes reach each other at (containers, network namespaces, many clusters):
- c10d rendezvous decides who hosts its store by matching the endpoint against the host name
  and the addresses it resolves to; when the endpoint is an interface address, no node does and
  every node waits for a store nobody serves. The node that owns the endpoint's address hosts it
  here (`is_host` in the rendezvous configuration), unless `--rdzv-conf` says otherwise.
- gloo (and NCCL) listen on the address the host name resolves to (often 127.0.0.1), so peers on
  other machines are told to connect there, unless GLOO_SOCKET_IFNAME names an interface. The
  interface is the one the route to the endpoint leaves by (`--iface` overrides; a user's own
  GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win too).
A third is torch's: a launcher that restarts keeps the workers' store address it published in
the first round and publishes nothing in the next, so a node that joins late (a lost host's
replacement) waits for an address nobody writes; gradmesh turns off that
sharing of the rendezvous store (`gradmesh.env.fresh_store_each_round`), and every round
publishes its own.
Only the standard library is used: a UDP socket's connect picks the route without sending
anything, and SIOCGIFADDR names each interface's address.
"""

import fcntl
import socket
import struct

from gradmesh.errors import UsageError

SIOCGIFADDR = 0x8915


def endpoint_address(endpoint: str) -> tuple[str, int]:
    """(IPv4 address, port) of a HOST:PORT rendezvous endpoint (its form is checked with the config)."""
    host, _, port = endpoint.rpartition(":")
    try:
        return socket.gethostbyname(host), int(port)
    except (OSError, ValueError):
        raise UsageError(
            f"--rdzv-endpoint {endpoint!r}: {host!r} does not resolve to an address; give HOST:PORT "
            "with a host name or IPv4 address every node can reach"
        ) from None


def route_source(address: str, port: int) -> str:
    """The local address traffic to `address` leaves from."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((address, port))
        return sock.getsockname()[0]


def interface_addresses() -> dict[str, str]:
    """Interface name -> its IPv4 address, for the interfaces that have one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_for(address: str) -> str:
    """The interface holding the local `address` ('' if none does)."""
    return next((name for name, held in interface_addresses().items() if held == address), "")


def owns(address: str) -> bool:
    """Whether `address` is one of this machine's (or network namespace's)."""
    return address in interface_addresses().values()


def torch_would_host(host: str) -> bool:
    """torch's own guess, which tries to host and falls back to joining as a client."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(host)


def check_node(endpoint: str, iface: str) -> None:
    """UsageError for an endpoint that does not resolve or an interface this machine lacks."""
    endpoint_address(endpoint)
    held = interface_addresses()
    if iface and iface not in held:
        raise UsageError(
            f"--iface {iface!r} is not an interface with an IPv4 address here; "
            f"accepted: {', '.join(sorted(held)) or 'none found'}"
        )


def node_settings(endpoint: str, iface: str, local_addr: str, rdzv_conf: str, backend: str) -> dict:
    """This node's interface, local address and rendezvous configuration: {'iface', 'local_addr',
    'rdzv_conf'}."""
    check_node(endpoint, iface)
    address, port = endpoint_address(endpoint)
    if iface:
        local = local_addr or interface_addresses()[iface]
    else:
        local = local_addr or route_source(address, port)
        iface = interface_for(local)
    conf = [item for item in rdzv_conf.split(",") if item]
    host = endpoint.rpartition(":")[0]
    if backend == "c10d" and not any(item.startswith("is_host=") for item in conf):
        if owns(address) and not torch_would_host(host):
            conf.append("is_host=true")
    return {"iface": iface, "local_addr": local, "rdzv_conf": ",".join(conf)}
