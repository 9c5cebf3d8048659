"""What gradmesh's two HTTP listeners share: the dashboard (`gradmesh monitor`, http.server) and the
Prometheus endpoint (prometheus-client's WSGI app served by wsgiref).

Hand-written because neither http.server nor wsgiref (nor prometheus-client's start_http_server,
built on it) does any of this, and a web framework is a heavy dependency for two small endpoints:

- Which Host headers are answered. A web page can point a domain of its own at 127.0.0.1 (DNS
  rebinding) and read a loopback listener through its visitor's browser; its requests carry that
  domain as Host. A loopback listener answers only `localhost` and loopback addresses; one the
  user bound elsewhere also answers the name or address given to --host, any IP address (an
  address is no domain an attacker controls; behind NAT it differs from the bound one) and this
  machine's host name. The port is not compared: rebinding cannot change the name, and
  `ssh -L 9000:localhost:8265` forwarding arrives with another port.
- A malformed request is a 400 with one line of text, never a traceback.
- A connection that sends nothing for IDLE_TIMEOUT_S is closed, and at most MAX_HANDLERS
  connections hold a thread; the next ones get a 503 at once (the accepting thread never waits,
  so stopping the server stays prompt). A browser opens at most 6 connections a host.
- IPv6: the socket's family follows the address to bind (http.server's is always IPv4).
"""

import ipaddress
import re
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

IDLE_TIMEOUT_S = 10.0
MAX_HANDLERS = 32
WILDCARDS = {"", "0.0.0.0", "::"}
_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::(?P<port>[0-9]{0,5}))?", re.IGNORECASE)


def _address(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    address = _address(host)
    return address.is_loopback if address is not None else host.lower().rstrip(".") == "localhost"


def host_name(header: str) -> str:
    """The host of a Host header: lower case, no port, no trailing dot; ValueError if malformed."""
    match = _HOST.fullmatch(header)
    if not match or int(match["port"] or 0) > 65535:
        raise ValueError(header)
    if match["v6"]:
        return str(ipaddress.IPv6Address(match["v6"]))  # ValueError unless an IPv6 address
    return match["name"].lower().rstrip(".")


class HostCheck:
    """The Host headers a listener bound to `bound` answers (see the module docstring)."""

    def __init__(self, bound: str):
        self.loopback = is_loopback(bound)
        self.names = {"localhost"}
        if bound not in WILDCARDS:
            address = _address(bound)
            self.names.add(str(address) if address is not None else bound.lower().rstrip("."))
        if not self.loopback:  # getfqdn may ask DNS: only for a listener the network can reach
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}

    def refusal(self, header: str | None) -> tuple[HTTPStatus, str] | None:
        """None when a request with this Host header may be answered, else a status and one line."""
        if header is None:
            return None  # HTTP/1.0 clients send none; every browser does
        try:
            name = host_name(header)
        except ValueError:
            return HTTPStatus.BAD_REQUEST, f"malformed Host header {header!r}"
        address = _address(name)
        if name in self.names or (address is not None and (address.is_loopback or not self.loopback)):
            return None
        return HTTPStatus.FORBIDDEN, (
            f"Host {name!r} is not a name of this server (DNS rebinding?); "
            f"use one of {sorted(self.names)} or an IP address of it"
        )


def one_line(status: HTTPStatus, line: str) -> bytes:
    """A plain-text body of one line (a value's repr keeps control characters out of it)."""
    return f"{status.value} {status.phrase}: {' '.join(line.split())}\n".encode()


class OneLineErrors(BaseHTTPRequestHandler):
    """Errors (gradmesh's and http.server's own, e.g. a bad request line) as one line of text."""

    timeout = IDLE_TIMEOUT_S  # StreamRequestHandler sets it on the socket: each read waits this long

    def send_error(self, code, message=None, explain=None):
        status = HTTPStatus(code)
        body = one_line(status, message or explain or status.description)
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # http.server's guess for a request line it could not read
            self.request_version = "HTTP/1.0"  # ... under which it would answer no status line at all
        # The status line holds only the standard phrase: it must be latin-1, the body is UTF-8.
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format, *args):
        pass  # one line per poll each second would bury what the user needs


class WSGIHandler(OneLineErrors, WSGIRequestHandler):
    pass


if TYPE_CHECKING:
    # The mixin always sits before a TCPServer (HTTP, WSGI below); typed as one so its super() calls check.
    from socketserver import TCPServer as _MixedIntoServer
else:
    _MixedIntoServer = object


class CappedServer(ThreadingMixIn, _MixedIntoServer):
    """A thread per connection, at most MAX_HANDLERS at once; IPv4 or IPv6 by the address."""

    daemon_threads = True
    request_queue_size = 1024  # a burst waits in the kernel (no thread) for a 200 or a prompt 503, not a SYN retry

    def __init__(self, host: str, port: int, handler):
        self.address_family = family(host, port)
        self._slots = threading.BoundedSemaphore(MAX_HANDLERS)
        super().__init__((host, port), handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            _busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that timed out, hung up or reset: nothing to tell the user
        super().handle_error(request, client_address)


class HTTP(CappedServer, HTTPServer):
    pass


class WSGI(CappedServer, WSGIServer):
    pass


def family(host: str, port: int) -> socket.AddressFamily:
    """IPv4 where the host has an IPv4 address (as before), else IPv6 (`::1`, `::`)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    families = [info[0] for info in infos]
    return socket.AF_INET if socket.AF_INET in families else families[0]


def _busy(request: socket.socket) -> None:
    body = one_line(HTTPStatus.SERVICE_UNAVAILABLE, f"more than {MAX_HANDLERS} open connections; try again")
    try:
        request.setblocking(False)
        request.recv(65536)  # what the client sent already: closing with it unread would reset, losing the 503
    except OSError:
        pass
    try:
        request.settimeout(1)
        request.sendall(
            b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    except OSError:
        pass


def url(server: HTTPServer) -> str:
    host, port = server.server_address[:2]
    assert isinstance(host, str)  # an IP server's address is (host, port, ...) with a str host; bytes is AF_UNIX only
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def host_checked(app, check: HostCheck):
    """A WSGI app that answers only the Host headers `check` accepts."""

    def guarded(environ, start_response):
        refused = check.refusal(environ.get("HTTP_HOST"))  # wsgiref joins repeated headers with ","
        if refused is None:
            return app(environ, start_response)
        body = one_line(*refused)
        start_response(
            f"{refused[0].value} {refused[0].phrase}",
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return guarded


def serve_wsgi(app, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """prometheus-client's start_http_server, with the above: (server, its daemon thread)."""
    server = WSGI(host, port, WSGIHandler)
    server.set_app(host_checked(app, HostCheck(host)))
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="gradmesh-prometheus")
    thread.start()
    return server, thread
