"""Config: schema (pydantic), loader (YAML + overrides + line numbers), checks, derived values."""

from bmtrain_cli.config.derived import Derived, derive
from bmtrain_cli.config.load import LoadedConfig, load_config
from bmtrain_cli.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig

__all__ = [
    "Config",
    "Derived",
    "LoadedConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "derive",
    "load_config",
]
