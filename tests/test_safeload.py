"""Deserialisation (issue 13, item 5): a checkpoint whose metadata names anything but DCP's own
classes is refused by `gradmesh export` and `--resume` with one line and exit 2, and what it
names never runs; a real checkpoint still loads. In-process: the crafted checkpoints need no
training, the real one is the session's catalogued half run."""

import io
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from gradmesh.fault import integrity, safeload
from runs import half_run
from test_cli_errors import assert_usage_error


class Payload:
    """Unpickles as `function(argument)`: what a malicious pickle does."""

    def __init__(self, function, argument):
        self.function, self.argument = function, argument

    def __reduce__(self):
        return self.function, (self.argument,)


def payloads(proof):
    """(payload, the name its pickle gives) for os.system and builtins.eval; each creates `proof`."""
    return [(Payload(os.system, f"touch {proof}"), f"{os.system.__module__}.system"),
            (Payload(eval, f"open({str(proof)!r}, 'w')"), "builtins.eval")]


@pytest.fixture(params=[0, 1], ids=["os.system", "builtins.eval"])
def crafted(request, tmp_path):
    """(run dir with one checkpoint whose metadata carries a payload, the name, the payload's proof file)."""
    proof = tmp_path / "payload-ran"
    payload, name = payloads(proof)[request.param]
    step = tmp_path / "run" / "checkpoints" / "step-3"
    step.mkdir(parents=True)
    (tmp_path / "run" / ".gradmesh-run").write_text("{}")
    metadata = Metadata(state_dict_metadata={"model.wte.weight": payload})
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    sealed = integrity.seal({"step": 3, "sampler": {}}, step)  # intact: what it names is only met on reading it
    (step / "trainer_state.json").write_text(json.dumps(sealed))
    return tmp_path / "run", name, proof


def test_export_refuses_metadata_that_names_code(crafted, cli, tmp_path):
    run, name, proof = crafted
    result = cli("export", str(run), "--out", str(tmp_path / "out.safetensors"))
    assert_usage_error(result, f"names {name}", "does not load")
    assert not proof.exists() and not (tmp_path / "out.safetensors").exists()


def test_resume_refuses_metadata_that_names_code(crafted, cli):
    run, name, proof = crafted
    assert_usage_error(cli("train", "--run-dir", str(run), "--resume"), f"names {name}", "does not load")
    assert not proof.exists()


def test_non_tensor_entries_must_load_as_plain_data(tmp_path):
    """DCP's own planner loads them with torch.load(weights_only=False)."""
    planner = safeload.SafePlanner()
    state = {"extra": None}
    planner.set_up_planner(state, Metadata(state_dict_metadata={"extra": BytesStorageMetadata()}), True)
    index = MetadataIndex("extra")
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
    for payload, name in payloads(tmp_path / "payload-ran"):
        saved = io.BytesIO()
        torch.save(payload, saved)
        with pytest.raises(safeload.UnsafeCheckpoint, match="extra is not plain data"):
            planner.load_bytes(item, io.BytesIO(saved.getvalue()))
        assert not (tmp_path / "payload-ran").exists()
    saved = io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.95)}, saved)
    planner.load_bytes(item, io.BytesIO(saved.getvalue()))
    assert state["extra"] == {"lr": 0.1, "betas": (0.9, 0.95)}


def test_a_real_checkpoints_metadata_reads_as_torch_reads_it(catalogue):
    step = half_run(catalogue, 1) / "checkpoints" / "step-10"
    ours, torchs = safeload.read_metadata(step), dcp.FileSystemReader(str(step)).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data
