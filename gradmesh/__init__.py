"""gradmesh: distributed training for PyTorch.

The Python API, for scripts launched with `gradmesh run` (or torchrun, or plain python):

    import gradmesh
    session = gradmesh.init()
    trainer = gradmesh.Trainer(session, model, per_sample_loss, dataset,
                               train=gradmesh.TrainConfig(global_batch_size=64, max_steps=100),
                               run_dir="runs/mine")
    summary = trainer.fit()
    session.close()
"""

import importlib

from gradmesh import torchvision_compat

# Before anything imports torchvision (gradmesh's resnet, transformers' model code): its PyPI
# wheels fail to import beside the CPU torch unless two operators are declared first.
torchvision_compat.install()

__version__ = "0.1.0"
__all__ = [
    "CheckpointConfig",
    "Config",
    "GlobalOrderSampler",
    "Loop",
    "MonitorConfig",
    "PSConfig",
    "Session",
    "Topology",
    "TrainConfig",
    "Trainer",
    "UsageError",
    "init",
]

# Imported on first use (PEP 562): `python -m gradmesh --help` and a usage error need none of
# torch, and importing it costs the CLI about a second at every start.
_HOMES = {
    "init": "loop.trainer",
    "Loop": "loop.own",
    "Session": "loop.trainer",
    "Trainer": "loop.trainer",
    "TrainConfig": "config",
    "CheckpointConfig": "config",
    "MonitorConfig": "config",
    "PSConfig": "config",
    "Config": "config",
    "GlobalOrderSampler": "data",
    "Topology": "topology",
    "UsageError": "errors",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"gradmesh.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'gradmesh' has no attribute {name!r}")
