"""The dashboard and the report, on a real run with an injected straggler (the session's
`straggler_run`); a hand-written run dir checks reading files while they are being written."""

import contextlib
import html
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from helpers import TINY, free_port, gradmesh, listening_sockets, metrics
from runs import BALANCED, digits_run
STEPS, WORLD = 30, 2
STRAGGLER_FROM = 5
STRAGGLER_MESSAGE = "rank 1 is a straggler (compute): 60% slower than the other ranks since step 5"
PHASES = ("data", "forward", "backward", "comm", "optimizer", "idle")


def fake_run(path: Path) -> Path:
    """A plausible finished 2-rank, 30-step run in which rank 1 computes 60% slower from step 5."""
    path.mkdir(parents=True, exist_ok=True)
    start, rows, samples = 1_764_000_000.0, [], 0
    for step in range(1, STEPS + 1):
        slow = 1.6 if step >= STRAGGLER_FROM else 1.0
        busy = {"data": [0.004, 0.004], "forward": [0.020, 0.020 * slow], "backward": [0.040, 0.040 * slow],
                "comm": [0.010, 0.010], "optimizer": [0.005, 0.005]}
        per_rank = [sum(busy[p][r] for p in busy) for r in range(WORLD)]
        step_s = max(per_rank) + 0.002
        breakdown = {**busy, "idle": [step_s - b for b in per_rank], "step_s": [step_s] * WORLD,
                     "comm_bytes": [4_000_000] * WORLD}
        samples += 32
        row = {"step": step, "epoch": 0, "loss": 4.2 * math.exp(-step / 12) + 0.6 + 0.02 * math.sin(step),
               "lr": 1e-3, "samples": samples, "step_time_s": step_s, "samples_per_s": 32 / step_s,
               "time": start + step * step_s, "model_state_bytes": [48_000_000, 48_000_000],
               "peak_memory_bytes": [180_000_000, 196_000_000], "breakdown": breakdown,
               "imbalance": max(per_rank) / (sum(per_rank) / WORLD) - 1}
        if slow > 1:
            row["stragglers"] = [{"rank": 1, "phase": "compute", "excess": 0.6}]
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    alert = {"time": rows[STRAGGLER_FROM - 1]["time"], "step": STRAGGLER_FROM, "kind": "straggler", "rank": 1,
             "phase": "compute", "message": STRAGGLER_MESSAGE}
    (path / "alerts.jsonl").write_text(json.dumps(alert) + "\n")
    summary = {"steps": STEPS, "samples_per_s": samples / (rows[-1]["time"] - start), "final_loss": rows[-1]["loss"],
               "world_size": WORLD, "strategy": "ddp", "wall_s": 3.2, "peak_memory_bytes": [180_000_000, 196_000_000]}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


@pytest.fixture
def run_dir(tmp_path):
    return fake_run(tmp_path / "straggler-run")


def assert_one_line_error(result, *words):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("gradmesh: error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def straggler_alert(run) -> str:
    return next(a["message"] for a in run["alerts"] if a["kind"] == "straggler")


# --- report -----------------------------------------------------------------------------------

def test_report_writes_html_and_four_plots(straggler_run):
    run_dir = straggler_run["dir"]
    result = gradmesh("report", str(run_dir), timeout=120)
    assert result.returncode == 0, result.stderr
    page = Path(result.stdout.strip())
    assert page == run_dir / "report.html" and page.is_file()
    for name in ("loss", "throughput", "breakdown", "memory"):
        png = run_dir / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
        assert f'src="report/{name}.png"' in page.read_text()
    text = page.read_text()
    assert html.escape(straggler_alert(straggler_run)) in text and "ddp" in text and "imbalance" in text


def test_report_of_a_dir_without_metrics_is_a_usage_error(cli, tmp_path):
    assert_one_line_error(cli("report", str(tmp_path)), "no metrics.jsonl", "gradmesh run dir")
    assert_one_line_error(cli("report", str(tmp_path / "nope")), "nope", "does not exist")


def test_report_without_breakdown_says_so(run_dir):
    from gradmesh.monitor.report import write_report

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    old = [{k: v for k, v in r.items() if k not in ("breakdown", "imbalance", "stragglers")} for r in rows]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (run_dir / "summary.json").unlink()
    page = write_report(run_dir)
    assert "no breakdown recorded" in page.read_text() and "running" in page.read_text()
    assert not (run_dir / "report" / "breakdown.png").exists() and (run_dir / "report" / "loss.png").is_file()


# --- reading a run directory while it is written ---------------------------------------------

def test_api_tolerates_a_half_written_line_and_a_rewrite(tmp_path):
    from gradmesh.monitor.dashboard import RunState

    state = RunState(tmp_path)
    assert state.rows_after(0)["status"] == "waiting"
    lines = (fake_run(tmp_path / "src") / "metrics.jsonl").read_text().splitlines(keepends=True)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(lines[:3]) + lines[3][:20])
    answer = state.rows_after(0)
    assert answer["status"] == "running" and answer["summary"] is None
    assert [r["step"] for r in answer["rows"]] == [1, 2, 3]
    with open(metrics, "a") as handle:
        handle.write(lines[3][20:] + lines[4])
    answer = state.rows_after(3)
    assert [r["step"] for r in answer["rows"]] == [4, 5] and answer["total"] == 5
    generation = answer["generation"]
    metrics.write_text("".join(lines[:2]) + lines[2].replace('"epoch": 0', '"epoch": 9'))  # a restart redid step 3
    answer = state.rows_after(0)
    assert answer["generation"] > generation and [r["epoch"] for r in answer["rows"]] == [0, 0, 9]


