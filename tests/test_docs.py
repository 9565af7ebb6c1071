"""Docs that must match the code.

docs/config.md has two parts, "## algo: grpo ..." (``LLMConfig``) and "## algo: ppo" (``Config``); each lists
every leaf key of its dataclass with its default. examples/arithmetic_grpo.yaml spells out every ``LLMConfig`` key
at its default. After changing a default, rewrite both (defaults only; comments and meanings stay) with:

    python tests/test_docs.py --sync
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from rlfabric.config import Config, ConfigError, _coerce
from rlfabric.grpo_config import LLMConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "config.md"
GRPO_EXAMPLE = ROOT / "examples" / "arithmetic_grpo.yaml"
GRPO_HEADING = "## algo: grpo"
PPO_HEADING = "## algo: ppo"
KEY_ROW = re.compile(r"^\| `([a-z_.]+)` \|", flags=re.MULTILINE)
DEFAULT_ROW = re.compile(r"^(\| `([a-z_.]+)` \| )`([^`]*)`( \|)", flags=re.MULTILINE)


# -- helpers (also used by --sync) ------------------------------------------------------------------------------


def _leaf_fields(cls: type, prefix: str = "") -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            names += _leaf_fields(type(sub), f"{prefix}{f.name}.")
        else:
            names.append(prefix + f.name)
    return names


def _default(cls: type, key: str) -> tuple[Any, Any]:
    """(default value, type annotation) of a dotted leaf key of the dataclass ``cls``."""
    node: Any = cls()
    *sections, leaf = key.split(".")
    for name in sections:
        node = getattr(node, name)
    return getattr(node, leaf), typing.get_type_hints(type(node))[leaf]


def _doc_parts() -> dict[type, str]:
    """The text of each part of docs/config.md, by the dataclass it documents."""
    doc = CONFIG_DOC.read_text()
    grpo_at, ppo_at = doc.index("\n" + GRPO_HEADING), doc.index("\n" + PPO_HEADING)
    assert grpo_at < ppo_at, "docs/config.md: the algo: grpo part comes first, then algo: ppo"
    return {LLMConfig: doc[grpo_at:ppo_at], Config: doc[ppo_at:]}


def yaml_text(value: Any) -> str:
    """``value`` as one line of YAML flow text that reads back as the same value (floats always with a dot)."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-2:  # YAML 1.1 floats need a dot and a signed exponent: 5.0e-4
            mantissa, exponent = f"{value:.12e}".split("e")
            mantissa = mantissa.rstrip("0")
            return f"{mantissa}0e{int(exponent)}" if mantissa.endswith(".") else f"{mantissa}e{int(exponent)}"
        return repr(value)
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z0-9_./+-][A-Za-z0-9_./:?=&+-]*", value) is not None
        return value if plain and yaml.safe_load(value) == value else '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_text(str(k))}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    raise TypeError(f"no YAML text for {value!r}")


def _wrong_doc_defaults(cls: type, part: str) -> list[str]:
    problems = []
    for _, key, text, _ in DEFAULT_ROW.findall(part):
        default, annotation = _default(cls, key)
        try:
            documented = _coerce(yaml.safe_load(text), annotation, key)
        except (ConfigError, yaml.YAMLError) as exc:
            problems.append(f"{key}: documented default `{text}` does not read as the field's type ({exc})")
            continue
        if documented != default:
            problems.append(f"{key}: documented `{text}`, the dataclass says `{yaml_text(default)}`")
    return problems


def _yaml_leaf_keys(data: dict[str, Any], cls: type, prefix: str = "") -> set[str]:
    keys = set()
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if dataclasses.is_dataclass(hints.get(name)) and isinstance(value, dict):
            keys |= _yaml_leaf_keys(value, hints[name], f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


# -- the tests --------------------------------------------------------------------------------------------------


def test_config_reference_lists_every_key_and_nothing_else():
    for cls, part in _doc_parts().items():
        documented = set(KEY_ROW.findall(part))
        expected = set(_leaf_fields(cls))
        assert documented == expected, (
            f"{cls.__name__}: undocumented {sorted(expected - documented)}, not fields {sorted(documented - expected)}"
        )
        with_default = [key for _, key, _, _ in DEFAULT_ROW.findall(part)]
        assert sorted(with_default) == sorted(KEY_ROW.findall(part)), f"{cls.__name__}: a row's default is not `...`"


def test_config_reference_defaults_are_the_dataclass_defaults():
    """Every default in docs/config.md equals the dataclass's; fix with `python tests/test_docs.py --sync`."""
    problems = [p for cls, part in _doc_parts().items() for p in _wrong_doc_defaults(cls, part)]
    assert not problems, "\n".join(problems)


def test_yaml_text_reads_back_as_the_same_value():
    for cls in (LLMConfig, Config):
        for key in _leaf_fields(cls):
            default, annotation = _default(cls, key)
            assert _coerce(yaml.safe_load(yaml_text(default)), annotation, key) == default, key


def test_readme_quickstart_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("pip install"))
    assert test_command.split("#")[0].strip() in ci


