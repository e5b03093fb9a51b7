"""JobConfig: every setting of a run, one dataclass per section.

A run's config is built from a packaged TOML preset (or a TOML file), then dotted
overrides from the command line (``--optim.lr 3e-4``). Everything is checked before any
process group starts: an unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` naming the field, the value and what is allowed.

The sections and their fields are in :mod:`llmtrain.config.sections`; reading presets,
TOML and overrides into checked values in :mod:`llmtrain.config.parsing`; the whole
config, the settings reliability reads and the checks that span fields in
:mod:`llmtrain.config.job`; the generated reference in :mod:`llmtrain.config.reference`.
"""

from llmtrain.config.job import JobConfig, Settings, load_config, mesh_shape
from llmtrain.config.parsing import parse_overrides, preset_names, step_ranges
from llmtrain.config.reference import reference_markdown
from llmtrain.config.sections import (SECTIONS, CheckpointConfig, ConfigError, ControlConfig,
                                      DataConfig, HealthConfig, IntegrityConfig, MetricsConfig,
                                      ModelConfig, OptimConfig, ParallelismConfig,
                                      ReliabilityConfig, TrainingConfig, WarmConfig)

__all__ = ["SECTIONS", "CheckpointConfig", "ConfigError", "ControlConfig", "DataConfig",
           "HealthConfig", "IntegrityConfig", "JobConfig", "MetricsConfig", "ModelConfig",
           "OptimConfig", "ParallelismConfig", "ReliabilityConfig", "Settings",
           "TrainingConfig", "WarmConfig", "load_config", "mesh_shape", "parse_overrides",
           "preset_names", "reference_markdown", "step_ranges"]
