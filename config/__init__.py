"""The configuration tree (schema.py) and its one-time loading and validation (loader.py)."""

from .loader import ConfigError, as_toml, iter_keys, load_config
from .schema import (Config, EngineConfig, IpcConfig, LoggingConfig, ParallelConfig, PdConfig,
                     ServerConfig, SpeculativeConfig)

__all__ = ["Config", "ConfigError", "EngineConfig", "IpcConfig", "LoggingConfig", "ParallelConfig",
           "PdConfig", "ServerConfig", "SpeculativeConfig", "as_toml", "iter_keys", "load_config"]