def test_monitor_usage_errors(cli, tmp_path):
    assert_one_line_error(cli("monitor", str(tmp_path / "nope")), "nope", "does not exist")
    assert_one_line_error(cli("monitor", str(tmp_path), "--port", "0"), "--port", "65535")
    assert_one_line_error(cli("monitor", str(tmp_path), "--port", "70000"), "--port", "70000")


def test_monitor_warns_when_it_listens_beyond_this_machine(cli, tmp_path, monkeypatch):
    import gradmesh.monitor.dashboard as dashboard

    monkeypatch.setattr(dashboard, "serve", lambda run_dir, host, port, on_ready: on_ready(f"http://{host}:{port}/"))
    assert cli("monitor", str(tmp_path)).stderr == ""
    warned = cli("monitor", str(tmp_path), "--host", "0.0.0.0").stderr.strip().splitlines()
    assert len(warned) == 1 and "warning: --host 0.0.0.0" in warned[0] and "no authentication" in warned[0]


# --- the dashboard, served by the real CLI -----------------------------------------------------

@contextlib.contextmanager
def serving(run_dir: Path, log_path: Path):
    """`gradmesh monitor RUN_DIR` on a free port, stopped on the way out; yields its URL."""
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "gradmesh", "monitor", str(run_dir), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"monitor exited: {log_path.read_text()}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "monitor did not listen within 60 s"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert f"http://127.0.0.1:{port}/" in log_path.read_text()


@pytest.fixture
def server(straggler_run, tmp_path):
    with serving(straggler_run["dir"], tmp_path / "monitor.log") as url:
        yield url


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.headers.get("Content-Type"), response.read()


def test_api_rows_after_n(server, straggler_run):
    kind, body = get(server + "api/rows?after=0")
    answer = json.loads(body)
    assert kind == "application/json" and answer["status"] == "finished"
    assert answer["rows"] == metrics(straggler_run["dir"]) and answer["total"] == STEPS
    assert answer["summary"]["strategy"] == "ddp"
    assert [a["message"] for a in answer["alerts"]] == [a["message"] for a in straggler_run["alerts"]]
    assert answer["run"]["name"] == straggler_run["dir"].name
    assert [r["step"] for r in json.loads(get(server + "api/rows?after=25")[1])["rows"]] == [26, 27, 28, 29, 30]
    assert json.loads(get(server + "api/rows?after=99")[1])["rows"] == []
    with pytest.raises(urllib.error.HTTPError) as bad:
        get(server + "api/rows?after=-1")
    assert bad.value.code == 400
    port = int(server.rsplit(":", 1)[1].strip("/"))
    assert [address for address, bound in listening_sockets() if bound == port] == ["127.0.0.1"]
    rebound = urllib.request.Request(server + "api/rows?after=0", headers={"Host": f"attacker.example:{port}"})
    with pytest.raises(urllib.error.HTTPError) as refused:  # DNS rebinding: a foreign name for 127.0.0.1
        urllib.request.urlopen(rebound, timeout=30)
    assert refused.value.code == 403
    kind, script = get(server + "static/plotly.min.js")
    assert kind.startswith("text/javascript") and len(script) > 1_000_000
    assert b'id="breakdown"' in get(server)[1]


