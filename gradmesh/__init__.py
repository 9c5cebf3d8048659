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

from gradmesh.config import CheckpointConfig, Config, TrainConfig
from gradmesh.data import GlobalOrderSampler
from gradmesh.errors import UsageError
from gradmesh.topology import Topology
from gradmesh.trainer import Session, Trainer, init

__version__ = "0.1.0"
__all__ = ["init", "Session", "Trainer", "TrainConfig", "CheckpointConfig", "Config",
           "GlobalOrderSampler", "Topology", "UsageError"]
