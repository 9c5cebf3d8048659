"""An sbatch script for a gradmesh job on Slurm: one `srun` task per node, each running the
`gradmesh train` launcher with the job's workers on its node.

The pitfalls it is written around: SLURM_PROCID and SLURM_NODEID exist only inside `srun`
(so the node rank is read in the task, not in the batch script); the rendezvous endpoint is the
first host of `scontrol show hostnames $SLURM_JOB_NODELIST` (static rendezvous: node 0 hosts the
store); a requeued job (`--requeue`, or the signal a little before the time limit, on which the
script requeues itself) must continue, not start again, so every task runs `gradmesh train
--resume-if-any`: the run directory's latest complete checkpoint is looked for when the job
starts (a resume path decided at submission would be stale on a requeue).
"""

import shlex
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SbatchSpec:
    name: str
    nodes: int
    tasks_per_node: int
    """1 on a real cluster; more emulates nodes as tasks on one machine (tests, a workstation)."""
    gpus_per_node: int
    partition: str
    time: str
    run_dir: str
    port: int
    train: list[str]
    signal_s: int = 120
    """Seconds before the time limit that Slurm signals the script, which then requeues the job."""


def _directives(spec: SbatchSpec) -> list[str]:
    lines = [
        f"--job-name={spec.name}",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.tasks_per_node}",
        "--requeue",
        f"--signal=B:USR1@{spec.signal_s}",
        "--output=slurm-%x-%j.out",  # beside the script: the run directory holds only what gradmesh writes
        "--open-mode=append",
    ]
    lines += [f"--partition={spec.partition}"] if spec.partition else []
    lines += [f"--time={spec.time}"] if spec.time else []
    lines += [f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []
    return [f"#SBATCH {line}" for line in lines]


def sbatch_script(spec: SbatchSpec) -> str:
    train = shlex.join(["gradmesh", "train", *spec.train, "--run-dir", spec.run_dir, "--resume-if-any"])
    body = f"""
set -euo pipefail
HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
# Shortly before the time limit Slurm sends USR1 (--signal): requeue, to resume from a checkpoint.
trap 'scontrol requeue "$SLURM_JOB_ID"' USR1
srun --kill-on-bad-exit=1 --output=slurm-%x-%j-task%t.out bash -c \\
    'exec {train} --nnodes "$SLURM_NTASKS" --node-rank "$SLURM_PROCID" \\
     --rdzv-endpoint "$0:{spec.port}" --rdzv-id "slurm-$SLURM_JOB_ID"' "$HOST" &
wait
"""
    return "\n".join(["#!/bin/bash", *_directives(spec), body.lstrip("\n")])
