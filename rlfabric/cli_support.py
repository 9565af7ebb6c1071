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
# Beside a run's config.yaml: the modules it was started with (--import), one name a line, which --resume and
# eval --run-dir import again.
IMPORTS_FILE = "imports.txt"
# Set by rlfabric submit in its job's environment: the command that resumes the job's run (a new job), which a run
# stopped inside the job names instead of `rlfabric train --resume`.
RESUME_COMMAND_ENV = "RLFABRIC_RESUME_COMMAND"


def import_user_modules(names: list[str] | None, run_dir: Path | None = None, field: str = "") -> list[str]:
    """Import modules that call register_env or register_reward, so their names show up: ``names`` (``--import``),
    then those recorded in ``run_dir`` (``IMPORTS_FILE``) that ``names`` leave out, a failure there named by
    ``field``, the option that named the run (default ``--resume RUN_DIR``). Returns every module imported, in that
    order: what a resumed run records again.

    A module is looked up in the current directory first, as ``python -m`` does, and so is the module of a
    ``module:function`` spec in the config. What such a module registers reaches the Ray workers by value
    (``rlfabric.shipping``), so they need not import it themselves.
    """
    given = list(names or [])
    recorded = [name for name in recorded_imports(run_dir) if name not in given] if run_dir is not None else []
    cwd = os.getcwd()
    if cwd not in sys.path:
        if given or recorded:  # first, as python -m does
            sys.path.insert(0, cwd)
        else:  # last: for a module:function spec, shadowing no installed package
            sys.path.append(cwd)
    for name in given:
        _import_module(name, f"--import {name!r}", cwd)
    for name in recorded:
        assert run_dir is not None
        recorded_in = run_dir / IMPORTS_FILE
        where = field or f"--resume {str(run_dir)!r}"
        _import_module(name, f"{where}: the run was started with --import {name} ({recorded_in})", cwd)
    return [*given, *recorded]


def _import_module(name: str, field: str, cwd: str) -> None:
    """``import name``; what goes wrong is a ConfigError of one line that starts with ``field``."""
    if name.endswith(".py"):  # "x.py" would import x, then look for a submodule "py"
        raise ConfigError(f"{field}: takes a module name, not a file name (a module name: --import {name[:-3]})")
    try:
        importlib.import_module(name)  # a module imported already (given again with --import) is not run again
    except ImportError as exc:
        if exc.name == name or name.startswith(f"{exc.name}."):  # the module itself, not an import inside it
            raise ConfigError(
                f"{field}: no such module in the current directory ({cwd}) or on the Python path"
            ) from None
        raise ConfigError(f"{field}: {exc.__class__.__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the module's own code raised while it was imported
        raise ConfigError(f"{field}: importing it raised {raised_by_user_code(exc)}") from None


def recorded_imports(run_dir: Path) -> list[str]:
    """The modules recorded in ``run_dir`` (``IMPORTS_FILE``: one a line; blank lines and ``#`` comments are
    skipped); none when the file is not there."""
    try:
        text = (run_dir / IMPORTS_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return []
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def record_imports(run_dir: Path, names: list[str]) -> None:
    """Record ``names`` in ``run_dir`` (``IMPORTS_FILE``), for --resume and eval; with none, a file left there by an
    earlier attempt in the same folder is removed."""
    path = run_dir / IMPORTS_FILE
    if names:
        path.write_text("".join(f"{name}\n" for name in names))
    else:
        path.unlink(missing_ok=True)


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
