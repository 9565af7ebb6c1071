"""rlfabric: distributed, actor-based reinforcement learning on Ray."""

from rlfabric.config import Config, ConfigError, load_config
from rlfabric.registry import make_env, register_env

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "load_config", "make_env", "register_env", "__version__"]