def test_every_example_config_is_valid():
    from rlfabric.config import load_config
    from rlfabric.data import TASK_PREFIX, load_prompts
    from rlfabric.registry import resolve
    from rlfabric.rewards import resolve_reward

    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert {p.name for p in examples} >= {"cartpole_ppo.yaml", "halfcheetah_ppo.yaml", "arithmetic_grpo.yaml"}
    for path in examples:
        cfg = load_config(path)
        if isinstance(cfg, Config):
            resolve(cfg.env.id)
            continue
        assert isinstance(cfg, LLMConfig), path
        for i, spec in enumerate(cfg.rewards.functions):
            resolve_reward(dataclasses.asdict(spec), f"{path.name}: rewards.functions[{i}]")
        for spec in (cfg.data.train, cfg.data.eval):
            if spec.startswith(TASK_PREFIX):  # generated tasks: the name and options are checked by a few rows
                load_prompts(spec, num_rows=4, prompt_key=cfg.data.prompt_key)


def test_cartpole_example_is_the_ppo_defaults():
    """`rlfabric train examples/cartpole_ppo.yaml` trains PPO with every default."""
    from rlfabric.config import load_config

    assert load_config(ROOT / "examples" / "cartpole_ppo.yaml") == Config()


def test_arithmetic_example_spells_out_the_embedded_default():
    """`rlfabric train` with no config and examples/arithmetic_grpo.yaml train the same thing, and the example
    names every key."""
    from rlfabric.config import load_config

    assert load_config(GRPO_EXAMPLE) == load_config(None) == LLMConfig()
    data = yaml.safe_load(GRPO_EXAMPLE.read_text())
    assert _yaml_leaf_keys(data, LLMConfig) == set(_leaf_fields(LLMConfig))


def test_readme_python_api_names_exist():
    import rlfabric
    from rlfabric import driver

    assert rlfabric.train is driver.train and rlfabric.Trainer is driver.Trainer
    assert callable(rlfabric.load_config) and callable(rlfabric.register_env)


def test_llm_guide_python_api_names_exist():
    from rlfabric import llm_driver, rewards

    assert callable(llm_driver.train_llm) and callable(llm_driver.GRPOTrainer)
    assert callable(rewards.register_reward) and rewards.RewardInput and rewards.RewardResult


# -- python tests/test_docs.py --sync ---------------------------------------------------------------------------


def sync_config_doc() -> list[str]:
    """Rewrite the defaults column of docs/config.md from the dataclasses; return the keys it could not place."""
    doc = CONFIG_DOC.read_text()
    grpo_at, ppo_at = doc.index("\n" + GRPO_HEADING), doc.index("\n" + PPO_HEADING)
    pieces = [(None, doc[:grpo_at]), (LLMConfig, doc[grpo_at:ppo_at]), (Config, doc[ppo_at:])]
    out, missing = [], []
    for cls, text in pieces:
        if cls is not None:
            fields = set(_leaf_fields(cls))

            def replace(m: re.Match, cls: type = cls, fields: set[str] = fields) -> str:
                if m.group(2) not in fields:
                    return m.group(0)
                return f"{m.group(1)}`{yaml_text(_default(cls, m.group(2))[0])}`{m.group(4)}"

            text = DEFAULT_ROW.sub(replace, text)
            documented = set(KEY_ROW.findall(text))
            missing += [f"{cls.__name__}: {k} (add a row)" for k in sorted(fields - documented)]
            missing += [f"{cls.__name__}: {k} (no such field; remove its row)" for k in sorted(documented - fields)]
        out.append(text)
    CONFIG_DOC.write_text("".join(out))
    return missing


_YAML_LINE = re.compile(r"^(?P<indent> *)(?P<key>[a-z_]+):(?P<value>[^#]*?)(?P<gap>\s*)(?P<comment>#.*)?$")


def sync_grpo_example() -> list[str]:
    """Rewrite each value of examples/arithmetic_grpo.yaml to the LLMConfig default, keeping the comments."""
    lines, path, out = GRPO_EXAMPLE.read_text().splitlines(), [], []
    fields = set(_leaf_fields(LLMConfig))
    for line in lines:
        m = _YAML_LINE.match(line)
        if not m or line.lstrip().startswith("#"):
            out.append(line)
            continue
        depth = len(m["indent"]) // 2
        path = [*path[:depth], m["key"]]
        key = ".".join(path)
        if key not in fields:  # a section header
            out.append(line)
            continue
        head = f"{m['indent']}{m['key']}: {yaml_text(_default(LLMConfig, key)[0])}"
        if m["comment"]:
            column = len(line) - len(m["comment"])
            head = head.ljust(column) if len(head) < column - 1 else head + "  "
            head += m["comment"]
        out.append(head)
    GRPO_EXAMPLE.write_text("\n".join(out) + "\n")
    present = _yaml_leaf_keys(yaml.safe_load(GRPO_EXAMPLE.read_text()), LLMConfig)
    return [f"{GRPO_EXAMPLE.name}: {k} (add it)" for k in sorted(fields - present)] + [
        f"{GRPO_EXAMPLE.name}: {k} (no such field; remove it)" for k in sorted(present - fields)
    ]


if __name__ == "__main__":
    if sys.argv[1:] != ["--sync"]:
        sys.exit("usage: python tests/test_docs.py --sync   (rewrite the defaults in docs/config.md and the example)")
    todo = sync_config_doc() + sync_grpo_example()
    print("synced docs/config.md defaults and examples/arithmetic_grpo.yaml values")
    for item in todo:
        print("  by hand:", item)
    sys.exit(1 if todo else 0)
