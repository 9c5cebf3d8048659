"""The two HTTP listeners (issue 25, item 7): the dashboard (`gradmesh monitor`) and the Prometheus
endpoint (`--prometheus-port`) answer only this server's Host names, answer malformed requests
with a one-line 400 and no traceback, cap their threads, close idle connections and bind IPv6
loopback. Each is served in this process (or by the real CLI) over a hand-written finished run."""

import contextlib
import json
import select
import socket
import threading
import urllib.request

import pytest

from helpers import free_port, listening_sockets
from test_dashboard import fake_run, serving


def raw(port: int, request: bytes, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """Send bytes as they are (no client library tidies them); the status and body answered."""
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1."), f"no HTTP answer to {request!r}: {answer!r}"
    return int(head.split()[1]), body


def get(target: str, host_header: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target.encode(), host_header.encode())


def malformed(target: str, port: int) -> list[tuple[bytes, int]]:
    """Requests a browser never sends, with the status each must get."""
    return [
        (get(target, "["), 400),
        (get(target, "localhost:99999"), 400),
        (get(target, f"[::1:{port}"), 400),
        (b"GET %s HTTP/1.1\r\nHost: h\xe9te\r\n\r\n" % target.encode(), 400),  # latin-1: no host name
        (b"GET %s HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n" % target.encode(), 400),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/9.9\r\nHost: localhost\r\n\r\n", 505),
        (get(target, f"evil.example:{port}"), 403),  # DNS rebinding: a foreign name for 127.0.0.1
        (get(target, f"127.0.0.1.nip.io:{port}"), 403),
    ]


def assert_one_line(status: int, body: bytes, expected: int, request: bytes) -> None:
    assert status == expected, (request, status, body)
    assert body.endswith(b"\n") and body.count(b"\n") == 1 and body.startswith(b"%d " % expected), (request, body)


def test_the_dashboard_refuses_foreign_hosts_and_malformed_requests_in_one_line(tmp_path):
    with serving(fake_run(tmp_path / "run"), tmp_path / "monitor.log") as url:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        cases = malformed("/api/rows?after=0", port) + [
            (get("/api/rows?after=%C2%B2", "localhost"), 400),  # "²".isdigit(), but int() refuses it
            (get("/api/rows?after=" + "9" * 5000, "localhost"), 400),  # past int()'s digit limit
            (get("http://[", "localhost"), 400),  # urlsplit() raises on it
        ]
        for request, expected in cases:
            assert_one_line(*raw(port, request), expected, request)
        for good in ("localhost", f"localhost:{port + 1}", f"127.0.0.1:{port}", "LOCALHOST."):  # +1: ssh -L forwarding
            status, body = raw(port, get("/api/rows?after=28", good))
            assert status == 200 and [row["step"] for row in json.loads(body)["rows"]] == [29, 30], good
        assert raw(port, b"GET /api/rows?after=29 HTTP/1.0\r\n\r\n")[0] == 200  # HTTP/1.0 sends no Host
        log = (tmp_path / "monitor.log").read_text()
    assert "Traceback" not in log and "Error" not in log, log


@contextlib.contextmanager
def prometheus(port: int):
    from gradmesh.monitor.exporters import PrometheusExporter

    exporter = PrometheusExporter(port)
    try:
        exporter.write({"step": 7, "loss": 1.5, "samples_per_s": 100.0})
        yield exporter
    finally:
        exporter.close()


def test_prometheus_refuses_foreign_hosts_and_malformed_requests_in_one_line(capfd):
    port = free_port()
    with prometheus(port):
        for request, expected in malformed("/metrics", port):
            assert_one_line(*raw(port, request), expected, request)
        status, body = raw(port, get("/metrics", f"localhost:{port}"))
        assert status == 200 and b"gradmesh_step 7.0" in body
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out, captured.err


@contextlib.contextmanager
def dashboard(run_dir, host="127.0.0.1"):
    """The dashboard's own server in this process: its threads are this test's to count."""
    from gradmesh.monitor.dashboard import make_server
    from gradmesh.monitor.listener import url

    server = make_server(run_dir, host, 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, url(server)
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def served(kind: str, tmp_path):
    """(port, path) of the dashboard or of Prometheus, served in this process."""
    if kind == "dashboard":
        with dashboard(fake_run(tmp_path / "run")) as (server, _):
            yield server.server_address[1], "/api/rows?after=0"
    else:
        port = free_port()
        with prometheus(port):
            yield port, "/metrics"


@pytest.mark.parametrize("kind", ["dashboard", "prometheus"])
def test_idle_connections_are_capped_and_closed_and_a_request_is_still_served(kind, tmp_path, monkeypatch):
    from gradmesh.monitor import listener

    assert listener.OneLineErrors.timeout == 10  # the default; 1 s here keeps the test short
    monkeypatch.setattr(listener.OneLineErrors, "timeout", 1.0)
    with served(kind, tmp_path) as (port, target):
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(300)]
        for sock in idle:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n")  # half a request, never finished
        # Each connection holds one of the capped threads until the server closes it for idling,
        # or is answered 503 at once; the client never hangs up.
        busy, closed, threads = set(), set(), 0
        for _ in range(600):
            threads = max(threads, threading.active_count() - before)
            open_ = [s for s in idle if s not in busy | closed]
            if not open_ or threads > listener.MAX_HANDLERS:
                break
            for sock in select.select(open_, [], [], 0.1)[0]:
                answer = sock.recv(4096)
                assert answer == b"" or answer.startswith(b"HTTP/1.0 503"), answer
                (busy if answer else closed).add(sock)
        assert threads <= listener.MAX_HANDLERS, f"{threads} threads for {len(idle)} idle connections"
        assert len(busy) + len(closed) == len(idle) and len(closed) >= listener.MAX_HANDLERS, (len(busy), len(closed))
        statuses = []
        while not statuses or statuses[-1] == 503 and len(statuses) < 50:  # a slot frees just after its close
            statuses.append(raw(port, get(target, "localhost"))[0])
        assert statuses[-1] == 200, statuses
        for sock in idle:
            sock.close()


def test_the_dashboard_listens_on_ipv6_loopback(tmp_path):
    with dashboard(fake_run(tmp_path / "run"), host="::1") as (server, url):
        port = server.server_address[1]
        assert url == f"http://[::1]:{port}/"
        assert [address for address, bound in listening_sockets() if bound == port] == ["::1"]
        with urllib.request.urlopen(url + "api/rows?after=0", timeout=30) as response:
            assert json.loads(response.read())["total"] == 30  # urllib sends Host: [::1]:port
        assert raw(port, get("/api/rows?after=0", "localhost"), host="::1")[0] == 200
        assert raw(port, get("/api/rows?after=0", f"evil.example:{port}"), host="::1")[0] == 403
