"""Checkpoints: resume equals an uninterrupted run; a half-written checkpoint is never used."""

import shutil

from gradmesh.fault import checkpoint
from helpers import metrics, rel_l2, train, weights

ARGS = ["--global-batch-size", "16", "--optimizer", "adamw", "--checkpoint-every", "5"]


def test_ten_steps_then_resume_to_twenty_equals_twenty(tmp_path):
    train(tmp_path / "whole", 2, *ARGS, "--max-steps", "20")
    train(tmp_path / "split", 2, *ARGS, "--max-steps", "10")
    assert checkpoint.latest_checkpoint(tmp_path / "split").name == "step-10"
    train(tmp_path / "split", 2, "--resume", "--max-steps", "20")
    assert rel_l2(weights(tmp_path / "split"), weights(tmp_path / "whole")) <= 1e-6
    steps = [m["step"] for m in metrics(tmp_path / "split")]
    assert steps == list(range(1, 21))  # the resumed run appends steps 11..20
    whole, split = metrics(tmp_path / "whole"), metrics(tmp_path / "split")
    assert [m["samples"] for m in split] == [m["samples"] for m in whole]


def test_resume_at_another_world_size(tmp_path):
    """Data-parallel checkpoints hold whole replicas: 2 ranks may continue what 1 rank began."""
    train(tmp_path / "whole", 1, *ARGS, "--max-steps", "12")
    train(tmp_path / "split", 1, *ARGS, "--max-steps", "6")
    train(tmp_path / "split", 2, "--resume", "--max-steps", "12")
    assert rel_l2(weights(tmp_path / "split"), weights(tmp_path / "whole")) <= 1e-5


def test_half_written_checkpoint_is_ignored(tmp_path):
    run = tmp_path / "run"
    train(run, 1, *ARGS, "--max-steps", "10", "--set", "checkpoint.keep=0")
    root = run / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-10", "step-5"]
    # A crash mid-write leaves the temporary folder, or (worse) a folder missing its state file.
    shutil.copytree(root / "step-10", root / ".tmp-step-15")
    shutil.copytree(root / "step-10", root / "step-20")
    (root / "step-20" / "trainer_state.json").unlink()
    assert checkpoint.latest_checkpoint(run).name == "step-10"
    train(run, 1, "--resume", "--max-steps", "12")
    assert metrics(run)[-1]["step"] == 12


def test_keep_prunes_old_checkpoints(tmp_path):
    train(tmp_path, 1, *ARGS, "--max-steps", "20", "--set", "checkpoint.keep=2")
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-20", "step-15"]