@pytest.mark.slow  # fast-tier budget: the finished-run browser test draws the same page
def test_the_dashboard_follows_a_run_while_it_trains(tmp_path):
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    with serving(run_dir, tmp_path / "monitor.log") as url:
        assert json.loads(get(url + "api/rows?after=0")[1])["status"] == "waiting"
        # Both ranks slowed alike (no straggler): 30 steps take a few seconds, rows written every step.
        trainer = subprocess.Popen([sys.executable, "-m", "gradmesh", "train", "--nproc", "2", "--run-dir", str(run_dir),
                                    "--quiet", *TINY, "--max-steps", "30", "--global-batch-size", "16",
                                    "--set", "train.log_every=1", "--inject", "slow:rank=0,delay=0.15",
                                    "--inject", "slow:rank=1,delay=0.15"], stderr=subprocess.PIPE, text=True)
        seen = []
        while trainer.poll() is None:
            answer = json.loads(get(url + "api/rows?after=0")[1])
            seen.append((answer["status"], answer["total"]))
            time.sleep(0.3)
        assert trainer.wait() == 0, trainer.stderr.read()
        final = json.loads(get(url + "api/rows?after=0")[1])
    growing = sorted({total for status, total in seen if status == "running" and total > 0})
    assert len(growing) >= 3, seen  # rows arrived step by step while the run trained
    assert final["status"] == "finished" and final["total"] == 30 and final["summary"]["steps"] == 30


class Elements(HTMLParser):
    """Attributes and text of the elements with an id, and the text of each `li.alert`."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "col", "source", "wbr", "area", "base"}

    def __init__(self):
        super().__init__()
        self.by_id, self.alerts, self.body, self._open = {}, [], {}, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if "id" in attrs:
            self.by_id[attrs["id"]] = {**attrs, "text": ""}
        is_alert = tag == "li" and "alert" in (attrs.get("class") or "").split()
        if is_alert:
            self.alerts.append("")
        if tag not in self.VOID:
            self._open.append((tag, attrs.get("id"), len(self.alerts) - 1 if is_alert else None))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        for _, element_id, alert in self._open:
            if element_id:
                self.by_id[element_id]["text"] += data
            if alert is not None:
                self.alerts[alert] += data + " "


def dump(chromium, url: str, tmp_path) -> tuple["Elements", subprocess.CompletedProcess]:
    result = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
                             f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom", url],
                            capture_output=True, text=True, timeout=180)
    page = Elements()
    page.feed(result.stdout)
    return page, result


@pytest.mark.browser
def test_dashboard_draws_a_finished_run_in_a_browser(server, straggler_run, chromium, tmp_path):
    page, result = dump(chromium, server, tmp_path)
    assert page.body.get("data-rows") == str(STEPS), result.stdout[-2000:] + result.stderr[-2000:]
    charts = {name: page.by_id[name] for name in ("loss", "throughput", "breakdown", "memory")}
    for name, chart in charts.items():
        assert int(chart["data-points"]) > 0 and int(chart["data-traces"]) > 0, name
    assert int(charts["loss"]["data-points"]) == STEPS
    assert charts["breakdown"]["data-traces"] == str(len(PHASES))
    assert page.by_id["shares"]["data-points"] == "0"  # no --balance: equal shares, nothing to draw
    assert page.by_id["status"]["text"].strip() == "finished"
    assert any(straggler_alert(straggler_run) in text for text in page.alerts), page.alerts
    assert straggler_run["dir"].name in page.by_id["run-name"]["text"]
    assert "world size 2" in page.by_id["run-meta"]["text"]


@pytest.mark.browser
def test_dashboard_draws_a_parameter_server_run_its_roles_and_staleness(catalogue, chromium, tmp_path):
    run = digits_run(catalogue, 3, "--strategy", "ps", "--ps-mode", "ssp:2", "--inject", "slow:rank=1,factor=4")  # test_ps's
    with serving(run, tmp_path / "monitor.log") as url:
        page, result = dump(chromium, url, tmp_path)
    steps = len(metrics(run))
    assert page.body.get("data-rows") == str(steps), result.stdout[-2000:] + result.stderr[-2000:]
    assert page.by_id["staleness"]["data-points"] == str(2 * steps)  # max and mean of every step
    assert page.by_id["breakdown"]["data-traces"] == "9"  # 5 worker phases and 4 server phases


@pytest.mark.browser
@pytest.mark.slow  # serves test_balance's run (slow-marked there)
def test_dashboard_plots_the_batch_shares_of_a_balanced_run(catalogue, chromium, tmp_path):
    run = catalogue.run(2, *BALANCED)
    with serving(run, tmp_path / "monitor.log") as url:
        page, result = dump(chromium, url, tmp_path)
    split = [row for row in metrics(run) if "shares" in row]
    assert split, result.stderr[-2000:]
    assert page.by_id["shares"]["data-traces"] == "2" and page.by_id["shares"]["data-points"] == str(2 * len(split))
