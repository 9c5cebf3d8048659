"""Fault tolerance (issue 5): injected kills and hangs are detected; restart recovery resumes
from the latest checkpoint and in-place recovery goes on with the survivors, and either way the
run ends with the same model as a fault-free run, each sample of each step consumed once (the
per-step sample records equal the fault-free run's)."""

import json
import random

import pytest

from helpers import metrics, rel_l2, train, weights
from runs import ddp_run

TOLERANCE = 1e-5
ARGS = ["--max-steps", "20", "--global-batch-size", "16", "--checkpoint-every", "5", "--record-samples"]
RESTART = ["--recovery", "restart", "--max-restarts", "3"]


def records(run_dir, rank):
    return [json.loads(line) for line in (run_dir / f"samples-rank{rank}.jsonl").read_text().splitlines()]


def fired(run_dir):
    return [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fault_free(catalogue):
    """The 2-rank adamw run of ARGS (plus replica checks, which change nothing trained): the
    catalogue's, shared with the parity, resume and monitoring tests."""
    return ddp_run(catalogue, 2, "adamw")


def assert_same_as(run_dir, reference):
    assert rel_l2(weights(run_dir), weights(reference)) <= TOLERANCE
    for rank in (0, 1):  # exactly once: the same indices at the same steps, no step twice
        assert records(run_dir, rank) == records(reference, rank)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


def test_kill_at_a_seeded_random_step_is_survived_by_restart(fault_free, tmp_path):
    step = random.Random(20261202).randint(2, 19)
    result = train(tmp_path, 2, *ARGS, *RESTART, "--inject", f"kill:rank=1,step={step}")
    assert "injecting kill:rank=1" in result.stdout + result.stderr
    assert [f["fault"] for f in fired(tmp_path)] == [f"kill:rank=1,step={step}"]
    assert_same_as(tmp_path, fault_free)


@pytest.mark.slow  # restart recovery: the kill at a random step stays in the fast tier
def test_kill_during_a_checkpoint_write_resumes_from_the_one_before(fault_free, tmp_path):
    train(tmp_path, 2, *ARGS, *RESTART, "--inject", "kill:rank=0,step=10,at=checkpoint")
    assert fired(tmp_path)[0]["fault"] == "kill:rank=0,step=10,at=checkpoint"
    assert_same_as(tmp_path, fault_free)


@pytest.mark.slow  # two restarts; one kill with restart recovery stays in the fast tier
def test_two_failures_one_of_them_rank_0(fault_free, tmp_path):
    train(tmp_path, 2, *ARGS, *RESTART, "--inject", "kill:rank=1,step=7", "--inject", "kill:rank=0,step=13")
    assert [f["fault"] for f in fired(tmp_path)] == ["kill:rank=1,step=7", "kill:rank=0,step=13"]
    assert_same_as(tmp_path, fault_free)


def test_a_hang_is_detected_and_the_hung_rank_named(tmp_path):
    timeout = 3
    result = train(tmp_path, 2, *ARGS, "--step-timeout", str(timeout), "--inject", "hang:rank=1,step=4", check=False)
    assert result.returncode != 0
    assert "did not arrive: rank 1 (at step 4, micro-batch 0, started)" in result.stderr, result.stderr
    assert "the run hung" in result.stderr
    injected, *hangs = fired(tmp_path)  # the hung rank's own watchdog may report too
    assert hangs and all(h["event"] == "hang" and h["did_not_arrive"] == [1] for h in hangs)
    assert hangs[0]["time"] - injected["time"] <= timeout + 5
    for rank in (0, 1):  # every rank's Python stacks, the hung one inside the injected fault
        assert "Thread" in (tmp_path / f"stacks-rank{rank}.txt").read_text()
    assert "before_step" in (tmp_path / "stacks-rank1.txt").read_text()


def test_without_recovery_a_kill_ends_the_run_naming_the_rank(tmp_path):
    result = train(tmp_path, 2, *ARGS, "--inject", "kill:rank=1,step=3", check=False)
    assert result.returncode == 1 and "worker rank 1" in result.stderr and "SIGKILL" in result.stderr


def global_batches(run_dir):
    """Step -> the sorted indices all ranks consumed at that step (whoever consumed them)."""
    batches = {}
    for path in run_dir.glob("samples-rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            batches.setdefault(record["step"], []).extend(record["indices"])
    return {step: sorted(indices) for step, indices in batches.items()}


def assert_same_training(run_dir, reference):
    assert rel_l2(weights(run_dir), weights(reference)) <= TOLERANCE
    assert global_batches(run_dir) == global_batches(reference)  # every sample once, at its step
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


INPLACE = ["--recovery", "inplace", "--max-restarts", "0"]  # no replacement workers unless a test asks


@pytest.mark.parametrize("rank", [1, pytest.param(0, marks=pytest.mark.slow)])  # the same contract at rank 0
def test_inplace_recovery_survives_a_kill_at_a_seeded_random_step(fault_free, tmp_path, rank):
    step = random.Random(rank).randint(2, 19)
    result = train(tmp_path, 2, *ARGS, *INPLACE, "--inject", f"kill:rank={rank},step={step}")
    assert f"worker rank {rank} was killed by SIGKILL; ranks {1 - rank} carry on in place" in result.stderr
    assert_same_training(tmp_path, fault_free)


@pytest.mark.slow  # 4 ranks; the 2-rank in-place kills stay in the fast tier
def test_inplace_recovery_survives_two_failures_at_four_ranks(fault_free, tmp_path):
    # Balanced by measurement too: each regroup starts the shares again from equal for the ranks
    # left, and the training stays exact through both.
    train(tmp_path, 4, *ARGS, *INPLACE, "--balance", "auto", "--inject", "kill:rank=1,step=5",
          "--inject", "kill:rank=2,step=12")
    assert_same_training(tmp_path, fault_free)
    ranks = {row["step"]: len(row["shares"]) for row in metrics(tmp_path) if "shares" in row}  # where re-split
    assert all(n == (4 if step < 5 else 3 if step < 12 else 2) for step, n in ranks.items()), ranks


@pytest.mark.slow  # a hang (detected, fast tier) then in-place recovery (fast tier)
def test_inplace_recovery_survives_a_hang(fault_free, tmp_path):
    result = train(tmp_path, 2, *ARGS, *INPLACE, "--step-timeout", "3", "--inject", "hang:rank=1,step=6")
    assert "did not arrive: rank 1" in result.stderr
    assert_same_training(tmp_path, fault_free)


@pytest.mark.slow  # long: rank 0 slowed 0.7 s a step so the replacement joins mid-run
def test_a_replacement_joins_and_gets_the_state_from_a_live_peer(fault_free, tmp_path):
    # Rank 0 is slowed so the replacement (a new process: imports, model) joins mid-run; no
    # checkpoint is written before the end, so its state can only come from its live peer.
    result = train(tmp_path, 2, *ARGS, "--recovery", "inplace", "--max-restarts", "1", "--checkpoint-every", "0",
                   "--inject", "kill:rank=1,step=3", "--inject", "slow:rank=0,delay=0.7")
    assert "replacement worker rank 2 is starting" in result.stderr, result.stderr
    joined = records(tmp_path, 2)
    assert 3 < joined[0]["step"] < 20 and [r["step"] for r in joined] == list(range(joined[0]["step"], 21))
    assert {p.name for p in (tmp_path / "checkpoints").glob("step-*")} <= {"step-20"}
    assert_same_training(tmp_path, fault_free)


@pytest.mark.slow  # fast-tier budget: the replacement that joins covers the protocol
def test_a_replacement_too_late_to_join_leaves_without_failing_the_run(fault_free, tmp_path):
    result = train(tmp_path, 2, *ARGS, "--recovery", "inplace", "--max-restarts", "1", "--inject", "kill:rank=1,step=20")
    assert "the run finished before the replacement for rank 2 could join" in result.stderr, result.stderr
    assert not (tmp_path / "samples-rank2.jsonl").exists()
    assert_same_training(tmp_path, fault_free)


def test_inplace_recovery_is_refused_where_state_is_sharded(cli, tmp_path):
    result = cli("train", "--nproc", "2", "--run-dir", str(tmp_path), "--strategy", "fsdp", *INPLACE)
    assert result.returncode == 2 and "supports --strategy ddp" in result.stderr


@pytest.mark.parametrize("spec, words", [
    ("kill:rank=1", ["step >= 1"]),
    ("explode:rank=0,step=2", ["expected kill:rank=R,step=N"]),
    ("kill:rank=5,step=2", ["rank 5 does not exist", "0..1"]),
])
def test_bad_injections_are_refused_before_launch(cli, tmp_path, spec, words):
    result = cli("train", "--nproc", "2", "--run-dir", str(tmp_path), "--inject", spec)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert all(w in result.stderr for w in words), result.stderr


def test_the_rank_killed_from_outside_is_named_not_a_peer_that_aborted_after_it():
    """Under load the agent can reap a peer that aborted on the broken connection (SIGABRT) before
    the rank that was killed; the killed one is the cause."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from gradmesh.launch import describe_failure

    aborted = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGABRT, error_file="/nonexistent")
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file="/nonexistent")
    aborted.timestamp, killed.timestamp = 1, 2
    line = describe_failure(ChildFailedError("worker", {0: aborted, 1: killed}))
    assert line.startswith("gradmesh: worker rank 1 (pid 11) was killed by SIGKILL")
    assert "rank 0" in describe_failure(ChildFailedError("worker", {0: aborted}))
