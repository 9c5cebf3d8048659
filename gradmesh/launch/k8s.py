"""Kubernetes manifests for a gradmesh job: Kubeflow Trainer v2's `TrainJob` (the torch runtime)
and, for clusters on the older training operator, a v1 `PyTorchJob`.

Both run `gradmesh train` in every pod with the same options. The operator hands each pod its
place in the job as torchrun's PET_* variables (nodes, processes per node, node rank, the master
pod's address and port), which `gradmesh train` reads itself (`gradmesh.cli.scheduler`): the
command is the same on every node, as the runtime expects. The run directory must be on a volume
every pod shares. `--resume-if-any` is in the command: a pod the operator restarts (restart
policy OnFailure) goes on from the run directory's latest checkpoint; the first start, with none
there, starts afresh.
"""

from dataclasses import dataclass

TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str
    image: str
    nodes: int
    procs_per_node: int | None
    """None: one per GPU, or one on a CPU node (the runtime's `auto`)."""
    gpus_per_node: int
    command: list[str]
    runtime: str = "torch-distributed"


def _resources(spec: JobSpec) -> dict:
    return {"limits": {"nvidia.com/gpu": spec.gpus_per_node}} if spec.gpus_per_node else {}


def trainjob(spec: JobSpec) -> dict:
    trainer: dict = {"image": spec.image, "command": spec.command, "numNodes": spec.nodes}
    if spec.procs_per_node:
        trainer["numProcPerNode"] = spec.procs_per_node
    if spec.gpus_per_node:
        trainer["resourcesPerNode"] = _resources(spec)
    return {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": {"name": spec.name},
        "spec": {"runtimeRef": {"name": spec.runtime}, "trainer": trainer},
    }


def pytorchjob(spec: JobSpec) -> dict:
    container: dict = {"name": "pytorch", "image": spec.image, "command": spec.command}
    if spec.gpus_per_node:
        container["resources"] = _resources(spec)
    replica = {"restartPolicy": "OnFailure", "template": {"spec": {"containers": [container]}}}
    replicas = {"Master": {"replicas": 1, **replica}}
    if spec.nodes > 1:
        replicas["Worker"] = {"replicas": spec.nodes - 1, **replica}
    job: dict = {"pytorchReplicaSpecs": replicas}
    job["nprocPerNode"] = str(spec.procs_per_node) if spec.procs_per_node else "auto"
    return {"apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob", "metadata": {"name": spec.name}, "spec": job}
