"""Slurm (issue 30, item 1): `gradmesh slurm` writes and submits an sbatch script; tested against
a real Slurm (munged, slurmctld and slurmd started by the test in a temporary folder, one node,
nodes emulated as srun tasks): a 2-task job trains the single-process model, and a job requeued
while it runs resumes from its latest checkpoint and ends with the uninterrupted model."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from helpers import TINY, gradmesh, metrics, rel_l2, weights
from runs import STEPS, ddp_run

BIN = str(Path(sys.executable).parent)


@pytest.fixture(scope="module")
def slurm():
    failed = slurm_cluster.wait_installed()
    if failed:
        pytest.fail("the Slurm tests need Debian's slurm-wlm and munge; installing them failed:\n" + failed)
    with slurm_cluster.SlurmCluster() as cluster:
        cluster.env["PATH"] = f"{BIN}:{cluster.env['PATH']}"  # srun's tasks find this gradmesh
        yield cluster


def _submit(slurm, tmp_path: Path, run_dir: Path, *train: str) -> str:
    port = str(slurm_cluster._free_port())
    done = subprocess.run([sys.executable, "-m", "gradmesh", "slurm", "--nodes", "1", "--tasks-per-node", "2",
                           "--run-dir", str(run_dir), "--port", port, "--submit", "--", "--nproc", "1", *train],
                          capture_output=True, text=True, env=slurm.env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("slurm-*.out")))


@pytest.mark.slow
def test_a_two_task_job_trains_the_single_process_model(slurm, catalogue, tmp_path):
    one = ddp_run(catalogue, 1, "sgd")
    job = _submit(slurm, tmp_path, tmp_path / "run", *TINY, *STEPS, "--optimizer", "sgd", "--quiet")
    assert slurm.wait_done(job, timeout=240) == "COMPLETED", _logs(tmp_path)
    assert rel_l2(weights(tmp_path / "run"), weights(one)) <= 1e-5
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2
    assert (tmp_path / "gradmesh.sbatch").is_file() and not (tmp_path / "run" / "gradmesh.sbatch").exists()


@pytest.mark.slow
def test_a_requeued_job_resumes_from_its_checkpoint_and_ends_with_the_uninterrupted_model(slurm, catalogue, tmp_path):
    args = ("--max-steps", "60", "--global-batch-size", "16", "--optimizer", "sgd")
    one = catalogue.run(1, *args)
    run_dir = tmp_path / "run"
    job = _submit(slurm, tmp_path, run_dir, *TINY, *args, "--checkpoint-every", "10", "--quiet")
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slurm.run("scontrol", "requeue", job).returncode == 0
    # Slurm holds a requeued batch job back a while (its begin time): let it start again at once
    while slurm.job_field(job, "JobState") != "PENDING" and time.monotonic() < deadline:
        time.sleep(0.2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    assert slurm.wait_done(job, timeout=300) == "COMPLETED", _logs(tmp_path)
    assert slurm.job_field(job, "Restarts") == "1"
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 61))  # every step once, resumed not restarted
    assert rel_l2(weights(run_dir), weights(one)) <= 1e-5
    assert os.path.getsize(tmp_path / f"slurm-gradmesh-{job}.out") > 0


def test_the_script_reads_its_place_inside_srun_and_resumes_only_with_a_checkpoint(tmp_path):
    done = gradmesh("slurm", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--time", "1:00:00",
                    "--run-dir", "/shared/run", "--out", str(tmp_path / "job.sbatch"), "--", "--strategy", "fsdp",
                    timeout=60)
    assert done.returncode == 0, done.stderr
    script = (tmp_path / "job.sbatch").read_text()
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu", "--time=1:00:00",
                      "--requeue", "--signal=B:USR1@120"):
        assert f"#SBATCH {directive}\n" in script
    srun = script[script.index("srun "):]
    assert '"$SLURM_PROCID"' in srun
    assert "'exec gradmesh train --nproc 8 --strategy fsdp --run-dir /shared/run --resume-if-any" in srun
    assert "SLURM_PROCID" not in script[:script.index("srun ")]  # it exists only inside srun
    assert "--resume " not in script  # the start decides, not the submission (--resume-if-any)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "0"], "--nodes and --tasks-per-node must be >= 1"),
    (["--nodes", "2", "--", "--node-rank", "1"], "gradmesh slurm sets --node-rank itself"),
    (["--nodes", "2", "--", "--max-steps", "x"], "--max-steps"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = gradmesh("slurm", "--run-dir", "/r", "--out", str(tmp_path / "j.sbatch"), *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "j.sbatch").exists()
