"""Kubernetes (issue 30, item 2): `gradmesh k8s` writes a Kubeflow Trainer TrainJob or a v1
PyTorchJob, validated against the published CRD schemas (tests/schemas/, each with its source,
tag and blob), and `gradmesh train` takes its place in the job from the PET_* variables the
operators inject — run here in two network-namespace hosts with exactly those variables."""

import json
import os
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from gradmesh.cli.scheduler import scheduler_layer
from gradmesh.errors import UsageError
from gradmesh.netns import Hosts
from helpers import TINY, gradmesh, rel_l2, weights
from runs import STEPS, ddp_run
from test_multinode import NO_HOSTS, finish

SCHEMAS = Path(__file__).parent / "schemas"


def _schema(name: str) -> dict:
    found = json.loads((SCHEMAS / f"{name}.json").read_text())
    assert found["source"].startswith("https://github.com/kubeflow/") and found["tag"] and found["blob"]
    return found


def _render(tmp_path, *args: str) -> dict:
    out = tmp_path / "job.yaml"
    done = gradmesh("k8s", "--image", "registry.example/gradmesh:1", "--run-dir", "/shared/run", "--out", str(out),
                    *args, timeout=60)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(out.read_text())


@pytest.mark.parametrize(("kind", "schema"), [("trainjob", "trainjob"), ("pytorchjob", "pytorchjob")])
def test_the_manifests_validate_against_the_operators_schemas(tmp_path, kind, schema):
    expected = _schema(schema)
    job = _render(tmp_path, "--kind", kind, "--nodes", "3", "--nproc-per-node", "2", "--gpus-per-node", "2",
                  "--name", "gpt-fsdp", "--", "--strategy", "fsdp", "--max-steps", "100")
    jsonschema.validate(job, expected["schema"])
    assert job["apiVersion"] == f"{expected['group']}/{expected['version']}" and job["kind"] == expected["kind"]
    text = json.dumps(job)
    assert '"gradmesh", "train", "--strategy", "fsdp", "--max-steps", "100", "--run-dir", "/shared/run"' in text
    broken = json.loads(text)  # the schema can fail: a count given as a word
    if kind == "trainjob":
        broken["spec"]["trainer"]["numNodes"] = "three"
    else:
        broken["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, expected["schema"])


def test_a_trainjob_names_its_nodes_processes_and_runtime(tmp_path):
    trainer = _render(tmp_path, "--nodes", "2", "--", "--model", "recsys")["spec"]
    assert trainer["runtimeRef"] == {"name": "torch-distributed"}
    assert trainer["trainer"]["numNodes"] == 2 and "numProcPerNode" not in trainer["trainer"]  # the runtime's auto


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "2", "--", "--strategy", "nope"], "--strategy: invalid choice: 'nope'"),
    (["--nodes", "2", "--", "--nproc", "4"], "gradmesh k8s sets --nproc itself"),
    (["--nodes", "0"], "--nodes and --nproc-per-node must be >= 1"),
    (["--nodes", "2", "--name", "Big_Name"], "--name 'Big_Name'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = gradmesh("k8s", "--image", "i", "--run-dir", "/r", *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_pet_variables_become_the_launch_settings(monkeypatch):
    for name, value in {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",
                        "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    assert scheduler_layer() == {"launch": {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "job-node-0-0.job:29400"}}
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    assert scheduler_layer()["launch"]["nproc"] == 4
    monkeypatch.setenv("PET_NNODES", "1:4")
    with pytest.raises(UsageError, match="fixed number of nodes"):
        scheduler_layer()


@pytest.mark.slow
@pytest.mark.skipif(bool(NO_HOSTS), reason=f"no namespace hosts here ({NO_HOSTS})")
def test_the_rendered_command_trains_across_two_hosts_from_the_operators_variables(catalogue, tmp_path):
    """The TrainJob's command, run as the torch runtime runs it: the same on both hosts, the place
    in the job only in PET_* variables (no launch flags): the single-process model."""
    one = ddp_run(catalogue, 1, "sgd")
    job = _render(tmp_path, "--nodes", "2", "--nproc-per-node", "1", "--", *TINY, *STEPS, "--optimizer", "sgd",
                  "--quiet")
    command = job["spec"]["trainer"]["command"]
    run_dir = tmp_path / "two"
    command = [sys.executable, "-m", "gradmesh", *command[1:]]
    command[command.index("/shared/run")] = str(run_dir)
    with Hosts(2) as hosts:
        base = dict(os.environ, PYTHONUNBUFFERED="1", PET_NNODES="2", PET_NPROC_PER_NODE="1",
                    PET_MASTER_ADDR=hosts.addresses[0], PET_MASTER_PORT="29400")
        nodes = [hosts.start(node, command, env=dict(base, PET_NODE_RANK=str(node))) for node in range(2)]
        errors = finish(nodes, timeout=180)
    assert [proc.returncode for proc in nodes] == [0, 0], errors
    assert rel_l2(weights(run_dir), weights(one)) <= 1e-5
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2


def test_resume_if_any_starts_afresh_then_resumes(tmp_path):
    """The pods' command carries --resume-if-any: the first start finds no checkpoint and starts
    afresh; a restarted pod goes on from the latest one (here: 4 steps, then 2 more)."""
    common = ("train", "--nproc", "1", "--model", "mlp-digits", "--checkpoint-every", "2",
              "--run-dir", str(tmp_path / "r"), "--resume-if-any", "--quiet")
    for steps, this_run in (("4", 4), ("6", 2)):
        done = gradmesh(*common, "--max-steps", steps, timeout=120)
        assert done.returncode == 0, done.stderr
        found = json.loads((tmp_path / "r" / "summary.json").read_text())
        assert (found["steps"], found["steps_this_run"]) == (int(steps), this_run)
