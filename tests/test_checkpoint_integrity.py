"""Checkpoints are sealed whole (issue 25, item 5): every file, the state file included, is in the
checksums; a checkpoint without them, with an edited state, a malformed state or a shard path
outside its folder is damaged and skipped with a note for the previous intact one; pruning counts
only intact checkpoints. All on copies of the session's catalogued half run (step-5 and step-10,
both kept); one resume trains, the rest run in-process."""

import json
import pickle
import shutil

import pytest

from catalogue import copy_run
from gradmesh.fault import checkpoint, integrity, safeload
from helpers import metrics, train
from runs import half_run
from test_cli_errors import assert_usage_error


@pytest.fixture
def run(catalogue, tmp_path):
    return copy_run(half_run(catalogue, 1), tmp_path / "run")


def state_path(run, step):
    return run / "checkpoints" / f"step-{step}" / checkpoint.STATE_FILE


def edit_state(run, step, edit, forged=False):
    """Rewrite a checkpoint's state file by hand, as a user or a stray script might; `forged`:
    with its checksum made to match, so that only the checks of its content can catch it."""
    path = state_path(run, step)
    state = edit(json.loads(path.read_text()))
    if forged and isinstance(state, dict) and "files" in state:
        state["checksum"] = integrity.state_checksum(state)
    path.write_text(json.dumps(state))


def reseal(folder, **changes):
    """What gradmesh itself would have written for `folder` with `changes` to its state."""
    state = json.loads((folder / checkpoint.STATE_FILE).read_text())
    state = {k: v for k, v in dict(state, **changes).items() if k not in ("files", "checksum")}
    (folder / checkpoint.STATE_FILE).write_text(json.dumps(integrity.seal(state, folder)))


def notes(result):
    return [line for line in result.stderr.splitlines() if line.startswith("gradmesh: checkpoint ")
            and "is damaged" in line]


def test_the_state_file_is_sealed_with_the_shards(run):
    step = run / "checkpoints" / "step-10"
    state = checkpoint.read_state(step)
    assert set(state["files"]) == {p.name for p in step.iterdir()} - {checkpoint.STATE_FILE}
    assert checkpoint.verify(step) is None
    edit_state(run, 10, lambda s: dict(s, step=12))  # valid JSON, plausible value: only a checksum tells
    assert "fails its checksum" in checkpoint.verify(step)
    warned = []
    assert checkpoint.latest_good_checkpoint(run, warn=warned.append) == run / "checkpoints" / "step-5"
    assert len(warned) == 1 and "step-10 is damaged" in warned[0]


BROKEN_STATES = {
    "no files entry": lambda s: {k: v for k, v in s.items() if k not in ("files", "checksum")},
    "run: null": lambda s: dict(s, run=None),
    "a JSON list": lambda s: [s],
    "a file outside the folder": lambda s: dict(s, files=dict(s["files"], **{"../step-5/.metadata": digest_of_5})),
    "a step its folder does not name": lambda s: dict(s, step=12),
}
digest_of_5 = None  # set by the test: the real digest, so that only the name gives it away


@pytest.mark.parametrize("name", BROKEN_STATES)
def test_a_malformed_or_unsealed_state_is_skipped_for_the_previous_checkpoint(name, run, cli):
    """The launcher's checks read the state: --resume --max-steps 5 then has nothing left to train
    from step-5, which shows the choice without starting a worker."""
    global digest_of_5
    digest_of_5 = checkpoint.read_state(run / "checkpoints" / "step-5")["files"][".metadata"]
    edit_state(run, 10, BROKEN_STATES[name], forged=True)
    assert checkpoint.verify(run / "checkpoints" / "step-10") is not None
    result = cli("train", "--run-dir", str(run), "--resume", "--max-steps", "5")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert len(notes(result)) == 1 and "already at step 5" in result.stderr


def test_every_checkpoint_damaged_is_one_error_after_the_notes(run, cli):
    for step in (5, 10):
        edit_state(run, step, BROKEN_STATES["run: null"])
    result = cli("train", "--run-dir", str(run), "--resume")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    *noted, error = result.stderr.strip().splitlines()
    assert len(noted) == 2 == len(notes(result)) and error.startswith("gradmesh: error: ") and "damaged" in error


def test_a_torn_metadata_without_checksums_falls_back_on_export(run, cli, tmp_path):
    """Before: never verified, so DCP's unpickling of the torn file ended in a traceback."""
    step = run / "checkpoints" / "step-10"
    edit_state(run, 10, BROKEN_STATES["no files entry"])
    (step / ".metadata").write_bytes((step / ".metadata").read_bytes()[:40])
    result = cli("export", str(run), "--out", str(tmp_path / "out.safetensors"))
    assert result.returncode == 0, result.stderr
    assert "no checksums" in notes(result)[0] and "step-5" in result.stdout


def test_a_step_folder_with_a_non_ascii_digit_is_not_a_checkpoint(run, cli):
    shutil.copytree(run / "checkpoints" / "step-10", run / "checkpoints" / "step-²")
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-10", "step-5"]
    result = cli("train", "--run-dir", str(run), "--resume")
    assert result.returncode == 0 and "already at step 10" in result.stderr, result.stderr


def test_shard_paths_stay_inside_the_checkpoint(run, cli, tmp_path):
    """Metadata (sealed as if gradmesh wrote it) that points DCP at another checkpoint's shard."""
    step = run / "checkpoints" / "step-10"
    metadata = safeload.read_metadata(step)
    for info in metadata.storage_data.values():
        info.relative_path = "../step-5/" + info.relative_path
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(step)
    result = cli("export", str(run), "--out", str(tmp_path / "out.safetensors"))
    assert_usage_error(result, "../step-5/", "outside the checkpoint's folder")
    assert not (tmp_path / "out.safetensors").exists()


def test_pruning_counts_only_intact_checkpoints(run):
    """keep=2 with step-10 damaged and step-15 just written: step-5 is the second intact one and
    stays; the damaged one is neither counted nor taken for intact (before: step-5 was deleted)."""
    root = run / "checkpoints"
    shutil.copytree(root / "step-10", root / "step-15")
    reseal(root / "step-15", step=15)
    shard = next((root / "step-10").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    checkpoint.Checkpointer(run, group=None, is_main=True, keep=2)._prune()
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-15", "step-10", "step-5"]
    assert checkpoint.verify(root / "step-5") is None
    checkpoint.Checkpointer(run, group=None, is_main=True, keep=1)._prune()
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-15"]


def test_an_edited_step_resumes_from_the_previous_intact_checkpoint(run):
    """The issue's case: step-10's state edited to step 12 resumed silently there (skipping steps
    11-12). Now the run notes the damage, goes on from step-5 and redoes steps 6..11 once."""
    edit_state(run, 10, lambda s: dict(s, step=12))
    result = train(run, 1, "--resume", "--max-steps", "11")
    assert "step-10 is damaged" in result.stderr
    assert [m["step"] for m in metrics(run)] == list(range(1, 12))
    assert checkpoint.latest_good_checkpoint(run).name == "step-11"
