"""Checkpoints: resume equals an uninterrupted run; a half-written checkpoint is never used.

The runs stopped at step 10 and the uninterrupted 20-step runs come from the session's
catalogue; every test resumes or damages its own copy."""

import shutil

import pytest

from catalogue import copy_run
from gradmesh.fault import checkpoint
from helpers import metrics, rel_l2, train, weights
from runs import ddp_run, half_run


def test_ten_steps_then_resume_to_twenty_equals_twenty(catalogue, tmp_path):
    whole = ddp_run(catalogue, 2, "adamw")
    split = copy_run(half_run(catalogue, 2), tmp_path / "split")
    assert checkpoint.latest_checkpoint(split).name == "step-10"
    train(split, 2, "--resume", "--max-steps", "20")
    assert rel_l2(weights(split), weights(whole)) <= 1e-6
    steps = [m["step"] for m in metrics(split)]
    assert steps == list(range(1, 21))  # the resumed run appends steps 11..20
    assert [m["samples"] for m in metrics(split)] == [m["samples"] for m in metrics(whole)]


@pytest.mark.slow  # world size 1 -> 2; test_sharded's fsdp at 2 -> ddp at 1 keeps resharding in the fast tier
def test_resume_at_another_world_size(catalogue, tmp_path):
    """Data-parallel checkpoints hold whole replicas: 2 ranks may continue what 1 rank began."""
    split = copy_run(half_run(catalogue, 1), tmp_path / "split")
    train(split, 2, "--resume", "--max-steps", "20")
    assert rel_l2(weights(split), weights(ddp_run(catalogue, 1, "adamw"))) <= 1e-5


def test_a_crash_mid_write_leaves_nothing_that_stops_a_resume(catalogue, tmp_path):
    run = copy_run(half_run(catalogue, 1), tmp_path / "run")
    root = run / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-10", "step-5"]
    # A crash mid-write leaves the temporary folder, or (worse) a folder missing its state file,
    # and a metrics line cut short.
    shutil.copytree(root / "step-10", root / ".tmp-step-15")
    shutil.copytree(root / "step-10", root / "step-20")
    (root / "step-20" / "trainer_state.json").unlink()
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 11, "loss": 2.')
    assert checkpoint.latest_checkpoint(run).name == "step-10"
    train(run, 1, "--resume", "--max-steps", "12")
    assert [m["step"] for m in metrics(run)] == list(range(1, 13))  # the torn line gone, not glued to step 11


def test_keep_prunes_old_checkpoints(catalogue):
    run = ddp_run(catalogue, 1, "adamw")  # 20 steps, a checkpoint every 5, checkpoint.keep=2
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-20", "step-15"]
