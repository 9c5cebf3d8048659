"""Observability (issue 6): the per-rank step breakdown against injected delays and a byte formula,
a straggler named with its phase, a diverged replica caught, the timeline, and the exporters.
Long runs (issue 13): a rank's monitoring state stays bounded, and summary.json's figures come
from running totals equal to those of the whole metrics history."""

import json
import statistics
import tracemalloc

import pytest
import torch
import torch.distributed as dist

from helpers import metrics, summary, train, weights
from runs import ddp_run, wide_run


def per_rank_steps(run_dir, rank):
    return [r for r in map(json.loads, (run_dir / f"steps-rank{rank}.jsonl").read_text().splitlines()) if "event" not in r]


PHASES = ("data", "forward", "backward", "comm", "optimizer", "idle")


def test_breakdown_covers_the_step_and_finds_the_injected_delay(straggler_run):
    run_dir = straggler_run["dir"]
    rows = metrics(run_dir)[5:]  # past warm-up (DDP rebuilds its buckets in the first steps)
    for row in rows:
        b = row["breakdown"]
        for rank in (0, 1):
            total = sum(b[p][rank] for p in PHASES)
            assert abs(total - b["step_s"][rank]) <= 0.1 * b["step_s"][rank]
    # The measured phases (all but the remainder, idle) cover the step: idle stays under 10%.
    assert statistics.median(row["breakdown"]["idle"][r] / row["breakdown"]["step_s"][r]
                             for row in rows for r in (0, 1)) < 0.1
    # Rank 1 sleeps as long as its own step again inside its forward pass; rank 0 waits for it in
    # the gradient all-reduce: rank 1's extra forward time reappears as rank 0's communication wait.
    extra = statistics.median(row["breakdown"]["forward"][1] - row["breakdown"]["forward"][0] for row in rows)
    waited = statistics.median(row["breakdown"]["comm"][0] - row["breakdown"]["comm"][1] for row in rows)
    # ±50%: the extra is ~9 ms a step on 2 shared cores while the fixture scrapes Prometheus;
    # ±35% failed once in a clean CI run (waited 5.9 ms for 9.3 ms). Neither no wait nor double passes.
    assert extra > 0 and abs(waited - extra) <= 0.5 * extra, (extra, waited)
    # Bytes: one all-reduce of every float32 gradient per step (no accumulation), the formula.
    params = sum(t.numel() for t in weights(run_dir).values())
    assert all(row["breakdown"]["comm_bytes"] == [4.0 * params] * 2 for row in rows)
    # Each rank's own file holds the same figures as the gathered metrics.
    mine = {r["step"]: r for r in per_rank_steps(run_dir, 1)}
    for row in rows:
        assert mine[row["step"]]["forward"] == pytest.approx(row["breakdown"]["forward"][1], abs=1e-5)


def test_the_straggler_is_named_with_its_phase(straggler_run):
    run_dir = straggler_run["dir"]
    alerts = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines()]
    stragglers = [a for a in alerts if a["kind"] == "straggler"]
    assert stragglers and {(a["rank"], a["phase"]) for a in stragglers} == {(1, "compute")}
    assert "rank 1 is a straggler (compute)" in straggler_run["stderr"]
    flagged = [row for row in metrics(run_dir) if "stragglers" in row]
    assert flagged and all(s["rank"] == 1 for row in flagged for s in row["stragglers"])
    # Busy times 2:1 give max/mean - 1 = 2/1.5 - 1 = 1/3; balanced ranks score near 0.
    assert statistics.median(row["imbalance"] for row in metrics(run_dir)[5:]) > 0.25


