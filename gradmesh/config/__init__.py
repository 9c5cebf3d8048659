"""Typed configuration: keyword-only dataclasses, TOML in, resolved TOML out.

Precedence, lowest first: field defaults, `--config FILE` (or the run directory's saved
config.toml when resuming), command-line flags, `--set section.key=value`. Every field is
checked in `__post_init__` (`sections`); merging the layers is `layers`. All of it runs in the
launcher, before any worker starts. Nothing here imports torch or code above the config layer.
"""

from gradmesh.config.compression import COMPRESSIONS
from gradmesh.config.fault import NONFINITE
from gradmesh.config.layers import SECTIONS, all_keys, build, load_toml, parse_sets, section_fields
from gradmesh.config.ps import PS_MODES, PSConfig
from gradmesh.config.rl import RLConfig
from gradmesh.config.sections import (
    DEVICES,
    OPTIMIZERS,
    PP_SCHEDULES,
    RECOVERY,
    TABLE_SHARDINGS,
    CheckpointConfig,
    Config,
    DataConfig,
    FaultConfig,
    LaunchConfig,
    ModelConfig,
    MonitorConfig,
    RunConfig,
    TrainConfig,
)
from gradmesh.config.workload import HF_MODELS, MODELS, RL_MODELS, TEXT_MODELS

__all__ = [
    "COMPRESSIONS",
    "DEVICES",
    "HF_MODELS",
    "MODELS",
    "NONFINITE",
    "OPTIMIZERS",
    "PP_SCHEDULES",
    "PS_MODES",
    "RECOVERY",
    "RL_MODELS",
    "SECTIONS",
    "TABLE_SHARDINGS",
    "TEXT_MODELS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "FaultConfig",
    "LaunchConfig",
    "ModelConfig",
    "MonitorConfig",
    "PSConfig",
    "RLConfig",
    "RunConfig",
    "TrainConfig",
    "all_keys",
    "build",
    "load_toml",
    "parse_sets",
    "section_fields",
]
