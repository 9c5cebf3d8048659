"""Chaos soak, the CI version (issue 13, item 9; the 50-fault soak is benchmarks/bench_soak.py).

One run per recovery mode under `--inject chaos:...`: seeded random kills (one in the middle of a
checkpoint write), hangs (caught by --step-timeout) and slow-downs, rank 0 among the targets.
The run completes; every step consumed the fault-free run's samples, each once; the final
weights differ from the fault-free run's by at most twice the summation-order floor between
fault-free runs at the world sizes the soak passes through (1 and 2)."""

import json

import pytest

from helpers import rel_l2, train, weights
from runs import RECORDED, STEPS, ddp_run
from test_faults import global_batches

SOAK = [*STEPS, "--optimizer", "adamw", *RECORDED, "--step-timeout", "2"]


@pytest.fixture(scope="module")
def floor(catalogue):
    """||θ(2 ranks) − θ(1 rank)|| / ||θ(1 rank)||: summation order alone, fault-free."""
    measured = rel_l2(weights(ddp_run(catalogue, 2, "adamw")), weights(ddp_run(catalogue, 1, "adamw")))
    assert 0 < measured < 1e-5
    return measured


def chaos_log(run_dir):
    return [entry for entry in map(json.loads, (run_dir / "faults.jsonl").read_text().splitlines())
            if entry.get("fault", "").startswith("chaos#")]


def assert_survived(run_dir, reference, floor):
    assert global_batches(run_dir) == global_batches(reference)  # every sample once, at its step
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))
    assert rel_l2(weights(run_dir), weights(reference)) <= 2 * floor


@pytest.mark.slow  # ~20 s: replacements need seconds to start, so the steps are paced (half a second)
def test_inplace_recovery_survives_a_chaos_soak(catalogue, floor, tmp_path):
    # seed 5: slow, a hang of rank 0, a kill during the step-10 checkpoint write (held back until
    # a replacement has joined: the last worker is spared), two more slow-downs
    result = train(tmp_path, 2, *SOAK, "--recovery", "inplace", "--max-restarts", "10",
                   "--inject", "chaos:faults=5,seed=5,pace=0.5")
    fired = chaos_log(tmp_path)
    assert sorted(int(e["fault"].split("#")[1].split(":")[0]) for e in fired) == [0, 1, 2, 3, 4], fired
    assert "hang detected" in result.stderr and "replacement worker rank 2 is starting" in result.stderr
    assert_survived(tmp_path, ddp_run(catalogue, 2, "adamw"), floor)


@pytest.mark.slow  # ~30 s: three restarts of every worker
def test_restart_recovery_survives_a_chaos_soak(catalogue, floor, tmp_path):
    # seed 13: rank 0 killed mid-write of the step-5 checkpoint, rank 1 killed at step 7, a hang of
    # rank 0 at step 11, two slow-downs
    train(tmp_path, 2, *SOAK, "--recovery", "restart", "--max-restarts", "5", "--inject", "chaos:faults=5,seed=13")
    fired = chaos_log(tmp_path)
    assert [e["fault"] for e in fired][:2] == ["chaos#0:kill@step=5,at=checkpoint", "chaos#1:kill@step=7"]
    assert len(fired) == 5 and {e["rank"] for e in fired if "kill" in e["fault"] or "hang" in e["fault"]} == {0, 1}
    # the hang was detected by the watchdog and survived by a restart (test_faults' hang-under-restart case)
    events = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "hang" for e in events)
    assert_survived(tmp_path, ddp_run(catalogue, 2, "adamw"), floor)


def test_a_chaos_plan_is_the_same_on_every_worker_and_spread_over_distinct_steps():
    from gradmesh.chaos import parse_chaos, plan

    chaos = parse_chaos("kill:rank=1,step=3;chaos:faults=40,seed=7,kinds=kill+slow")
    faults = plan(chaos, 100, 5)
    assert faults == plan(parse_chaos("chaos:faults=40,seed=7,kinds=kill+slow"), 100, 5)
    assert faults != plan(parse_chaos("chaos:faults=40,seed=8,kinds=kill+slow"), 100, 5)
    steps = [f.step for f in faults]
    assert len(set(steps)) == 40 and min(steps) >= 2 and max(steps) < 100
    assert {f.kind for f in faults} == {"kill", "slow"} and len({f.label for f in faults}) == 40
    assert all(f.step % 5 == 0 for f in faults if f.at == "checkpoint")
    assert any(f.at == "checkpoint" for f in faults)


@pytest.mark.parametrize("args, words", [
    (["--inject", "chaos:faults=30,seed=1", "--recovery", "restart"], ["30 faults need at least 32 steps"]),
    (["--inject", "chaos:faults=3,seed=1,kinds=kill"], ["needs --recovery"]),
    (["--inject", "chaos:faults=3,seed=1", "--recovery", "restart"], ["hangs needs --step-timeout"]),
    (["--inject", "chaos:faults=3"], ["chaos:faults=N,seed=S"]),
    (["--inject", "chaos:faults=3,seed=1,kinds=kill+boom"], ["kinds from kill+hang+slow"]),
    (["--inject", "chaos:faults=3,seed=1,pace=nan"], ["finite pace"]),
    (["--inject", "chaos:faults=2,seed=1;chaos:faults=2,seed=2"], ["at most one chaos"]),
])
def test_bad_chaos_specs_are_refused_before_launch(cli, tmp_path, args, words):
    from test_cli_errors import assert_usage_error

    assert_usage_error(cli("train", "--run-dir", str(tmp_path / "run"), "--max-steps", "20", *args), *words)
    assert not (tmp_path / "run").exists()