def test_the_phase_is_named_from_the_whole_streak_not_its_last_step():
    from gradmesh.monitor.stragglers import StragglerDetector

    def step(forward1: float, comm_busy1: float) -> dict[str, list[float]]:
        zero = [0.0, 0.0]
        return {"step_s": [2.0, 2.0], "comm": [1.0, 0.0], "idle": zero, "data": zero, "backward": zero,
                "optimizer": zero, "forward": [1.0, forward1], "comm_busy_s": [1.0, comm_busy1]}

    detector = StragglerDetector(margin=0.5, steps=3)
    # Rank 1 computes 1 s longer for two steps; in the third its collectives run 1.5 s longer
    # (its peer was busy elsewhere) and its compute only 0.9 s: that step alone says communication.
    for s, (forward1, comm_busy1) in enumerate([(2.0, 1.0), (2.0, 1.0), (1.9, 2.5)]):
        flagged, alerts = detector.observe(s, step(forward1, comm_busy1))
    assert [(a["rank"], a["phase"]) for a in alerts] == [(1, "compute")]
    assert [f["rank"] for f in flagged] == [1]


def test_balanced_ranks_raise_no_alert_and_score_low(catalogue):
    run = ddp_run(catalogue, 2, "adamw")  # 20 steps, replicas compared every 5 (the parity run)
    assert (run / "alerts.jsonl").read_text() == ""
    assert statistics.median(row["imbalance"] for row in metrics(run)[5:]) < 0.2


def test_a_diverged_replica_is_reported_with_the_first_differing_tensor(tmp_path):
    result = train(tmp_path, 2, "--max-steps", "12", "--global-batch-size", "16", "--check-every", "5",
                   "--inject", "diverge:rank=1,step=7")
    alerts = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert [(a["kind"], a["step"], a["rank"]) for a in alerts] == [("divergence", 10, 1)]
    from gradmesh import config, workloads

    model = workloads.meta_model(config.build([config.load_toml(tmp_path / "config.toml")]))
    first = next(name for name, _ in model.named_parameters())  # the injection nudges the first parameter
    assert alerts[0]["tensor"] == first and "replicas diverged by step 10" in result.stderr


def test_pipeline_send_recv_is_timed_as_communication(catalogue):
    run = wide_run(catalogue, 2, "sgd", "--strategy", "pipeline", "--pp-schedule", "1f1b")  # test_pipeline's
    rows = metrics(run)
    # Each stage sends each sample's activations (forward) or their gradient (backward) once per
    # step: rows x block_size x n_embd float32 values (TINY: 16 x 32 x 32 x 4 bytes).
    assert all(row["breakdown"]["comm_bytes"] == [16 * 32 * 32 * 4.0] * 2 for row in rows)
    assert all(min(row["breakdown"]["comm"]) > 0 and min(row["breakdown"]["collectives"]) > 0 for row in rows)
    # Stages do different work by design: no straggler alert between them.
    assert (run / "alerts.jsonl").read_text() == ""


def test_trace_has_one_track_per_rank_with_phases_and_collectives(straggler_run):
    events = json.loads((straggler_run["dir"] / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["args"]["step"] for e in spans} == {3, 4}
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"data", "forward", "backward", "optimizer", "all_reduce", "step 3", "step 4"} <= names
    # Rank 0's all-reduce of step 4 cannot end before rank 1's forward of step 4 does (it waits for it).
    reduce0 = next(e for e in spans if e["pid"] == 0 and e["name"] == "all_reduce" and e["args"]["step"] == 4)
    forward1 = next(e for e in spans if e["pid"] == 1 and e["name"] == "forward" and e["args"]["step"] == 4)
    assert reduce0["ts"] + reduce0["dur"] >= forward1["ts"] + forward1["dur"] - 1000  # 1 ms clock slack


def test_tensorboard_and_prometheus_exports(straggler_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = straggler_run["dir"]
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    loss = accumulator.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 31))
    assert loss[-1].value == pytest.approx(metrics(run_dir)[-1]["loss"], rel=1e-5)
    text = straggler_run["prometheus"]  # scraped while the run was going on
    assert 'gradmesh_phase_seconds{phase="forward",rank="1"}' in text and "gradmesh_loss " in text


def test_monitoring_off_keeps_plain_metrics(tmp_path):
    train(tmp_path, 2, "--max-steps", "4", "--no-monitor")
    assert "breakdown" not in metrics(tmp_path)[0] and not list(tmp_path.glob("steps-rank*.jsonl"))


