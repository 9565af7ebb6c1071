"""rlfabric: distributed, actor-based reinforcement learning on Ray."""

from pathlib import Path as _Path

# In a source checkout, envs/ and actors/ sit beside this folder and install as rlfabric.envs and
# rlfabric.actors. When this folder is imported straight from a checkout (Ray puts the driver's working
# directory first on every worker's sys.path), point the package's search path at the checkout too, so those
# two names resolve the same way they do in an installed copy.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "actors").is_dir() and (_checkout / "actors" / "env_runner.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 - __path__ is defined for packages

from rlfabric.config import Config, ConfigError, load_config  # noqa: E402
from rlfabric.registry import make_env, register_env  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "Trainer", "load_config", "make_env", "register_env", "train", "__version__"]


def __getattr__(name: str):  # the driver pulls in torch and Ray: import it only when asked for
    if name == "Trainer":
        from rlfabric import driver

        return driver.Trainer
    if name == "train":  # PPO on a Gymnasium env or a game
        from rlfabric import game_driver

        return game_driver.train
    raise AttributeError(f"module 'rlfabric' has no attribute {name!r}")
