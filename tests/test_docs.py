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
