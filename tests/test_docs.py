"""Docs that must match the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from rlfabric.config import Config

ROOT = Path(__file__).resolve().parent.parent


def _leaf_fields(cls: type, prefix: str = "") -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            names += _leaf_fields(type(sub), f"{prefix}{f.name}.")
        else:
            names.append(prefix + f.name)
    return names


def test_config_reference_lists_every_key_and_nothing_else():
    doc = (ROOT / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", doc, flags=re.MULTILINE))
    assert documented == set(_leaf_fields(Config))


def test_readme_quickstart_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("pip install"))
    assert test_command.split("#")[0].strip() in ci


def test_every_example_config_is_valid():
    from rlfabric.config import load_config
    from rlfabric.registry import resolve

    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert {p.name for p in examples} >= {"cartpole_ppo.yaml", "halfcheetah_ppo.yaml"}
    for path in examples:
        cfg = load_config(path)
        resolve(cfg.env.id)


def test_cartpole_example_spells_out_the_embedded_default():
    """`rlfabric train` with no config and examples/cartpole_ppo.yaml train the same thing."""
    from rlfabric.config import Config, load_config

    assert load_config(ROOT / "examples" / "cartpole_ppo.yaml") == Config()


def test_readme_python_api_names_exist():
    import rlfabric
    from rlfabric import driver

    assert rlfabric.train is driver.train and rlfabric.Trainer is driver.Trainer
    assert callable(rlfabric.load_config) and callable(rlfabric.register_env)
