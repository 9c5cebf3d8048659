"""`gradmesh monitor`: a live web dashboard of one run directory.

The standard library's http.server is enough: one page, plotly.js and one JSON route, read by
one person's browser (listener.py adds the Host check, the thread cap, the idle timeout and IPv6).
The page polls `/api/rows?after=N` every second and appends
what is new, so a finished run loads at once and a running one updates as rank 0 writes.
plotly.js is served from the installed `plotly` package: the machines training runs on often
have no route to a CDN.

Routes:
  /                      the page (static/dashboard.html)
  /static/plotly.min.js  plotly.js from the plotly package
  /api/rows?after=N      {"rows": metrics rows N.., "alerts": [...], "summary": {...} | null,
                          "status": "finished" | "running" | "waiting", "total": rows so far,
                          "generation": bumped when metrics.jsonl was rewritten (start from 0),
                          "run": {"name", "path", and strategy/mesh/model from config.toml}}
At most MAX_ROWS rows go in one answer; the page asks again at once while it has fewer than
"total".
"""

import importlib.util
import json
import math
import re
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qs

from gradmesh.errors import UsageError
from gradmesh.files import read_jsonl
from gradmesh.monitor import listener, runfiles

PAGE = Path(__file__).parent / "static" / "dashboard.html"
MAX_ROWS = 5000
ROW_INDEX = re.compile(r"[0-9]{1,12}")  # ASCII digits: str.isdigit() also takes "²", which int() refuses


def plotly_js() -> bytes:
    # find_spec locates the package without importing it (importing plotly takes seconds).
    spec = importlib.util.find_spec("plotly")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path.read_bytes()
    raise UsageError("the dashboard needs plotly.js from the 'plotly' package; pip install plotly")


class RunState:
    """What the API answers, read fresh from the run directory on each request."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.metrics = runfiles.MetricsTail(run_dir / "metrics.jsonl")

    def rows_after(self, after: int) -> dict:
        generation, rows = self.metrics.read()
        run = {"name": self.run_dir.resolve().name, "path": str(self.run_dir), **runfiles.read_config(self.run_dir)}
        return {
            "rows": rows[after : after + MAX_ROWS],
            "total": len(rows),
            "generation": generation,
            "alerts": self._alerts(),
            "summary": runfiles.read_summary(self.run_dir),
            "status": runfiles.status(self.run_dir),
            "run": run,
        }

    def _alerts(self) -> list[dict]:
        try:
            return read_jsonl(self.run_dir / "alerts.jsonl")
        except UsageError:  # no regular file (refused at start, swapped in since): skipped
            return []


def _finite(value):
    """NaN and infinity as null: a diverged loss is NaN, and browsers' JSON.parse rejects it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def make_handler(
    state: RunState, page: bytes, script: bytes, hosts: listener.HostCheck
) -> type[BaseHTTPRequestHandler]:
    class Handler(listener.OneLineErrors):
        def do_GET(self):
            hosts_sent = self.headers.get_all("Host")
            refused = hosts.refusal(",".join(hosts_sent) if hosts_sent else None)  # two Host headers: malformed
            if refused:
                self.send_error(*refused)
                return
            if not self.path.startswith("/"):  # e.g. "http://[", on which urlsplit would raise
                self.send_error(HTTPStatus.BAD_REQUEST, f"the request target must be a path, got {self.path!r}")
                return
            path, _, query = self.path.partition("?")
            if path in ("/", "/index.html"):
                self._send(page, "text/html; charset=utf-8", cache=False)
            elif path == "/static/plotly.min.js":
                self._send(script, "text/javascript; charset=utf-8", cache=True)
            elif path == "/api/rows":
                after = parse_qs(query).get("after", ["0"])[0]
                if not ROW_INDEX.fullmatch(after):
                    self.send_error(HTTPStatus.BAD_REQUEST, f"after must be a row index >= 0, got {after!r}")
                    return
                body = json.dumps(_finite(state.rows_after(int(after))), allow_nan=False, default=str)
                self._send(body.encode(), "application/json", cache=False)
            else:
                self.send_error(HTTPStatus.NOT_FOUND, f"no page {path!r}; the dashboard is at /")

        def _send(self, body: bytes, kind: str, cache: bool) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            self.end_headers()
            self.wfile.write(body)

    return Handler


def make_server(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8265) -> HTTPServer:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"run dir {str(run_dir)!r} does not exist; give the --run-dir of a gradmesh train run")
    runfiles.check_inputs(run_dir)
    handler = make_handler(RunState(run_dir), PAGE.read_bytes(), plotly_js(), listener.HostCheck(host))
    try:
        return listener.HTTP(host, port, handler)
    except OSError as exc:  # socket.gaierror too: a --host that names no address
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host") from None


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8265, on_ready=None) -> None:
    """Serve the dashboard of `run_dir` until Ctrl-C; `on_ready(url)` is called once listening."""
    server = make_server(run_dir, host, port)
    with server:
        if on_ready:
            on_ready(listener.url(server))
        try:
            server.serve_forever(poll_interval=0.5)
        except KeyboardInterrupt:
            pass
