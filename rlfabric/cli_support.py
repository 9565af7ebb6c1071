"""What the ``rlfabric`` subcommands share: user modules imported first, a run's default directory, the algorithm
of a saved run."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlfabric.config import ConfigError
from rlfabric.config_base import raised_by_user_code
from rlfabric.run.log import CONFIG_FILE

IMPORT_HELP = "module to import first, from the current directory or the Python path; repeat for more"


def import_user_modules(names: list[str] | None) -> None:
    """Import modules that call register_env or register_reward, so their names show up.

    A module is looked up in the current directory first, as ``python -m`` does, and so is the module of a
    ``module:function`` spec in the config. What such a module registers reaches the Ray workers by value
    (``rlfabric.shipping``), so they need not import it themselves.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        if names:  # first, as python -m does
            sys.path.insert(0, cwd)
        else:  # last: for a module:function spec, shadowing no installed package
            sys.path.append(cwd)
    for name in names or []:
        if name.endswith(".py"):  # "x.py" would import x, then look for a submodule "py"
            raise ConfigError(
                f"--import {name!r}: takes a module name, not a file name (a module name: --import {name[:-3]})"
            )
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if exc.name == name or name.startswith(f"{exc.name}."):  # the module itself, not an import inside it
                raise ConfigError(
                    f"--import {name!r}: no such module in the current directory ({cwd}) or on the Python path"
                ) from None
            raise ConfigError(f"--import {name!r}: {exc.__class__.__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the module's own code raised while it was imported
            raise ConfigError(f"--import {name!r}: importing it raised {raised_by_user_code(exc)}") from None


def run_name(cfg: Any) -> str:
    """What a run is called in its default directory: ``grpo-<task>`` for GRPO, the env's id for PPO."""
    if cfg.algo == "grpo":
        task = cfg.data.train.replace("task:", "").split("?")[0].replace("/", "_")
        return f"grpo-{Path(task).stem}"
    return cfg.env.id.replace("gym:", "").replace(":", "_").replace("/", "_")


def default_run_dir(cfg: Any) -> Path:
    """``runs/<run name>-<time>``."""
    return Path("runs") / f"{run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"


def saved_algo(run_dir: Path) -> str:
    """The ``algo`` of the config saved in a run directory ("ppo" when it cannot tell: that path reports a
    missing or unreadable directory itself)."""
    import yaml

    try:
        data = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return "ppo"
    return str(data.get("algo", "ppo")) if isinstance(data, dict) else "ppo"
