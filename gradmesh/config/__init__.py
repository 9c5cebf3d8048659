"""Typed configuration: keyword-only dataclasses, TOML in, resolved TOML out.

Precedence, lowest first: field defaults, `--config FILE` (or the run directory's saved
config.toml when resuming), command-line flags, `--set section.key=value`. Every field is
checked in `__post_init__` (`sections`); merging the layers is `layers`. All of it runs in the
launcher, before any worker starts. Nothing here imports torch or code above the config layer.
"""

from gradmesh.config.layers import SECTIONS, all_keys, build, load_toml, parse_sets, section_fields
from gradmesh.config.fault import NONFINITE
from gradmesh.config.ps import PS_MODES, PSConfig
from gradmesh.config.compression import COMPRESSIONS
from gradmesh.config.sections import (DEVICES, OPTIMIZERS, PP_SCHEDULES, RECOVERY, CheckpointConfig, Config,
                                      DataConfig, FaultConfig, LaunchConfig, ModelConfig, MonitorConfig, RunConfig,
                                      TrainConfig)
from gradmesh.config.workload import MODELS

__all__ = ["Config", "ModelConfig", "DataConfig", "TrainConfig", "CheckpointConfig", "FaultConfig", "MonitorConfig",
           "LaunchConfig", "RunConfig", "PSConfig", "PS_MODES", "SECTIONS", "MODELS", "PP_SCHEDULES", "OPTIMIZERS", "COMPRESSIONS", "DEVICES", "RECOVERY", "NONFINITE",
           "all_keys", "build", "load_toml", "parse_sets", "section_fields"]