@pytest.mark.parametrize("args, words", [
    (["--trace-steps", "9:3"], ["--trace-steps '9:3'", "A:B"]),
    (["--prometheus-port", "70000"], ["prometheus_port", "1..65535"]),
    (["--check-every", "-1"], ["check_every", ">= 0"]),
])
def test_bad_monitoring_options_are_refused(cli, tmp_path, args, words):
    result = cli("train", "--run-dir", str(tmp_path), *args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert all(w in result.stderr for w in words), result.stderr


def summary_from_rows(rows: list[dict], alerts: int) -> dict:
    """summary.json's figures computed from every metrics row, as gradmesh did when each rank kept them all."""
    timed = [row for row in rows if "breakdown" in row]
    totals = {phase: sum(sum(row["breakdown"][phase]) for row in timed) for phase in PHASES}
    whole = sum(totals.values()) or 1.0
    return {"final_loss": rows[-1]["loss"], "model_state_bytes": rows[-1]["model_state_bytes"],
            "step_split": {phase: round(t / whole, 4) for phase, t in totals.items()},
            "imbalance_mean": round(sum(row.get("imbalance", 0.0) for row in timed) / len(timed), 4),
            "alerts": alerts}


def test_summary_from_running_totals_equals_the_one_from_every_metrics_row(catalogue, straggler_run):
    for run in (ddp_run(catalogue, 2, "adamw"), straggler_run["dir"]):  # the second has alerts
        alerts = len((run / "alerts.jsonl").read_text().splitlines())
        expected = summary_from_rows(metrics(run), alerts)
        assert {key: summary(run)[key] for key in expected} == expected


@pytest.fixture
def world_of_one():
    """A real one-rank gloo group in this process, for the step reporter's gathers."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_long_run_keeps_bounded_state_and_summarises_every_step(world_of_one, tmp_path):
    from gradmesh.config import MonitorConfig
    from gradmesh.monitor.monitor import Monitor
    from gradmesh.monitor.reporter import FIGURES, RunTotals, StepRecord, StepReporter

    monitor = Monitor(MonitorConfig(), tmp_path, 0, True)
    reporter = StepReporter(world_of_one, 10, tmp_path / "metrics.jsonl", on_row=monitor.on_row,
                            totals=RunTotals(recent=100))
    figures = torch.rand(2500, len(FIGURES), dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def run(steps):
        for step in steps:
            reporter.add(StepRecord(step, 0, 32, 32 * step, 1e-3, 0.01, figures[step - 1]))

    tracemalloc.start()
    run(range(1, 501))  # past the window of recent rows
    before = tracemalloc.get_traced_memory()[0]
    run(range(501, 2501))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    reporter.flush()
    assert grown < 64 * 1024, f"2,000 more steps grew the reporter and monitor by {grown:,} bytes"
    totals = reporter.totals
    assert len(totals.recent) == 100 and totals.last["step"] == 2500 and totals.breakdown_rows == 2500
    assert monitor.clock.events == []  # nothing traced without --trace-steps
    rows = metrics(tmp_path)
    assert len(rows) == 2500
    expected = summary_from_rows(rows, 0)
    assert {**monitor.summary(totals), "final_loss": totals.last["loss"],
            "model_state_bytes": totals.last["model_state_bytes"]} == expected


def test_a_trace_span_is_capped_with_one_line(capsys):
    from gradmesh.config import MonitorConfig
    from gradmesh.monitor.monitor import MAX_TRACED_STEPS, Monitor

    assert Monitor(MonitorConfig(trace_steps="5:8"), None, 0, True).clock.trace_range == (5, 8)
    assert capsys.readouterr().err == ""
    monitor = Monitor(MonitorConfig(trace_steps="10:100000"), None, 0, True)
    assert monitor.clock.trace_range == (10, 10 + MAX_TRACED_STEPS - 1)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--trace-steps 10:100000" in err and f"10:{9 + MAX_TRACED_STEPS}" in err
    Monitor(MonitorConfig(trace_steps="10:100000"), None, 1, False)  # one line from rank 0, not one per rank
    assert capsys.readouterr().err == ""
